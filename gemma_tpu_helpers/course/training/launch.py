"""The pod launcher: the same course step on every worker of a TPU pod (one ``gcloud ... ssh --worker=all`` line), or
on local processes for a test, with the coordinator and process ids filled in."""

from __future__ import annotations

import shlex
import sys
import time

from ...fixes.train.multihost import MultihostError
from ..config import paths

# Steps that run on every worker of a pod (they join with jax.distributed); the others run on worker 0 only.
ALL_WORKERS = ("train",)


def launch_commands(workers: int, step_args: list[str], tpu: str | None = None, zone: str | None = None,
                    coordinator: str = "127.0.0.1:8476", workdir: str = "gemma-tpu",
                    python: str = ".venv/bin/python", env: dict[str, str] | None = None) -> list[list[str]]:
    """The commands that run a course step on a pod: one ``gcloud ... ssh --worker=all`` line for a TPU (JAX detects
    the pod, ``--coordinator auto``), else one command per worker with an explicit coordinator and process id."""
    if workers < 1:
        raise MultihostError(f"--workers must be at least 1, got {workers}.")
    if not step_args:
        raise MultihostError("give the step to run after '--', e.g. launch --workers 2 -- train --max-steps 10")
    step, rest = step_args[0], list(step_args[1:])
    joined = step in ALL_WORKERS
    if joined and "--coordinator" in rest:
        raise MultihostError("launch sets --coordinator/--num-processes/--process-id itself; drop them after '--'.")
    module = [python, "-m", "gemma_tpu_helpers", step, *rest]
    prefix = [f"{k}={v}" for k, v in (env or {}).items()]
    if tpu:
        if not zone:
            raise MultihostError("--tpu needs --zone (the zone of the TPU VM, e.g. us-east5-a).")
        remote = " ".join([f"cd {shlex.quote(workdir)} &&", *prefix, *map(shlex.quote, module),
                           *(["--coordinator", "auto"] if joined else [])])
        return [["gcloud", "compute", "tpus", "tpu-vm", "ssh", tpu, f"--zone={zone}",
                 f"--worker={'all' if joined else 0}", f"--command={remote}"]]
    if not joined:
        return [[*prefix, *module]]
    return [[*prefix, *module, "--coordinator", coordinator, "--num-processes", str(workers), "--process-id", str(i)]
            for i in range(workers)]


def _quote(arg: str) -> str:
    key, sep, value = arg.partition("=")
    if sep and (key.startswith("--") or key.isidentifier()):  # --flag=value, KEY=value: quote the value only
        return f"{key}={shlex.quote(value)}"
    return shlex.quote(arg)


def format_commands(commands: list[list[str]]) -> str:
    """The commands as shell lines, one per worker."""
    return "\n".join(" ".join(map(_quote, cmd)) for cmd in commands)


def run_commands(commands: list[list[str]], timeout_s: float | None = None, wait_on: tuple[int, ...] = ()) -> int:
    """Run the commands at once on this machine (local workers, or the one gcloud line); the first failure (or the
    timeout) ends the others. Returns the first non-zero exit code, else 0. An exit code in ``wait_on`` ends nothing
    (a preempted worker, ``preemption.PREEMPTED_EXIT``: the others are saving the same step and stop by
    themselves); it is returned once all have stopped."""
    import subprocess

    procs = []
    for cmd in commands:
        env_vars = {}
        while cmd and "=" in cmd[0] and not cmd[0].startswith("-"):
            k, v = cmd[0].split("=", 1)
            env_vars[k], cmd = v, cmd[1:]
        procs.append(subprocess.Popen(cmd, env=paths.child_env(env_vars)))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0, *wait_on)]
            if failed:
                return failed[0]
            if None not in codes:
                return next((c for c in codes if c != 0), 0)
            if deadline is not None and time.monotonic() > deadline:
                print(f"launch: workers still running after {timeout_s:g} s; stopping them", file=sys.stderr)
                return 124
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

