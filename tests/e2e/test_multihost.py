"""Multi-host set-ups with jax.distributed: real processes of 4 virtual CPU devices each, on 127.0.0.1.

Joined processes see the global devices and their rows of a batch; one process downloads for the pod; bad set-ups
fail with a clear message in bounded time; `launch` prints the pod's commands. Two-process training, its losses,
checkpoints and resume are in test_resume.py. Every process a test starts is killed (its whole session) when the
test ends, whatever happened.
"""

import time

import pytest

from support import finish, free_port_pair, run_cli, start

# ---------------------------------------------------------------------------------------------------------------
# Bad set-ups: a clear error in bounded time, never a hang

def _bad_train(port, n, pid, timeout="3"):
    return start("train", "--max-steps", 1, "--coordinator", f"127.0.0.1:{port}", "--num-processes", n,
                 "--process-id", pid, "--join-timeout", timeout)


def test_unreachable_coordinator_fails_fast():
    t0 = time.monotonic()
    (rc, out), = finish([_bad_train(free_port_pair(), 2, 1)], timeout=90)
    assert rc == 2, out[-3000:]
    assert "could not reach the coordinator" in out and "Start process 0" in out
    assert time.monotonic() - t0 < 90


def test_missing_process_fails_fast():
    (rc, out), = finish([_bad_train(free_port_pair(), 2, 0)], timeout=90)
    assert rc == 2, out[-3000:]
    assert "only 1 of 2 processes joined within 3 s" in out and "missing process ids [1]" in out


def test_process_count_mismatch_fails_on_both_sides():
    port = free_port_pair()
    procs = [_bad_train(port, 2, 0, timeout="30"), _bad_train(port, 4, 1, timeout="30")]
    (rc0, out0), (rc1, out1) = finish(procs, timeout=120)
    assert rc0 == 2 and "process 1 was started with num_processes=4" in out0, out0[-3000:]
    assert "On the command line, num_processes is --num-processes" in out0, out0[-3000:]  # the CLI's flag for it
    assert rc1 == 2 and "the coordinator refused process 1" in out1, out1[-3000:]


JOINED = """
import sys
from gemma_tpu_helpers.fixes.train import multihost
from gemma_tpu_helpers.fixes.train import sft
from gemma_tpu_helpers.course.config import profiles
profiles.configure_jax("smoke")
multihost.initialize(sys.argv[1], 2, int(sys.argv[2]), local_devices=4, timeout_s=60)
import jax, numpy as np
from gemma_tpu_helpers.fixes.train import data
from gemma_tpu_helpers.fixes.model import mesh as mesh_lib
from gemma_tpu_helpers.fixes.train import packing
mesh = profiles.get_profile("smoke").make_mesh()
print("devices", jax.device_count(), jax.local_device_count(), "main", multihost.is_main(), flush=True)
print("rows", multihost.process_rows(mesh, 4), flush=True)
packed = packing.pack([(np.arange(5, dtype=np.int32), np.ones(5, np.int8))] * 8, 8)
try:
    packing.batches(packed, 3, seed=0)
except data.DataError as e:
    print("DataError:", e, flush=True)
"""


def test_joined_processes_see_global_devices_and_refuse_an_odd_batch():
    port = free_port_pair()
    procs = [start("-c", JOINED, f"127.0.0.1:{port}", i, module=False) for i in (0, 1)]
    outs = finish(procs, timeout=180)
    for i, (rc, out) in enumerate(outs):
        assert rc == 0, out[-3000:]
        assert f"devices 8 4 main {i == 0}" in out
        assert f"rows slice({2 * i}, {2 * i + 2}, None)" in out
        assert "Global batch 3 does not divide across 2 processes" in out and "multiple of 2" in out


MAIN_FIRST = """
import sys, time
from pathlib import Path
from gemma_tpu_helpers.fixes.train import multihost
coordinator, pid, tmp, mode = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
multihost.initialize(coordinator, 2, pid, local_devices=4, timeout_s=60)
where = tmp / f"host{pid}" if mode == "own" else tmp  # "own": hosts that share no disk

def fetch():  # what train runs as ensure_base: a download into the base's directory
    with open(tmp / "log", "a") as f:
        f.write(f"start {pid}\\n")
    if not (where / "base").is_dir():
        time.sleep(2)
        if mode == "fail":
            raise OSError("No space left on device")
        (where / "base").mkdir(parents=True)
    with open(tmp / "log", "a") as f:
        f.write(f"end {pid}\\n")
    return "base"

print("got", multihost.main_first(fetch, "fetch the base", directory=where), flush=True)
print("probe left", (where / ".multihost-probe").exists(), flush=True)
"""


@pytest.mark.parametrize("mode", ["shared", "fail", "own"])
def test_one_download_per_pod(mode, tmp_path):
    """Every worker runs train, which fetches the base into the base's directory. Shared by the hosts: process 0
    downloads while the others wait on the distributed runtime (not on file locks: gcsfuse has none), then they find
    it there. If the download fails, the others say so instead of waiting for a day. Hosts with a disk of their own
    (a gs:// run directory keeps the base in each host's cache) download at once, side by side."""
    port = free_port_pair()
    procs = [start("-c", MAIN_FIRST, f"127.0.0.1:{port}", i, tmp_path, mode, module=False) for i in (0, 1)]
    (rc0, out0), (rc1, out1) = finish(procs, timeout=180)
    log = (tmp_path / "log").read_text().split()
    if mode != "fail":
        assert rc0 == rc1 == 0 and "got base" in out0 and "got base" in out1, (out0[-2000:], out1[-2000:])
        assert "probe left False" in out0 and "probe left False" in out1
    if mode == "shared":
        assert log == ["start", "0", "end", "0", "start", "1", "end", "1"], log  # one after the other
    elif mode == "own":
        assert sorted(log[:4]) == ["0", "1", "start", "start"], log  # side by side: both start before either ends
        assert (tmp_path / "host0" / "base").is_dir() and (tmp_path / "host1" / "base").is_dir()
    else:
        assert rc0 != 0 and "No space left on device" in out0, out0[-2000:]
        assert rc1 != 0 and log == ["start", "0"], (log, out1[-2000:])  # process 1 never fetched
        assert "process 0 could not fetch the base (failed: OSError: No space left on device)" in out1, out1[-2000:]


def test_launch_prints_pod_and_local_commands():
    r = run_cli("launch", "--workers", 4, "--tpu", "my-v5p-32", "--zone", "us-east5-a", "--env",
                "GEMMA_TPU_PROFILE=v5p-8", "--", "train", "--max-steps", 10)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("gcloud compute tpus tpu-vm ssh my-v5p-32 --zone=us-east5-a --worker=all --command=")
    assert "GEMMA_TPU_PROFILE=v5p-8" in r.stdout and "train --max-steps 10 --coordinator auto" in r.stdout
    r = run_cli("launch", "--workers", 4, "--tpu", "my-v5p-32", "--zone", "z", "--", "merge")
    assert "--worker=0" in r.stdout and "--coordinator" not in r.stdout  # host-side steps: one worker
    r = run_cli("launch", "--workers", 2, "--coordinator", "10.0.0.2:8476", "--", "train")
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and all(f"--process-id {i}" in line for i, line in enumerate(lines))
    assert all("--coordinator 10.0.0.2:8476 --num-processes 2" in line for line in lines)
    r = run_cli("launch", "--workers", 2, "--tpu", "x", "--", "train")
    assert r.returncode == 2 and "--tpu needs --zone" in r.stderr


PLANNED = """
import sys
from gemma_tpu_helpers.fixes.train import multihost
from gemma_tpu_helpers.course.config import profiles
profiles.configure_jax("smoke")
multihost.initialize(sys.argv[1], 2, int(sys.argv[2]), local_devices=4, timeout_s=60)
from tunix.sft import peft_trainer
from gemma_tpu_helpers.course.training import train
from gemma_tpu_helpers.fixes.model import gemma4, sharding
from gemma_tpu_helpers.fixes.train import sft, step
from gemma_tpu_helpers.fixes.model import mesh as mesh_lib
smoke = profiles.get_profile("smoke")
t, mesh = smoke.train, smoke.make_mesh()
model = train.apply_profile_lora(gemma4.load_model(sys.argv[3], mesh, dtype=smoke.model.dtype), smoke, t.seed)
lora = [r for r in sharding.audit(model, mesh) if r.kind == "LoRAParam"]
# LoRA params, applied as annotated, sharded over some axis, bytes per device as placed and as annotated
print("lora", len(lora), sum(bool(r.applied) for r in lora), sum("'" in r.placed for r in lora),
      sum(r.bytes_per_device_placed for r in lora), sum(r.bytes_per_device for r in lora), flush=True)
config = peft_trainer.TrainingConfig(eval_every_n_steps=10, max_steps=10, gradient_accumulation_steps=t.grad_accum)
with mesh_lib.trainer_context(mesh):
    trainer = sft.make_trainer(model, t, 10, config)
    train_fn, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)
    trained = train_fn.jitted.lower(trainer.model, trainer.optimizer,
                                    step.abstract_batch(mesh, t.micro_batch, t.max_seq_len))
args = step.abstract_arguments(gemma4.read_text_config(sys.argv[3]), mesh, smoke.lora, t, t.micro_batch,
                               t.max_seq_len, dtype=smoke.model.dtype, remat=t.remat, total_steps=10)
print("fingerprints", step.fingerprint(step.lower(*args, mesh)), step.fingerprint(trained), flush=True)
"""


def test_two_processes_train_the_planned_program_with_lora_sharded(tiny_dir):
    """In two processes the LoRA params (initialised replicated under nnx.jit) are placed as annotated, so the
    step the trainer compiles is, to the byte, the one the AOT plan compiles for that mesh: sharded LoRA and AdamW
    state, a reduce-scatter of the gradient, not a replicated copy per chip."""
    port = free_port_pair()
    outs = finish([start("-c", PLANNED, f"127.0.0.1:{port}", i, tiny_dir, module=False) for i in (0, 1)], timeout=600)
    for rc, out in outs:
        assert rc == 0, out[-3000:]
        line = next(x for x in out.splitlines() if x.startswith("lora "))
        n, applied, sharded, placed, annotated = map(int, line.split()[1:])
        assert n > 0 and applied == n and sharded > 0 and placed == annotated, line
        planned, trained = next(x for x in out.splitlines() if x.startswith("fingerprints ")).split()[1:]
        assert planned == trained, out[-3000:]
