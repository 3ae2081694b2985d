"""On the day of a workshop: is this laptop ready (``setup --check``).

:func:`readiness` checks, each with what to do when it fails: the two virtual envs, Icarus Verilog, the devices JAX
sees (and the cores behind them), free RAM and disk, the tiny model, the executed notebooks, Chromium (for the site
test), and, with ``serve=True`` (slow: 60-100 s on a CPU), that the vLLM server starts and answers.
Nothing here imports JAX at import time (the notebooks' "Open in Colab" badges: :mod:`.colab`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ...fixes.eval import eval_simulate
from ...fixes.model.gemma4 import check_checkpoint
from ...fixes.model.hf_checkpoint import CheckpointError
from ...fixes.serve.vllm_command import ServeError
from ...fixes.serve.vllm_server import start
from ..config import paths, profiles
from ..config.paths import serve_python
from . import preflight
from .site import find_chromium

COURSE_NOTEBOOKS = 11  # 00..10
# Guidance, not measurements: a notebook kernel with the tiny model plus the vLLM CPU server (KV cache 1 GiB).
RAM_WARN_GIB, RAM_FAIL_GIB = 8.0, 4.0
# The venvs take about 6 GB of wheels to build; once built, runs/smoke holds well under 1 GB.
DISK_WARN_GIB, DISK_FAIL_GIB = 10.0, 2.0
SUBPROCESS_TIMEOUT_S = 60
OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "skip"
TRAINING_PACKAGES = ("jax", "flax", "tunix", "qwix", "orbax", "transformers", "nbclient", "nbconvert")


# ---------------------------------------------------------------------------------------------- readiness


@dataclasses.dataclass
class Item:
    name: str
    status: str  # OK | WARN | FAIL | SKIP
    detail: str
    fix: str = ""


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _check_training_venv() -> Item:
    missing = [p for p in TRAINING_PACKAGES if importlib.util.find_spec(p) is None]
    where = sys.prefix
    if missing:
        return Item("training venv", FAIL, f"{where}: missing {', '.join(missing)}",
                    "make venv (or: pip install -r requirements.txt && pip install --no-deps -e .)")
    return Item("training venv", OK, f"{where} ({len(TRAINING_PACKAGES)} key packages import)")


def _check_serve_venv() -> Item:
    try:
        py = serve_python(check=True)
    except ServeError:
        return Item("serving venv", FAIL, ".venv-serve/bin/python does not exist", "make serve-venv")
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        r = subprocess.run([str(py), "-c", code], capture_output=True, timeout=SUBPROCESS_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Item("serving venv", FAIL, f"{py} does not run ({e})", "rm -rf .venv-serve && make serve-venv")
    if r.returncode:
        return Item("serving venv", FAIL, f"{py} has no vllm", "rm -rf .venv-serve && make serve-venv")
    return Item("serving venv", OK, f"{py} (vllm importable)")


def _check_iverilog() -> Item:
    try:
        iv, _ = eval_simulate.simulator_tools(paths.iverilog())  # the lookup the evaluation itself uses
    except Exception as e:  # IverilogNotFoundError and kin: the message says what to install
        return Item("iverilog", FAIL, str(e).split(". ")[0], eval_simulate.INSTALL_HINT)
    try:
        first = subprocess.run([iv, "-V"], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S).stdout
        version = first.splitlines()[0] if first else "version unknown"
    except (OSError, subprocess.TimeoutExpired):
        version = "version unknown"
    return Item("iverilog", OK, f"{iv}: {version}")


def _check_devices(profile) -> list[Item]:
    import jax

    want = profile.hardware.num_devices
    devs = jax.devices()
    items = []
    if len(devs) != want and profile.hardware.platform == "cpu":
        items.append(Item("devices", FAIL, f"JAX sees {len(devs)} {devs[0].platform} device(s), profile "
                          f"{profile.name} needs {want}", "JAX was imported before XLA_FLAGS was set: restart "
                          "the kernel and run the `parameters` cell first"))
    else:
        items.append(Item("devices", OK if len(devs) >= want else FAIL,
                          f"{len(devs)} x {devs[0].device_kind} ({jax.default_backend()}); profile needs {want}",
                          "" if len(devs) >= want else f"use a profile that fits {len(devs)} device(s)"))
    cores = os.cpu_count() or 1
    if profile.hardware.platform == "cpu" and cores < want:
        items.append(Item("CPU cores", WARN, f"{cores} cores behind {want} virtual devices: it works, more slowly",
                          "close other programs; expect about twice the times in the course map"))
    else:
        items.append(Item("CPU cores", OK, f"{cores} cores"))
    return items


def _check_ram() -> Item:
    avail = preflight.mem_available()
    if avail is None:
        return Item("free RAM", WARN, "cannot read the free memory on this system", f"have {RAM_WARN_GIB:g} GiB free")
    gib = avail / 2**30
    status = FAIL if gib < RAM_FAIL_GIB else WARN if gib < RAM_WARN_GIB else OK
    return Item("free RAM", status, f"{_gib(avail)} available (want {RAM_WARN_GIB:g} GiB)",
                "" if status == OK else "close browser tabs and other kernels; stop old vLLM servers "
                                        "(ps aux | grep vllm)")


def _check_disk(run_dir: Path) -> Item:
    probe = run_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    gib = free / 2**30
    status = FAIL if gib < DISK_FAIL_GIB else WARN if gib < DISK_WARN_GIB else OK
    return Item("free disk", status, f"{_gib(free)} free at {probe} (want {DISK_WARN_GIB:g} GiB)",
                "" if status == OK else "free some space, or point GEMMA_TPU_RUNS at a bigger disk")


def _check_model(profile, run_dir: Path) -> Item:
    base = run_dir / "base"
    what = "tiny model" if profile.model.source == "tiny" else "base checkpoint"
    try:
        check_checkpoint(base)
    except CheckpointError as e:
        fix = (f"make demo (or: python -m gemma_tpu_helpers tiny-model {base})" if profile.model.source == "tiny"
               else f"download {profile.model.source} (notebook 00; needs HF_TOKEN and the licence accepted)")
        return Item(what, FAIL, str(e).split(". ")[0], fix)
    return Item(what, OK, f"{base}")


def _check_executed(run_dir: Path) -> Item:
    done = sorted((run_dir / "executed").glob("[0-9][0-9]_*.ipynb"))
    if len(done) >= COURSE_NOTEBOOKS:
        return Item("pre-built run", OK, f"{len(done)} executed notebooks in {run_dir / 'executed'}")
    return Item("pre-built run", WARN, f"{len(done)} of {COURSE_NOTEBOOKS} notebooks executed",
                "make demo once before the workshop (then everything runs offline)")


def _check_chromium() -> Item:
    path = find_chromium()
    if not path:
        return Item("chromium", WARN, "not installed (only the site test and its screenshot need it)",
                    "sudo apt-get install chromium (make test does it)")
    return Item("chromium", OK, path)


def _check_server(profile, run_dir: Path) -> Item:
    if profile.hardware.platform != "cpu":
        return Item("vLLM server", SKIP, f"{profile.name} serves on a TPU VM (docker)", "")
    t0 = time.perf_counter()
    try:
        log = run_dir / "serve" / "setup_check.log"
        with start(profile.serving, run_dir / "base", progress=False, log_path=log) as s:
            models = s.models()
    except (ServeError, OSError) as e:
        return Item("vLLM server", FAIL, str(e).splitlines()[0], "read runs/<profile>/serve/setup_check.log; "
                    "make serve-venv; check free RAM")
    return Item("vLLM server", OK, f"started, healthy and serving {models} in {time.perf_counter() - t0:.0f} s")


def _preflight(profile, run_dir: Path) -> list[Item]:
    """A TPU profile: the TPU pre-flight (chips, who holds them, HBM, disk, RAM, versions), read without JAX."""
    status = {"ok": OK, "warn": WARN, "fail": FAIL, "skip": SKIP}
    return [Item(c.name, status.get(c.status, c.status), c.detail) for c in preflight.checks(profile, run_dir)]


def readiness(profile_name: str | None = None, serve: bool = False, runs: str | None = None) -> list[Item]:
    """Every readiness check for ``profile_name`` (configures JAX for it first; a TPU profile's devices are read by
    the pre-flight, without importing JAX)."""
    prof = profiles.configure_jax(profile_name)
    run_dir = prof.run_dir(runs)
    if prof.hardware.platform == "tpu":
        machine = _preflight(prof, run_dir)
    else:
        machine = [_check_serve_venv(), *_check_devices(prof), _check_ram(), _check_disk(run_dir)]
    model = _check_model(prof, run_dir)
    items = [_check_training_venv(), _check_iverilog(), *machine, model, _check_executed(run_dir), _check_chromium()]
    if serve and model.status == OK:
        items.append(_check_server(prof, run_dir))
    elif serve:
        items.append(Item("vLLM server", SKIP, "no model to serve yet", "build the model first (see above)"))
    elif prof.hardware.platform == "tpu":
        items.append(Item("vLLM server", SKIP, "on a TPU VM vLLM runs in docker (notebook 08 prints the command)"))
    else:
        items.append(Item("vLLM server", SKIP, "not started (takes 60-100 s on a CPU)",
                          "python -m gemma_tpu_helpers setup --check --serve"))
    return items


def format_items(items: list[Item]) -> str:
    width = max(len(i.name) for i in items)
    lines = []
    for i in items:
        lines.append(f"{i.status:4s}  {i.name:{width}s}  {i.detail}")
        if i.fix and i.status != OK:
            lines.append(f"{'':4s}  {'':{width}s}  -> {i.fix}")
    fails = sum(i.status == FAIL for i in items)
    lines.append("ready" if not fails else f"not ready: {fails} item(s) to fix")
    return "\n".join(lines)

