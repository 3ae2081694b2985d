"""Shared fixtures. JAX gets 8 virtual CPU devices (the smoke profile) before anything imports it."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("GEMMA_TPU_PROFILE", "smoke")
from gemma_tpu_helpers import profiles  # noqa: E402

SMOKE = profiles.configure_jax("smoke")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def smoke():
    return SMOKE


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """One tiny checkpoint for the whole session (read-only for tests: copy it before changing it)."""
    from gemma_tpu_helpers import tiny

    return tiny.write_tiny_model(tmp_path_factory.mktemp("tiny") / "base", seed=0, layers=6)


@pytest.fixture(scope="session")
def mesh():
    from gemma_tpu_helpers import mesh as mesh_lib

    return mesh_lib.make_mesh(SMOKE)


@pytest.fixture(scope="session")
def tunix_model(tiny_dir, mesh):
    from gemma_tpu_helpers import gemma4

    return gemma4.load_model(tiny_dir, mesh, dtype="float32")


SMOKE_RUN_STEPS, SMOKE_RUN_EVERY = 4, 2


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, tiny_dir):
    """One uninterrupted smoke training in this process: SMOKE_RUN_STEPS steps, a checkpoint every SMOKE_RUN_EVERY.
    The reference of test_train (a killed and resumed run) and of test_multihost (two processes); trained once.
    Read-only for tests: copy it before changing it. (run_dir, TrainResult)."""
    from gemma_tpu_helpers import train

    run_dir = tmp_path_factory.mktemp("smoke_run")
    return run_dir, train.train(SMOKE, run_dir=run_dir, base_dir=tiny_dir, max_steps=SMOKE_RUN_STEPS,
                                checkpoint_every=SMOKE_RUN_EVERY, progress=False)


def run_cli(*args, env=None, timeout=600):
    import subprocess

    return subprocess.run([sys.executable, "-m", "gemma_tpu_helpers", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})}, cwd=REPO)

