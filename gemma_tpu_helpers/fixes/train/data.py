"""Instruction data in the CodeV-R1 SFT schema (``system``, ``prompt``, ``response``), made into packed rows.

Every source (a local file, a local copy of a dataset repository, a Hub id) loads through ``datasets.load_dataset``.
:func:`prepare` is the whole pipeline: load, split, pick what is trained on and tokenise with an assistant-only loss
mask (:mod:`chat_tokens`), pack (:mod:`packing`). ``packing.batches`` then feeds the packed rows to training.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import numpy as np

from ..core.errors import DataError
from ..core.file_io import is_remote, local_copy
from .chat_tokens import tokenize_rows, training_target
from .packing import Packed, pack, pad_to_max


@dataclasses.dataclass(frozen=True)
class DataSpec:
    # A local .jsonl/.json/.parquet file, a local dataset directory, a HF dataset id or a gs:// copy of one of those.
    source: str
    config: str | None = None  # the dataset's config: CodeV-R1 declares "sft" and "rl" and has no default
    split: str = "train"
    max_rows: int | None = None  # keep the first rows only (None: all)
    # What is trained on from a response (training_target): "answer", "verilog" or "full".
    target: str = "answer"
    # The system turn: "none", "fixed" (system_prompt) or "row" (the row's own `system` field, else system_prompt).
    system: str = "none"
    system_prompt: str | None = None
    overlong: str = "drop"  # "drop" or "trim" examples longer than max_seq_len
    eval_fraction: float = 0.05
    pack: bool = True
    columns: tuple[tuple[str, str], ...] = ()  # source column -> schema column, e.g. (("question", "prompt"),)
    cache_dir: str | None = None  # where a gs:// source's local copy goes (None: DEFAULT_GS_COPIES)

    @property
    def strip_think(self) -> bool:
        """True when the <think> reasoning is not trained on."""
        return self.target != "full"

REQUIRED = ("prompt", "response")
DEFAULT_GS_COPIES = Path(tempfile.gettempdir()) / "gs-data"  # a gs:// source's local copy, unless cache_dir says
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_dataset_args(source: str, config: str | None = None, cache_dir: str | os.PathLike | None = None
                      ) -> tuple[tuple, dict]:
    """``datasets.load_dataset`` arguments for a source: ``(path[, config]), kwargs``."""
    if is_remote(source):  # datasets reads a repository's configs from local files only: a synced local copy
        source = str(local_copy(source, cache_dir or DEFAULT_GS_COPIES))
    path = Path(os.path.abspath(os.path.expanduser(source)))  # a local file or folder, relative to the current dir
    if path.is_file():
        builder = _FILE_BUILDERS.get(path.suffix)
        if builder is None:
            raise DataError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(_FILE_BUILDERS)}.")
        if config:
            raise DataError(f"{path} is a single file: it has no configs, so drop config={config!r}.",
                            params=("config",))
        if path.stat().st_size == 0:  # datasets' json builder fails on it with a bare StopIteration
            raise DataError(f"{path} is empty: a data file needs at least one row.")
        return (builder,), {"data_files": str(path)}
    if path.is_dir():  # a local dataset directory
        source = str(path)
    # A dataset id on the Hub, or a local dataset directory: the same call either way.
    return ((source, config) if config else (source,)), {}


def _where(source: str, config: str | None, split: str) -> str:
    return f"{source!r}" + (f" (config {config!r}, split {split!r})" if config else f" (split {split!r})")


def load_rows(source: str, split: str = "train", columns: dict[str, str] | None = None,
              config: str | None = None, max_rows: int | None = None, cache_dir: str | os.PathLike | None = None):
    """A ``datasets.Dataset`` with ``prompt`` and ``response`` columns (and ``system`` where the source has it).

    - ``config``: the dataset's config, for repositories that declare several (``zhuyaoyu/CodeV-R1-dataset`` has
      ``sft`` and ``rl`` and no default).
    - ``columns`` renames a source's columns to the schema, e.g. ``{"instruction": "prompt", "output": "response"}``.
    - ``max_rows`` keeps the first rows only (the paper trained on the first 10,000 of the 87K).
    - ``cache_dir``: where a ``gs://`` source is copied to (``datasets`` reads a repository's configs locally).

    A missing config, split or column is a :class:`DataError` that lists the ones that exist.
    """
    import datasets

    if max_rows is not None and max_rows < 1:
        raise DataError(f"max_rows must be a positive number of rows (or None for all), got {max_rows}.")
    args, kwargs = load_dataset_args(source, config, cache_dir)
    where = _where(source, args[1] if len(args) > 1 else None, split)
    try:
        ds = datasets.load_dataset(*args, split=split, **kwargs)
    except FileNotFoundError as e:
        raise DataError(f"Could not find data source {source!r}: {e}. Give a local file or folder, "
                        f"or a dataset id.") from e
    except datasets.exceptions.DatasetGenerationError as e:
        cause = e.__cause__ or e
        raise DataError(f"Could not read the files of {where}: {type(cause).__name__}: {cause}. datasets picks one "
                        f"builder for a whole repository from its file types, so a config whose files are of another "
                        f"type fails this way; read those files directly, e.g. "
                        f"load_rows('path/to/file.parquet').") from e
    except ValueError as e:  # datasets: "Config name is missing", "BuilderConfig ... not found", "Unknown split"
        said = " ".join(str(e).split())
        raise DataError(f"Could not load {where}: {said} Use a config and split that exist, as listed "
                        f"(DataSpec.config / DataSpec.split, or load_rows(..., config=..., split=...); "
                        f"config=None for a source without configs).", params=("config", "split")) from e
    if columns:
        absent = [c for c in columns if c not in ds.column_names]
        if absent:
            raise DataError(f"Data source {where} has no column(s) {absent} to rename; its columns are "
                            f"{ds.column_names}. Fix DataSpec.columns (the real CodeV-R1 SFT rows need none).")
        ds = ds.rename_columns(columns)
    missing = [c for c in REQUIRED if c not in ds.column_names]
    if missing:
        raise DataError(
            f"Data source {where} lacks column(s) {missing}; it has {ds.column_names}. The CodeV-R1 SFT schema "
            f"needs {list(REQUIRED)}; map yours with columns={{'your_name': 'prompt', ...}}."
        )
    if len(ds) == 0:
        raise DataError(f"Data source {where} has no rows.")
    if max_rows is not None and max_rows < len(ds):
        ds = ds.select(range(max_rows))
    return ds


def load_call(spec) -> str:
    """The ``datasets.load_dataset`` call a DataSpec makes, as text (and the row limit it applies)."""
    args, kwargs = load_dataset_args(spec.source, spec.config, spec.cache_dir)
    parts = [repr(a) for a in args] + [f"split={spec.split!r}"] + [f"{k}={v!r}" for k, v in kwargs.items()]
    limit = f", then the first {spec.max_rows:,} rows" if spec.max_rows else ""
    return f"datasets.load_dataset({', '.join(parts)}){limit}"


def split_rows(rows, eval_fraction: float, seed: int):
    """A deterministic train/eval split of a ``datasets.Dataset`` (at least one eval row when asked for any)."""
    if not 0 <= eval_fraction < 1:
        raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction}.")
    n_eval = max(1, round(len(rows) * eval_fraction)) if eval_fraction > 0 else 0
    perm = np.random.RandomState(seed).permutation(len(rows))
    return rows.select(np.sort(perm[n_eval:])), rows.select(np.sort(perm[:n_eval]))


@dataclasses.dataclass
class Prepared:
    train: Packed
    eval: Packed
    lengths: np.ndarray  # tokens per training example, before fitting
    empty_targets: int = 0  # rows dropped before the split: no answer left (e.g. reasoning cut off)


NO_CONFIG = "none"  # with_source's config for a source without configs


def with_source(spec: DataSpec, source: str | None = None, config: str | None = None) -> DataSpec:
    """``spec`` reading from ``source`` (a copy of the repository, another dataset id, or a file) and/or with another
    ``config`` (``"none"``: no configs). Without a ``config`` a file drops the spec's, anything else keeps it."""
    if source is None and config is None:
        return spec
    if config is None:
        local = source is not None and (
            Path(source).suffix in _FILE_BUILDERS if is_remote(source) else os.path.isfile(os.path.expanduser(source)))
        config = None if local else spec.config
    elif config == NO_CONFIG:
        config = None
    return dataclasses.replace(spec, source=source or spec.source, config=config)


def load_profile_rows(spec):
    """The rows a profile's DataSpec names: its source, config, split, column mapping and row limit (another copy of
    the data: :func:`with_source`)."""
    return load_rows(spec.source, split=spec.split, columns=dict(spec.columns) or None, config=spec.config,
                     max_rows=spec.max_rows, cache_dir=spec.cache_dir)


def prepare(spec: DataSpec, tokenizer, max_seq_len: int, seed: int = 0, progress: bool = True) -> Prepared:
    """Load, split (``seed``), normalise, tokenise and pack to ``max_seq_len`` the data ``spec`` names."""
    rows = load_profile_rows(spec)
    kept = rows.filter(lambda r: bool(training_target(r["response"], spec.target).strip()))
    train_rows, eval_rows = split_rows(kept, spec.eval_fraction, seed)
    layout = pack if spec.pack else pad_to_max
    train_ex = tokenize_rows(train_rows, tokenizer, progress=progress, spec=spec)
    eval_ex = tokenize_rows(eval_rows, tokenizer, progress=progress, spec=spec)
    pad = tokenizer.pad_token_id or 0
    return Prepared(layout(train_ex, max_seq_len, spec.overlong, pad),
                    layout(eval_ex, max_seq_len, spec.overlong, pad) if eval_ex else None,
                    np.array([len(ids) for ids, _ in train_ex]), len(rows) - len(kept))
