"""gs:// run directories and data (issue 29, items 1, 2 and 4), on fake-gcs-server started for real on 127.0.0.1
(conftest's ``gcs`` fixture).

Paths and atomic writes on the bucket, the metrics' upload rate, what each storage call costs, the steps that need
local paths, and `data-stats --source gs://...` on a copy of the CodeV-R1 repository. Training into a bucket (two
processes, a SIGTERM, `launch --run`'s resume, and `merge --checkpoint gs://...`) is in test_resume.py.
"""

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from gemma_tpu_helpers.course.training import train
from gemma_tpu_helpers.fixes.core import file_io
from gemma_tpu_helpers.fixes.train import lora_checkpoint
from support import REPO, run_cli

BUCKET = "course"  # conftest's gcs fixture makes it


def _fs():
    import fsspec

    return fsspec.filesystem("gs", skip_instance_cache=True)


def test_paths_and_writes_on_the_bucket(gcs):
    run = file_io.absolute_path(f"{gcs}/unit/run", "run directory", remote=True)
    assert str(run) == f"{gcs}/unit/run" and (run / "a").name == "a"
    file_io.write_atomic(run / "train" / "metrics.jsonl", '{"step": 1}\n')
    assert (run / "train" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    with pytest.raises(FileExistsError):
        file_io.write_lines_atomic(run / "train" / "metrics.jsonl", ["x"], overwrite=False)
    assert train.latest_step(run / "checkpoints") is None
    # a step folder without Orbax's commit marker is unfinished on gs:// (Orbax writes it in place there)
    file_io.write_atomic(run / "checkpoints" / "3" / "model_params" / "x", "partial")
    assert lora_checkpoint.list_steps(run / "checkpoints") == []
    # written by another process (another gcsfs instance): seen at once, not hidden by a cached listing
    _fs().pipe(f"{BUCKET}/unit/run/checkpoints/3/{lora_checkpoint.COMMIT_SUCCESS}", b"done")
    assert lora_checkpoint.list_steps(run / "checkpoints") == [3]
    with pytest.raises(file_io.PathArgumentError, match="copy it to a local directory first"):
        file_io.absolute_path(f"{gcs}/base", "base directory")


def test_metrics_on_a_bucket_are_uploaded_at_most_every_two_seconds(gcs):
    """Cloud Storage takes about one write per second to one object: quick lines (a step's, then its eval's) are held
    back and uploaded together; flush (which train calls however training stops) uploads the rest."""
    path = file_io.to_path(f"{gcs}/throttle/train/metrics.jsonl")
    recorder = train.metrics_recorder(path, 0, [10, 10, 10], lambda step: 0.0, "prefix")
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
    for where, root in (("gs://", file_io.to_path(f"{gcs}/cost")), ("local disk", tmp_path / "cost")):
        line = '{"step": 1, "loss": 7.1}\n' * 200  # a metrics file of 200 steps, rewritten at each step
        calls = {"write metrics (5 KB)": lambda: file_io.write_atomic(root / "train" / "metrics.jsonl", line),
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


def test_data_from_a_copy_of_the_repository_in_a_bucket(gcs, tiny_dir, tmp_path):
    """data-stats --source gs://.../CodeV-R1-dataset: the profile's config applies to the copy, as to a local one,
    and the figures are the local copy's; a second read uses the synced copy, and a changed object is fetched.
    (--base: the session's replica, whose tokenizer is the smoke base's, not a base built in the checkout's runs/.)"""
    from gemma_tpu_helpers.course.config.paths import SHIPPED_REPLICA

    local = tmp_path / "CodeV-R1-dataset"
    shutil.copytree(SHIPPED_REPLICA, local)
    _fs().put(str(local), f"{BUCKET}/copies/CodeV-R1-dataset", recursive=True)
    cmd = ["data-stats", "--profile", "smoke", "--base", tiny_dir]
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
    file_io.local_copy(f"{gcs}/copies/CodeV-R1-dataset", Path(os.environ["GEMMA_TPU_CACHE"]) / "gs")
    assert (copy / "README.md").read_bytes().endswith(b"\n\n") and (copy / "extra.txt").is_file()
    _fs().rm(f"{BUCKET}/copies/CodeV-R1-dataset/extra.txt")
    file_io.local_copy(f"{gcs}/copies/CodeV-R1-dataset", Path(os.environ["GEMMA_TPU_CACHE"]) / "gs")
    assert not (copy / "extra.txt").exists()
    print(f"data-stats (CLI) from the bucket, first read with its copy: {first_s:.1f} s; from a local copy "
          f"{local_s:.1f} s")


def test_runs_root_on_a_bucket(gcs, monkeypatch):
    """GEMMA_TPU_RUNS=gs://...: run directories go to the bucket; the base and the merged model stay local."""
    from gemma_tpu_helpers.course.commands.commands_train import merge_paths
    from gemma_tpu_helpers.course.config import profiles

    monkeypatch.setenv("GEMMA_TPU_RUNS", f"{gcs}/runs")
    smoke = profiles.get_profile("smoke")
    assert str(smoke.run_dir()) == f"{gcs}/runs/smoke" and file_io.is_remote(smoke.run_dir())
    local = smoke.local_dir()
    assert isinstance(local, Path) and local == REPO / "runs" / "smoke"
    args = type("Args", (), dict(profile="smoke", base=None, checkpoint=None, out=None))()
    base, checkpoint, out = merge_paths(args)
    assert (base, str(checkpoint), out) == (local / "base", f"{gcs}/runs/smoke/checkpoints", local / "merged")
