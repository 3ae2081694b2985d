"""Kill and resume, as one matrix: each way a run stops (SIGKILL, a spot VM's SIGTERM), each process count (one, two
with jax.distributed on 127.0.0.1) and each storage (local disk, gs:// on fake-gcs-server) is proven by at least one
case, with as few trainings as that takes:

| case | processes | storage | stop | resume |
| --- | --- | --- | --- | --- |
| sigkill | 1 | local | SIGKILL after the checkpoint of step EVERY | the same command |
| sigterm | 1 | local | SIGTERM after step 1: saves the step in progress, exit 75 | the same command |
| sigterm-two | 2 | gs:// | SIGTERM to process 1: both save one step in the bucket, exit 75 | `launch --run`; merge |
| sigterm-load | 1 | local | SIGTERM while loading: exit 75 at once, no step | - |
| sigterm-load-two | 2 | local | SIGTERM to process 1 while loading: both exit 75 at once | - |
| first run | 1 | local | `stop_after=2`: saves step 2 and returns | the same call without it |

The two-process case goes to the bucket with its notice to process 1, one training for what two proved before (a local
two-process case and a bucket one with the notice on process 0: 185 s more): process 1's notice must reach process 0,
which records and saves; the single-process cases give process 0 its own notice, on local disk. `merge` then reads
the bucket's checkpoint.

Every resumed run records steps 1..STEPS once and its losses equal conftest's uninterrupted smoke run (one process,
8 devices, rows of 256 tokens): bit for bit in one process; with two, within the summation-order bound where both runs
hold the same parameters and within 1e-4 of the loss after Adam's updates (see AFTER_UPDATES_REL), so the two-process
case proves the multi-host losses too, before and after the stop. A case trains in a process group of its own that is
killed when the test ends, whatever happened.
"""

import json
import os
import signal
import time

import numpy as np
import pytest

import support
from gemma_tpu_helpers.course.training import train
from gemma_tpu_helpers.fixes.core import file_io
from gemma_tpu_helpers.fixes.train import lora_checkpoint
from gemma_tpu_helpers.fixes.train.preemption import PREEMPTED_EXIT
from support import (
    NO_PERIODIC,
    SMOKE_RUN_EVERY,
    SMOKE_RUN_SEQ,
    SMOKE_RUN_STEPS,
    check_resume,
    finish,
    free_port_pair,
    kill,
    losses,
    run_cli,
    sigterm_processes,
    smoke_run_profile,
    start,
    stopped_step,
    train_args,
)

STEPS, EVERY = SMOKE_RUN_STEPS, SMOKE_RUN_EVERY


def _saved(run_dir) -> list[int]:
    return lora_checkpoint.list_steps(file_io.to_path(str(run_dir)) / "checkpoints")


def _launch_resume(args, timeout=900) -> str:
    """The same training resumed by ``launch --run`` (two local workers); its combined output."""
    launcher = start("launch", "--workers", 2, "--coordinator", f"127.0.0.1:{free_port_pair()}", "--run",
                     "--timeout", timeout, "--", *args)
    (rc, out), = finish([launcher], timeout=timeout + 60)
    assert rc == 0, out[-4000:]
    return out


def _sigterm_two(run_dir, base, to: int) -> dict:
    """Two processes train into ``run_dir`` (no periodic save), a SIGTERM goes to process ``to``; both must save the
    same step and exit 75, then ``launch --run`` resumes both from it."""
    args = [*train_args(run_dir, base), *NO_PERIODIC]
    multi = ["--coordinator", f"127.0.0.1:{free_port_pair()}", "--num-processes", 2]
    outs, exit_s = sigterm_processes(run_dir, [start(*args, *multi, "--process-id", i) for i in (0, 1)], to=to)
    stopped = {stopped_step(out) for _, out in outs}
    assert len(stopped) == 1, stopped  # the same step in both
    stopped = stopped.pop()
    assert 2 <= stopped < STEPS, f"the SIGTERM came too late to test a resume:\n{outs[0][1][-3000:]}"
    item = file_io.to_path(str(run_dir)) / "checkpoints" / str(stopped) / "model_params"
    saved_then = _saved(run_dir)
    both_saved = {"ocdbt.process_0", "ocdbt.process_1"} <= {p.name for p in item.iterdir()}
    first = train.read_metrics(run_dir)
    print(f"two processes, SIGTERM to process {to}: both exited {exit_s:.1f} s after it, stopped after step "
          f"{stopped}, steps lost 0")
    resume_out = _launch_resume(args)
    return dict(run=run_dir, outs=outs, stopped=stopped, saved=saved_then, both_saved=both_saved, first=first,
                resume_out=resume_out)


# The two-process run against the one-process reference: the same arithmetic but for the cross-device sums (the
# loss's over the batch, the gradients' over the fsdp axis), which the two processes add in another order.
# - Steps 1 and 2 compute on the same parameters in both runs (the warmup's learning rate is 0 at step 1, so its
#   update moves nothing): each device's partial sum is computed alike, and only their order differs. A sum of D
#   partials >= 0 is within (D - 1)u of the exact sum in any order (u = 2^-24), so two orders are within 2(D - 1)u of
#   each other; the division by the token count rounds once more in each run (2u), and the step's loss is the mean
#   of its N = grad_accum micro-batch losses (np.mean in float32: (N - 1)u for the sum and u for the division, in each
#   run). Loss parity there: (2D + 2N)u of the loss.
# - From step 3 the parameters differ: Adam's first update is lr * g/|g| elementwise, so a gradient element whose
#   rounding noise outweighs it flips a whole +-lr step, and no bound follows from the arithmetic. There (and for the
#   evaluations, which average a number of batches this test does not see) the runs must agree to 1e-4 of the loss:
#   seen up to 3.6e-6 relative here (steps 3-4, the evaluation after step 3), while the four steps move the evaluation
#   by 2.5e-3 relative (printed), so a lost or doubled process share, or a restore of the wrong state, moves it past
#   1e-4. The gradient norms and the trained LoRA are compared as relative norms within 1e-2 likewise: seen 4e-5 and
#   6e-4; a missing or misplaced process share moves them by tens of percent.
AFTER_UPDATES_REL = 1e-4
NORM_REL = 1e-2


def _same_params_bound() -> float:
    """(2D + 2N)u for the profile both runs train (conftest's smoke run, support.train_args)."""
    run = smoke_run_profile()
    return (2 * run.hardware.num_devices + 2 * run.train.grad_accum) * 2.0**-24


def _check_two_processes(case, reference):
    """What a two-process run must give: both exit 75 at one step and both wrote it; only process 0 records and
    reports; the resumed run's losses, gradient norms, tokens and evaluations equal the one-process run's (within the
    bounds above)."""
    stopped = case["stopped"]
    assert case["both_saved"] and case["saved"] == [1, stopped], case["saved"]
    (_, out0), (_, out1) = case["outs"]
    assert f"stopped after step {stopped}" in out0 and f"exit code {PREEMPTED_EXIT}" in out1
    assert [int(json.loads(x)["step"]) for x in (file_io.to_path(str(case["run"])) / "train" / "metrics.jsonl")
            .read_text().splitlines() if '"loss"' in x] == list(range(1, STEPS + 1))  # process 0 alone, once a step
    assert case["resume_out"].count(f"trained steps {stopped}..{STEPS}") == 1, case["resume_out"][-3000:]
    a, b = reference.metrics.set_index("step"), train.read_metrics(case["run"]).set_index("step")
    steps = list(range(1, STEPS + 1))
    assert a.loc[1, "lr"] == 0.0  # step 2 still computes on the initial parameters
    same = {s: (a.loc[s, "loss"], b.loc[s, "loss"]) for s in (1, 2)}
    moved = {f"loss {s}": (a.loc[s, "loss"], b.loc[s, "loss"]) for s in steps[2:]}
    evals = a["eval_loss"].dropna().index.intersection(b["eval_loss"].dropna().index)
    assert len(evals) >= 2, evals  # before training and after some
    moved.update({f"eval {s}": (a.loc[s, "eval_loss"], b.loc[s, "eval_loss"]) for s in evals})
    drop = a.loc[evals[0], "eval_loss"] - a.loc[evals[-1], "eval_loss"]
    print(f"two processes vs one, same parameters: {[f'step {s}: {abs(x - y):.1e}' for s, (x, y) in same.items()]}; "
          f"after updates: {[f'{n}: {abs(x - y) / abs(x):.1e} relative' for n, (x, y) in moved.items()]}; training "
          f"moved the evaluation by {drop / a.loc[evals[0], 'eval_loss']:.1e} relative")
    for s, (x, y) in same.items():
        assert abs(x - y) <= _same_params_bound() * abs(x), (s, x, y)
    for name, (x, y) in moved.items():
        assert abs(x - y) <= AFTER_UPDATES_REL * abs(x), (name, x, y)
    grad_rel = np.abs(a.loc[steps, "grad_norm"] / b.loc[steps, "grad_norm"] - 1).max()
    print(f"gradient norms: {grad_rel:.1e} relative at most")
    assert grad_rel <= NORM_REL
    assert (a.loc[steps, "tokens"].to_numpy() == b.loc[steps, "tokens"].to_numpy()).all()  # the global batch's


@pytest.fixture(scope="module")
def sigterm_two(gcs, smoke_run, tiny_dir):
    """The pod case: hosts share nothing but a bucket. Two processes train into gs://, process 1 gets the SIGTERM,
    both save the step in the bucket, `launch --run` resumes from there."""
    return _sigterm_two(f"{gcs}/two", tiny_dir, to=1)


def test_sigkill_then_resume_matches_an_uninterrupted_run(smoke_run, tiny_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = train_args(run_dir, tiny_dir)
    proc = start(*args)
    try:
        deadline = time.time() + 900
        while not _saved(run_dir):  # wait for the first checkpoint (step EVERY)
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.time() < deadline, "no checkpoint in time"
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        kill([proc])
    killed_at = _saved(run_dir)[-1]
    (rc, out), = finish([start(*args)], timeout=900)
    assert rc == 0, out[-3000:]
    assert f"trained steps {killed_at}..{STEPS}" in out
    check_resume(smoke_run[1], run_dir, killed_at, every_step=False)  # a SIGKILL can flush nothing


def test_sigterm_saves_the_step_in_progress_and_resume_matches(smoke_run, tiny_dir, tmp_path):
    run_dir = tmp_path / "spot"
    args = [*train_args(run_dir, tiny_dir), *NO_PERIODIC]
    (_, out), = sigterm_processes(run_dir, [start(*args)])[0]
    stopped = stopped_step(out)
    assert 2 <= stopped < STEPS, f"the SIGTERM came too late to test a resume:\n{out[-3000:]}"
    # nothing lost: the last step the metrics recorded is saved, by the preemption (no periodic save)
    assert _saved(run_dir) == [1, stopped]
    assert train.read_metrics(run_dir).dropna(subset=["loss"])["step"].max() == stopped
    assert not (run_dir / "train" / train.DONE).exists()
    (rc, out2), = finish([start(*args)], timeout=900)
    assert rc == 0, out2[-3000:]
    assert f"trained steps {stopped}..{STEPS}" in out2
    check_resume(smoke_run[1], run_dir, stopped)


def test_a_first_run_stops_after_its_steps_and_the_full_run_resumes_from_them(smoke_run, tiny_dir, tmp_path):
    """`train --stop-after N` (docs/tpu-vm.md step 5, notebook 06 on a TPU): N steps of the full run's schedule,
    saved, then the same call without it finishes as if nothing had stopped (the losses after N equal the
    uninterrupted run's bit for bit). In this process, as notebook 06 calls it."""
    run_dir, kw = tmp_path / "first", dict(base_dir=tiny_dir, max_steps=STEPS, checkpoint_every=EVERY, progress=False)
    first = train.train(smoke_run_profile(), run_dir=run_dir, stop_after=2, **kw)
    assert (first.stopped_at, first.start_step, first.total_steps) == (2, 0, STEPS)
    assert _saved(run_dir)[-1] == 2 and not (run_dir / "train" / train.DONE).exists()
    again = train.train(smoke_run_profile(), run_dir=run_dir, stop_after=2, **kw)  # the first run's cell again
    assert again.stopped_at == 2 and again.seconds == 0.0
    rest = train.train(smoke_run_profile(), run_dir=run_dir, **kw)
    assert (rest.stopped_at, rest.start_step) == (None, 2) and (run_dir / "train" / train.DONE).exists()
    check_resume(smoke_run[1], run_dir, 2)


@pytest.mark.parametrize("change", [["--max-seq-len", 128], ["--source", "other.jsonl"], ["--config", "rl"]],
                         ids=["max_seq_len", "source", "config"])
def test_a_resume_with_other_rows_is_refused_in_one_line(smoke_run, tiny_dir, tmp_path, change):
    """The conftest run's checkpoints resumed with another sequence length, data source or config would train the
    rest of the run on other rows, silently: refused from the CLI, exit 2, naming the setting, nothing written."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(smoke_run[0], run_dir)
    (tmp_path / "other.jsonl").write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
    before = {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()}
    args = train_args(run_dir, tiny_dir)
    if change[0] == "--max-seq-len":  # the last --max-seq-len wins
        assert args[-2:] == ["--max-seq-len", SMOKE_RUN_SEQ]
    r = run_cli(*args, *change, cwd=tmp_path)
    setting = {"--max-seq-len": f"max_seq_len: checkpoint has {SMOKE_RUN_SEQ}, this run 128", "--source": "data.source",
               "--config": "data.config: checkpoint has 'sft', this run 'rl'"}[change[0]]
    support.one_line_error(r, "holds checkpoints of other settings", setting)
    assert {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()} == before


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a SIGTERM handler (Linux: /proc/PID/status); python installs none by itself."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(line.split()[1] for line in f if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_while_loading_exits_75_at_once(processes, tiny_dir, tmp_path):
    """A notice before the first step (loading the base, restoring): nothing to finish or save, so the run stops at
    once with the preemption exit code and says so, instead of training on until it is killed. With two processes
    the notice goes to process 1 while JAX's own sync would drop it (no step reported yet): both stop."""
    run_dir = tmp_path / "early"
    multi = ["--coordinator", f"127.0.0.1:{free_port_pair()}", "--num-processes", 2]
    procs = ([start(*train_args(run_dir, tiny_dir))] if processes == 1 else
             [start(*train_args(run_dir, tiny_dir), *multi, "--process-id", i) for i in (0, 1)])
    try:
        deadline = time.monotonic() + 300
        # one process: train() installs its watch before loading anything; two: JAX's service, when it starts
        while not _catches_sigterm(procs[-1].pid):
            assert procs[-1].poll() is None and time.monotonic() < deadline, procs[-1].communicate()[0][-3000:]
            time.sleep(0.02)
        os.kill(procs[-1].pid, signal.SIGTERM)
        outs = finish(procs, timeout=300)
    finally:
        kill(procs)
    for rc, out in outs:
        assert rc == PREEMPTED_EXIT, out[-3000:]
        assert "stopped before the first step" in out and "Traceback" not in out, out[-3000:]
    assert train.read_metrics(run_dir).dropna(subset=["loss"]).empty  # no step ran


def test_sigterm_to_one_of_two_processes_on_a_bucket_and_launch_resumes(sigterm_two, smoke_run):
    run = sigterm_two["run"]
    assert f"saved it in {run}/checkpoints/{sigterm_two['stopped']}" in sigterm_two["outs"][0][1]  # process 0 saved
    _check_two_processes(sigterm_two, smoke_run[1])
    bucket_run = file_io.to_path(run)
    assert json.loads((bucket_run / "train" / train.DONE).read_text())["steps"] == STEPS
    assert json.loads((bucket_run / "checkpoints" / train.METADATA).read_text())["rank"] > 0
    assert (bucket_run / "train" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not any(p.name.startswith(".") for p in (bucket_run / "train").iterdir())  # no temp files left behind
    assert len(losses(train.read_metrics(run))) == STEPS


def test_checkpoint_from_two_processes_restores_on_one_host(sigterm_two, smoke_run):
    """merge reads the multi-process checkpoint alone (host numpy, from the bucket): the LoRA equals the one-process
    run's.

    Elementwise, Adam's first updates are about +-lr wherever a gradient is near 0, so a different float summation
    order can move single elements by up to ~lr (seen: 466 of 250k elements, max 8e-4). The bound is on each array's
    relative norm (NORM_REL); a missing or misplaced process piece would give ~1.
    """
    checkpoints = f"{sigterm_two['run']}/checkpoints"
    item = file_io.to_path(checkpoints) / str(STEPS) / "model_params"
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= {p.name for p in item.iterdir()}  # both processes wrote
    ref = lora_checkpoint.restore_lora(smoke_run[0] / "checkpoints", STEPS)[1]
    ours = lora_checkpoint.restore_lora(checkpoints, STEPS)[1]
    assert ours.keys() == ref.keys() and len(ours) > 0
    rel = max(float(np.linalg.norm(ours[k] - ref[k]) / np.linalg.norm(ref[k])) for k in ref)
    print(f"LoRA parity after {STEPS} steps: max relative norm of the difference = {rel:.2e}")
    assert rel <= NORM_REL


def test_merge_reads_the_two_process_checkpoint_from_the_bucket(sigterm_two, tiny_dir, tmp_path):
    """`merge --checkpoint gs://...` gives the bytes of a merge of a local copy of the checkpoint."""
    import fsspec

    run = sigterm_two["run"]
    started = time.perf_counter()
    r = run_cli("merge", "--base", tiny_dir, "--checkpoint", f"{run}/checkpoints", "--out", tmp_path / "m_gs")
    gs_s = time.perf_counter() - started
    assert r.returncode == 0, r.stdout + r.stderr
    local = tmp_path / "copy"
    fsspec.filesystem("gs", skip_instance_cache=True).get(f"{run[len('gs://'):]}/checkpoints", str(local),
                                                          recursive=True)
    r = run_cli("merge", "--base", tiny_dir, "--checkpoint", local, "--out", tmp_path / "m_local")
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"merge (CLI, incl. imports) from gs:// {gs_s:.1f} s")
    shards = sorted(p.name for p in (tmp_path / "m_gs").glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in (tmp_path / "m_local").glob("*.safetensors"))
    for name in shards:
        assert (tmp_path / "m_gs" / name).read_bytes() == (tmp_path / "m_local" / name).read_bytes(), name
    info = json.loads((tmp_path / "m_gs" / "merge_info.json").read_text())
    assert info["checkpoint_dir"] == f"{run}/checkpoints" and info["step"] == STEPS
