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


def run_cli(*args, env=None, timeout=600):
    import subprocess

    return subprocess.run([sys.executable, "-m", "gemma_tpu_helpers", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})}, cwd=REPO)
