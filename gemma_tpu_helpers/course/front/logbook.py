"""The course map, the environment report and the run report (notebook 00 and `make demo`)."""

from __future__ import annotations

import json
import os
import platform
import time
from importlib import metadata
from pathlib import Path

from ...fixes.core import file_io
from ...fixes.train.multihost import is_main
from ..config import paths

NOTEBOOKS_DIR = paths.NOTEBOOKS_DIR

# Every time, pass@1, GiB and ratio the README, docs/ and the course map quote (tests/fast/test_figures.py).
QUOTED_FIGURES = paths.DATA_DIR / "quoted_figures.json"
_FIGURES = {f["id"]: f for f in json.loads(QUOTED_FIGURES.read_text())["figures"]}


def cpu_time(notebook: str) -> str:
    """The notebook's CPU time in the smoke profile, measured cold on an idle 2-core machine."""
    return f"{_FIGURES['course.cpu.' + notebook]['value']} s"


def tpu_time(notebook: str) -> str:
    """The notebook's time on its TPU profile: an estimate, never measured on a TPU."""
    f = _FIGURES["course.tpu." + notebook]
    value = "-".join(map(str, f["value"])) if isinstance(f["value"], list) else f["value"]
    return f"~{value} {f['unit']} (est.: {f['note']})"


# notebook -> the paper's fix it teaches -> what it imports from the package -> CPU time (smoke) -> TPU estimate
_NOTEBOOKS = [
    ("00_setup", "Environment, profiles, the tiny Gemma 4, logits parity",
     "fixes.model.parity, fixes.model.gemma4, course.config.tiny, course.config.profiles"),
    ("01_mesh_setup", "Mesh configuration: tp=4, Auto axes, the mesh context",
     "fixes.model.mesh, fixes.train.multihost"),
    ("02_lora_naming", "LoRA module naming (HF names vs tunix einsums)", "fixes.train.lora, fixes.model.layout"),
    ("03_sharding_annotation", "Sharding annotation corrections", "fixes.model.sharding"),
    ("04_gradient_checkpointing", "Gradient checkpointing + AOT 'fits on v5p-8' plan",
     "fixes.train.remat, course.budget.plan"),
    ("05_data_pipeline", "Data pipeline restructuring: chat format, loss mask, packing", "fixes.train.data"),
    ("06_training", "LoRA training, checkpoints, resume, GPU-recipe equivalence, the learning check's training",
     "fixes.train.sft, fixes.train.data, course.training.train, course.training.equivalence, "
     "course.training.learning_check"),
    ("07_orbax_merge", "Orbax -> safetensors merge, streamed and verified",
     "fixes.export.merge, fixes.export.weight_check, fixes.export.verify, fixes.export.peft_export"),
    ("08_vllm_serving", "vLLM-TPU setup (vLLM CPU build here)",
     "fixes.serve.vllm_server, fixes.serve.vllm_command, fixes.serve.vllm_client, fixes.model.greedy"),
    ("09_evaluation", "VerilogEval-style pass@k with iverilog; the learning check, before and after",
     "fixes.eval.eval_score, fixes.eval.eval_sample, fixes.eval.eval_simulate, course.training.learning_check"),
    ("10_benchmark_and_cost", "vllm bench serve sweep and TPU-vs-GPU cost",
     "course.budget.serving_bench, course.budget.cost"),
]
COURSE = [(nb, fix, mods, cpu_time(nb), tpu_time(nb)) for nb, fix, mods in _NOTEBOOKS]

VERSIONED = ["jax", "jaxlib", "flax", "google-tunix", "qwix", "optax", "orbax-checkpoint", "grain", "transformers",
             "safetensors", "tokenizers", "datasets", "torch", "libtpu"]


def course_map():
    """The course as a table; `available` says which notebooks exist in this checkout."""
    import pandas as pd

    rows = [
        {"notebook": nb, "paper's fix": fix, "helpers": mods, "CPU (smoke)": cpu,
         "TPU (estimate, never measured)": tpu, "available": (NOTEBOOKS_DIR / f"{nb}.ipynb").is_file()}
        for nb, fix, mods, cpu, tpu in COURSE
    ]
    return pd.DataFrame(rows)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def devices() -> dict:
    import jax

    devs = jax.devices()
    return {"backend": jax.default_backend(), "device_count": len(devs), "kind": devs[0].device_kind,
            "process_count": jax.process_count()}


def record(run_dir: str | Path, step: str, /, **figures) -> dict:
    """Store a step's key figures in ``run_dir/figures.json`` (what `make demo`'s report.md summarises).

    In a multi-process run only process 0 writes (the others get the figures back, unsaved). Read, update and write
    happen under one lock, so notebooks that record at once (two kernels, parallel CI) lose no step."""
    path = Path(run_dir) / "figures.json"
    if not is_main():
        data = json.loads(path.read_text()) if path.is_file() else {}
        return {**data, step: figures}
    with file_io.locked(path, "the course's figures"):
        data = json.loads(path.read_text()) if path.is_file() else {}
        data[step] = figures
        file_io.write_atomic(path, json.dumps(data, indent=1, sort_keys=True, default=str))
    return data


def write_report(run_dir: str | Path) -> Path:
    """``run_dir/report.md``: one section per step, with the figures each notebook recorded."""
    run_dir = Path(run_dir)
    path = run_dir / "figures.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    lines = [f"# gemma-tpu run report: {run_dir.name}", ""]
    if not data:
        lines.append("No step recorded figures yet (run the notebooks, or `make demo`).")
    for step in sorted(data):
        lines += [f"## {step}", "", "| figure | value |", "| --- | --- |"]
        lines += [f"| {k} | {v} |" for k, v in data[step].items()]
        lines.append("")
    out = run_dir / "report.md"
    if is_main():  # process 0 only in a multi-process run
        file_io.write_atomic(out, "\n".join(lines) + "\n")
    return out


# A Unix socket's path holds at most 107 bytes on Linux, 103 on macOS; a kernel's five are <ip>-1 to <ip>-5.
_IPC_PATH_MAX = 103


def kernel_config():
    """The config of the kernels that run the notebooks (``make demo``, nbmake): the ``ipc`` transport in Jupyter's
    private runtime directory, since ipykernel 7 warns about unencrypted TCP on every start. The socket path is
    absolute (jupyter_client's relative default resolves apart in kernel and client); TCP where there are no Unix
    sockets or the path would be too long."""
    import secrets

    from jupyter_core.paths import jupyter_runtime_dir
    from traitlets.config import Config

    ip = Path(jupyter_runtime_dir()) / f"kernel-{secrets.token_hex(8)}-ipc"
    if os.name != "posix" or len(str(ip)) + 2 > _IPC_PATH_MAX:
        return Config()
    ip.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return Config({"KernelManager": {"transport": "ipc", "ip": str(ip)}})


def notebook_client(nb, **kwargs):
    """``nbclient.NotebookClient(nb, **kwargs)`` whose kernel starts with :func:`kernel_config`."""
    from nbclient import NotebookClient

    return NotebookClient(nb, config=kernel_config(), **kwargs)


def run_notebooks(profile_name: str, run_dir: str | Path, notebooks: list[Path] | None = None,
                  timeout: int = 1200) -> list[dict]:
    """Execute the course notebooks in order under ``profile_name``; executed copies go to ``run_dir/executed``.

    Stops at the first failing notebook, keeping its executed copy (with the error) for inspection.
    """
    import nbformat
    from tqdm.auto import tqdm

    run_dir = Path(run_dir)
    out_dir = run_dir / "executed"
    out_dir.mkdir(parents=True, exist_ok=True)
    notebooks = notebooks or sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
    paths.set_settings({paths.PROFILE_ENV: profile_name, paths.RUNS_ENV: str(run_dir.parent.resolve())})
    results = []
    for nb_path in tqdm(notebooks, desc="notebooks"):
        nb = nbformat.read(nb_path, as_version=4)
        start = time.perf_counter()
        error = None
        try:
            notebook_client(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(nb_path.parent)}}).execute()
        except Exception as e:  # keep the executed copy, report, stop
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        file_io.write_atomic(out_dir / nb_path.name, nbformat.writes(nb))
        results.append({"notebook": nb_path.stem, "seconds": round(time.perf_counter() - start, 1), "error": error})
        if error:
            break
    record(run_dir, "demo", **{r["notebook"]: (f"{r['seconds']} s" if not r["error"] else r["error"]) for r in results})
    return results
