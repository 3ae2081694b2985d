"""Instruction data in the CodeV-R1 SFT schema (``prompt``, ``response`` with a fenced Verilog block).

One path for every source: the shipped self-written rows, a local .jsonl/.json/.parquet file or directory, or a
Hugging Face dataset id (the real ``zhuyaoyu/CodeV-R1-dataset`` on TPU) all go through ``datasets.load_dataset``.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
SHIPPED_SFT = DATA_DIR / "verilog_sft.jsonl"
SHIPPED_EVAL = DATA_DIR / "eval"
REQUIRED = ("prompt", "response")
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(ValueError):
    pass


def _load_dataset_args(source: str) -> tuple[tuple, dict]:
    if source == "shipped":
        return ("json",), {"data_files": str(SHIPPED_SFT)}
    path = Path(source)
    if path.is_file():
        builder = _FILE_BUILDERS.get(path.suffix)
        if builder is None:
            raise DataError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(_FILE_BUILDERS)}.")
        return (builder,), {"data_files": str(path)}
    # A dataset id on the Hub, or a local dataset directory: the same call either way.
    return (source,), {}


def load_rows(source: str = "shipped", split: str = "train", columns: dict[str, str] | None = None):
    """A ``datasets.Dataset`` with ``prompt`` and ``response`` columns.

    ``columns`` renames a source's columns to the schema, e.g. ``{"instruction": "prompt", "output": "response"}``.
    """
    import datasets

    args, kwargs = _load_dataset_args(source)
    try:
        ds = datasets.load_dataset(*args, split=split, **kwargs)
    except FileNotFoundError as e:
        raise DataError(f"Could not find data source {source!r}: {e}. Give 'shipped', a local file, or a dataset id.") from e
    if columns:
        ds = ds.rename_columns(columns)
    missing = [c for c in REQUIRED if c not in ds.column_names]
    if missing:
        raise DataError(
            f"Data source {source!r} lacks column(s) {missing}; it has {ds.column_names}. The CodeV-R1 SFT schema "
            f"needs {list(REQUIRED)}; map yours with columns={{'your_name': 'prompt', ...}}."
        )
    if len(ds) == 0:
        raise DataError(f"Data source {source!r} (split {split!r}) has no rows.")
    return ds
