"""The course's own locations, read from the environment in this one module and passed down to the fixes as plain
arguments: the checkout, the shipped data, the cache, the serving venv and the Icarus Verilog that ``make iverilog``
builds."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..fixes.file_io import config_hash, write_atomic
from ..fixes.vllm_command import ServeError

REPO = Path(__file__).resolve().parents[2]
DATA_DIR = Path(__file__).resolve().parents[1] / "data"
SHIPPED_REPLICA = DATA_DIR / "codev_r1_replica"  # the layout of zhuyaoyu/CodeV-R1-dataset, self-written rows
SHIPPED_CONFIG = "sft"
SHIPPED_SFT = SHIPPED_REPLICA / "codev_r1_sft.jsonl"
SHIPPED_EVAL = DATA_DIR / "eval"  # the course's 28 self-written problems in the VerilogEval v2 layout

CACHE_ENV = "GEMMA_TPU_CACHE"  # the course's cache (default ~/.cache/gemma-tpu): gs:// data copies under gs/
TOOLS_ENV = "GEMMA_TPU_TOOLS"  # where `make iverilog` builds Icarus Verilog 12 (default: the cache)
IVERILOG_ENV = "GEMMA_TPU_IVERILOG"  # another iverilog to use (its vvp beside it)
SERVE_PYTHON_ENV = "GEMMA_TPU_SERVE_PYTHON"  # the python that has vLLM (default .venv-serve/bin/python)
SERVE_VENV = REPO / ".venv-serve"  # vLLM pins a transformers that tunix cannot share: its own venv
BUILD_IVERILOG = ("`make iverilog` (or `tools/build_iverilog.sh`) builds Icarus Verilog 12.0 into "
                  f"${TOOLS_ENV}/iverilog-12 in about 5 minutes; `conda install -c conda-forge iverilog=12` also works")


def on_colab() -> bool:
    """This Python runs in a Colab runtime (``google.colab`` importable)."""
    import importlib.util

    try:
        return importlib.util.find_spec("google.colab") is not None
    except ModuleNotFoundError:  # no google namespace at all
        return False


def data_source(text: str) -> str:
    """A ``--source`` as the data fix takes it: ``shipped`` names the course's replica, anything else is as given."""
    return str(SHIPPED_REPLICA) if text == "shipped" else text


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "gemma-tpu")


def gs_copies() -> Path:
    """Where a gs:// data source's local copy goes (``datasets`` reads a repository's configs from local files)."""
    return cache_dir() / "gs"


def iverilog_prefix() -> Path:
    return Path(os.environ.get(TOOLS_ENV) or cache_dir()) / "iverilog-12"


def iverilog() -> str | None:
    """The iverilog the course uses: $GEMMA_TPU_IVERILOG, else the one `make iverilog` built, else PATH's."""
    built = iverilog_prefix() / "bin" / "iverilog"
    chosen = os.environ.get(IVERILOG_ENV) or (str(built) if built.is_file() else None)
    return chosen or shutil.which("iverilog")


def use_course_iverilog() -> None:
    """Put the course's iverilog first on PATH, where the simulation fix (and any process started from here) finds
    it. Called once, when the course is imported."""
    chosen = iverilog()
    if chosen:
        bin_dir = str(Path(chosen).absolute().parent)
        parts = os.environ.get("PATH", "").split(os.pathsep)
        if parts[:1] != [bin_dir]:
            os.environ["PATH"] = os.pathsep.join([bin_dir] + [p for p in parts if p != bin_dir])


def serve_python(check: bool = False) -> Path:
    """The python that runs vLLM: $GEMMA_TPU_SERVE_PYTHON (the Makefile exports it), else ``.venv-serve/bin/python``
    (``make serve-venv``). ``check``: a ServeError that says how to make it when it does not exist."""
    path = Path(os.environ.get(SERVE_PYTHON_ENV) or SERVE_VENV / "bin" / "python")
    if check and not path.is_file():
        raise ServeError(f"The serving venv is missing: {path} does not exist. Create it with `make serve-venv` "
                         f"(vLLM's CPU build in its own venv: it pins a transformers that tunix cannot share), "
                         f"or point ${SERVE_PYTHON_ENV} at a python that has vLLM 0.32.")
    return path


def cached_table(folder, name: str, key: dict, compute):
    """``compute()``'s DataFrame, kept in ``folder/<name>_<hash of key>.json`` (its rows and attrs) and read back from
    there when present: the course's check runs (remat policies, PEFT parity) run once per run directory. The table's
    ``attrs["cached"]`` says which."""
    import pandas as pd

    path = Path(folder) / f"{name}_{config_hash(key, 10)}.json"
    if path.is_file():
        value, cached = json.loads(path.read_text()), True
    else:
        df = compute()
        value, cached = {"rows": df.to_dict(orient="records"), "attrs": df.attrs}, False
        write_atomic(path, json.dumps(value, indent=1, default=str))
    df = pd.DataFrame(value["rows"])
    df.attrs.update(value["attrs"], cached=cached)
    return df
