"""The course's settings and locations, in this one module: the checkout, the shipped data, the runs root, the
cache, the serving venv, the Icarus Verilog that ``make iverilog`` builds, and every environment variable the course
reads or sets. No other course module touches ``os.environ`` or ``__file__`` (tests/fast/test_architecture.py), and
importing the course changes nothing; the fixes get all of it as plain arguments."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ...fixes.core.file_io import config_hash, write_atomic
from ...fixes.serve.vllm_command import ServeError

REPO = Path(__file__).resolve().parents[3]
DATA_DIR = Path(__file__).resolve().parents[2] / "data"
NOTEBOOKS_DIR = REPO / "notebooks"
SHIPPED_REPLICA = DATA_DIR / "codev_r1_replica"  # the layout of zhuyaoyu/CodeV-R1-dataset, self-written rows
SHIPPED_CONFIG = "sft"
SHIPPED_SFT = SHIPPED_REPLICA / "codev_r1_sft.jsonl"
SHIPPED_EVAL = DATA_DIR / "eval"  # the course's 28 self-written problems in the VerilogEval v2 layout

RUNS_ENV = "GEMMA_TPU_RUNS"  # the runs root: run directories go under it as <root>/<profile>
PROFILE_ENV = "GEMMA_TPU_PROFILE"  # the profile the notebooks and commands take by default
TOKEN_ENV = "HF_TOKEN"  # the Hugging Face token huggingface_hub reads (colab.setup fills it from Colab's Secrets)
ACCELERATOR_ENV = "TPU_ACCELERATOR_TYPE"  # a TPU VM's slice type, e.g. v5p-8 (libtpu reads it too)
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


def runs_root() -> str | Path:
    """Where run directories go: $GEMMA_TPU_RUNS, else ``runs/`` in the course checkout (``runs`` in the current
    directory when the package is installed without its checkout)."""
    return os.environ.get(RUNS_ENV) or default_runs_root()


def default_runs_root() -> Path:
    return REPO / "runs" if (REPO / "pyproject.toml").is_file() else Path("runs")


def setting(name: str) -> str | None:
    """One environment variable the course reads (``PROFILE_ENV``, ``TOKEN_ENV``, ``ACCELERATOR_ENV``, XLA_FLAGS ...),
    None when unset or empty."""
    return os.environ.get(name) or None


def set_settings(values: dict[str, str], keep: bool = False) -> None:
    """Set environment variables for this process and the ones it starts (JAX's flags before JAX loads, the runs
    root on Drive, the token); ``keep``: only those not set already. Called by a command or a notebook, never on
    import."""
    for name, value in values.items():
        if keep:
            os.environ.setdefault(name, value)
        else:
            os.environ[name] = value


def child_env(extra: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment for a process it starts, with ``extra`` set and ``drop`` removed."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra or {})
    return env


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "gemma-tpu")


def gs_copies() -> Path:
    """Where a gs:// data source's local copy goes (``datasets`` reads a repository's configs from local files)."""
    return cache_dir() / "gs"


def iverilog_prefix() -> Path:
    return Path(os.environ.get(TOOLS_ENV) or cache_dir()) / "iverilog-12"


def iverilog() -> str | None:
    """The iverilog the course passes to the simulation fix: $GEMMA_TPU_IVERILOG, else the one `make iverilog`
    built, else PATH's (None: none at all; the fix then says how to install one)."""
    built = iverilog_prefix() / "bin" / "iverilog"
    chosen = os.environ.get(IVERILOG_ENV) or (str(built) if built.is_file() else None)
    return chosen or shutil.which("iverilog")


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
