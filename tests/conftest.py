"""Shared fixtures. JAX gets 8 virtual CPU devices (the smoke profile) before anything imports it."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("GEMMA_TPU_PROFILE", "smoke")
from gemma_tpu_helpers.course import profiles  # noqa: E402

SMOKE = profiles.configure_jax("smoke")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def smoke():
    return SMOKE


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """One tiny checkpoint for the whole session (read-only for tests: copy it before changing it)."""
    from gemma_tpu_helpers.course import tiny

    return tiny.write_tiny_model(tmp_path_factory.mktemp("tiny") / "base", seed=0, layers=6)


@pytest.fixture(scope="session")
def mesh():
    from gemma_tpu_helpers.fixes import mesh as mesh_lib

    return SMOKE.make_mesh()


@pytest.fixture(scope="session")
def tunix_model(tiny_dir, mesh):
    from gemma_tpu_helpers.fixes import gemma4

    return gemma4.load_model(tiny_dir, mesh, dtype="float32")


SMOKE_RUN_STEPS, SMOKE_RUN_EVERY = 4, 2


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, tiny_dir):
    """One uninterrupted smoke training in this process: SMOKE_RUN_STEPS steps, a checkpoint every SMOKE_RUN_EVERY.
    The reference of test_train (a killed and resumed run) and of test_multihost (two processes); trained once.
    Read-only for tests: copy it before changing it. (run_dir, TrainResult)."""
    from gemma_tpu_helpers.course import train

    run_dir = tmp_path_factory.mktemp("smoke_run")
    return run_dir, train.train(SMOKE, run_dir=run_dir, base_dir=tiny_dir, max_steps=SMOKE_RUN_STEPS,
                                checkpoint_every=SMOKE_RUN_EVERY, progress=False)


def run_cli(*args, env=None, timeout=600, cwd=REPO):
    """``python -m gemma_tpu_helpers ARGS`` in ``cwd`` (default: the checkout), as a user runs it."""
    import subprocess

    return subprocess.run([sys.executable, "-m", "gemma_tpu_helpers", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd)


# `make test` runs the suite on two pytest-xdist workers. Each module stays on one worker, so a module fixture (a
# training run, a vLLM server) runs once. The modules that start the most processes (vLLM servers, two-process
# training, the documented CLI commands one after another) form one group: they run one after another on one
# worker, while the other runs everything else. test_learn, test_train and test_tiny_e (a vLLM server or CLI
# trainings each) run beside that group: in a clean-clone `make test` (2026-12, pytest 52 min) the group ran to the
# end while the other worker had nothing left to do for about its last 20 min; a vLLM server and two trainings at
# once stay well under 24 GiB (test_learn's server ran beside the group there), and with
# eager smoke serving no two vLLM starts share a torch.compile cache. (xdist's own `--dist loadgroup` cannot do this
# under pytest 9: it renames node ids through an attribute pytest 9 no longer reads.)
SERIAL_GROUP = "processes"
STARTS_PROCESSES = {"test_multihost", "test_serve", "test_bench", "test_user_paths"}


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: its module, or SERIAL_GROUP."""
    module = nodeid.split("::", 1)[0]
    return SERIAL_GROUP if Path(module).stem in STARTS_PROCESSES else module


if importlib.util.find_spec("xdist"):  # the hook exists only with xdist; without it the suite runs in one process

    def pytest_xdist_make_scheduler(config, log):
        from xdist.scheduler import LoadScopeScheduling

        class ModulesAndOneSerialGroup(LoadScopeScheduling):
            def _split_scope(self, nodeid):
                return work_unit(nodeid)

        return ModulesAndOneSerialGroup(config, log)


def have_iverilog() -> bool:
    """Whether Icarus Verilog 12 is installed (``make iverilog``): the eval tests score by simulating."""
    from gemma_tpu_helpers.fixes import evaluate

    try:
        return bool(evaluate.simulator_tools())
    except evaluate.IverilogNotFoundError:
        return False
