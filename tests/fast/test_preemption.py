"""Spot-TPU preemption (issue 29, item 3): a real SIGTERM during training, to one process and to one of two.

Training ends the step it is in, every process saves a checkpoint of the same step, prints one line and exits 75;
the same command then resumes from that step, and the losses after it equal the uninterrupted run's (conftest's
smoke run), to the SIGKILL test's standard. Not in conftest's serial group: this module runs beside it.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
from conftest import REPO, SMOKE_RUN_STEPS
from test_multihost import _finish, _free_port_pair, _kill, _start, _train_args

from gemma_tpu_helpers.course import train
from gemma_tpu_helpers.fixes import multihost
from gemma_tpu_helpers.fixes.preemption import PREEMPTED_EXIT, PreemptionWatch

STEPS = SMOKE_RUN_STEPS
TOL = 1e-5
# (the last --checkpoint-every wins) no periodic save: Orbax saves step 1 (its first) and the preemption its step,
# which is 2 or later (the signal goes once step 1's metrics are written, which tunix does after step 2 has run)
NO_PERIODIC = ["--checkpoint-every", 1000]


def _saved(run_dir) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def _args(run_dir, base):
    return [*_train_args(run_dir, base), *NO_PERIODIC]


def _wait_for_step(run_dir, procs, timeout=900) -> None:
    """Until process 0 has written the metrics of step 1 (training runs, compiled)."""
    path = run_dir / "train" / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (path.is_file() and '"loss"' in path.read_text()):
        for p in procs:
            assert p.poll() is None, p.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "training did not reach step 1 in time"
        time.sleep(0.2)


def _check_resume(reference, run_dir, stopped_at) -> float:
    a = reference.metrics.dropna(subset=["loss"]).set_index("step")["loss"]
    b = train.read_metrics(run_dir).dropna(subset=["loss"]).set_index("step")["loss"]
    assert list(b.index) == list(range(1, STEPS + 1)), b
    after = [s for s in a.index if s > stopped_at]
    err = float(np.abs(a[after].to_numpy() - b[after].to_numpy()).max())
    print(f"resume parity after the SIGTERM at step {stopped_at}: max |dloss| over steps {after} = {err:.2e}")
    assert err <= TOL
    return err


def _stopped_step(out: str) -> int:
    line = next((x for x in out.splitlines() if x.startswith("preempted: SIGTERM: stopped after step ")), None)
    assert line is not None, out[-4000:]
    assert "Run the same command again to resume" in line and f"exit code {PREEMPTED_EXIT}" in line, line
    return int(line.split("stopped after step ")[1].split()[0])


def sigterm_one_process(run_dir, args) -> tuple[str, float, int]:
    """``train ARGS`` in one process, a SIGTERM once step 1 is recorded in ``run_dir``; it must exit 75.
    ``(output, seconds from the signal to the exit, the step it stopped after)``."""
    proc = _start(*args)
    try:
        _wait_for_step(run_dir, [proc])
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)  # as a spot VM's shutdown does: every process of the group
        out, _ = proc.communicate(timeout=300)
        exit_s = time.monotonic() - sent
    finally:
        _kill([proc])
    assert proc.returncode == PREEMPTED_EXIT, out[-4000:]
    return out, exit_s, _stopped_step(out)


def test_sigterm_saves_the_step_in_progress_and_resume_matches(smoke_run, tiny_dir, tmp_path):
    run_dir = tmp_path / "spot"
    args = _args(run_dir, tiny_dir)
    out, exit_s, stopped = sigterm_one_process(run_dir, args)
    assert 2 <= stopped < STEPS, f"the SIGTERM came too late to test a resume:\n{out[-3000:]}"
    # nothing lost: the last step the metrics recorded is saved, by the preemption (no periodic save)
    assert _saved(run_dir) == [1, stopped]
    assert train.read_metrics(run_dir).dropna(subset=["loss"])["step"].max() == stopped
    assert not (run_dir / "train" / train.DONE).exists()
    print(f"one process: SIGTERM to exit {exit_s:.1f} s, stopped after step {stopped}, steps lost 0")

    resumed = _start(*args)
    (rc, out2), = _finish([resumed], timeout=900)
    assert rc == 0, out2[-3000:]
    assert f"trained steps {stopped}..{STEPS}" in out2
    _check_resume(smoke_run[1], run_dir, stopped)


def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step(smoke_run, tiny_dir, tmp_path):
    """JAX's preemption sync: process 1 alone gets the SIGTERM; both save the same step and exit 75, and the
    launcher (which waits for the others on a 75) resumes both from it."""
    run_dir = tmp_path / "spot2"
    args = _args(run_dir, tiny_dir)
    multi = ["--coordinator", f"127.0.0.1:{_free_port_pair()}", "--num-processes", 2]
    workers = [_start(*args, *multi, "--process-id", i) for i in (0, 1)]
    try:
        _wait_for_step(run_dir, workers)
        sent = time.monotonic()
        os.killpg(workers[1].pid, signal.SIGTERM)
        outs = _finish(workers, timeout=300)
        exit_s = time.monotonic() - sent
    finally:
        _kill(workers)
    for i, (rc, out) in enumerate(outs):
        assert rc == PREEMPTED_EXIT, f"process {i}:\n{out[-4000:]}"
    stopped = {_stopped_step(out) for _, out in outs}
    assert len(stopped) == 1, stopped  # the same step in both
    stopped = stopped.pop()
    assert 2 <= stopped < STEPS, f"the SIGTERM came too late to test a resume:\n{outs[0][1][-3000:]}"
    item = run_dir / "checkpoints" / str(stopped) / "model_params"
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= {p.name for p in item.iterdir()}  # both processes saved it
    assert _saved(run_dir) == [1, stopped]
    print(f"two processes, SIGTERM to process 1: both exited {exit_s:.1f} s after it, stopped after step "
          f"{stopped}, steps lost 0")

    launcher = _start("launch", "--workers", 2, "--coordinator", f"127.0.0.1:{_free_port_pair()}", "--run",
                      "--timeout", 600, "--", *args)
    (rc, out2), = _finish([launcher], timeout=660)
    assert rc == 0, out2[-4000:]
    assert f"trained steps {stopped}..{STEPS}" in out2
    _check_resume(smoke_run[1], run_dir, stopped)


def test_launcher_waits_for_the_others_when_one_worker_is_preempted(tmp_path):
    """A worker exiting 75 does not kill the others (they are saving the same step); the launcher returns 75 once
    all have stopped. Any other failure still ends the others at once."""
    slow_75 = [sys.executable, "-c", f"import sys, time; time.sleep(1.5); open({str(tmp_path / 'ok')!r}, 'w'); "
               f"sys.exit({PREEMPTED_EXIT})"]
    fast_75 = [sys.executable, "-c", f"import sys; sys.exit({PREEMPTED_EXIT})"]
    assert multihost.run_commands([fast_75, slow_75], timeout_s=60, wait_on=(PREEMPTED_EXIT,)) == PREEMPTED_EXIT
    assert (tmp_path / "ok").is_file()  # the slow worker finished, not killed
    slow_0 = [sys.executable, "-c", f"import time; time.sleep(30); open({str(tmp_path / 'late')!r}, 'w')"]
    t = time.monotonic()
    assert multihost.run_commands([[sys.executable, "-c", "import sys; sys.exit(3)"], slow_0], timeout_s=60,
                                  wait_on=(PREEMPTED_EXIT,)) == 3
    assert time.monotonic() - t < 20 and not (tmp_path / "late").exists()


def test_watch_in_one_process_restores_the_handler_and_a_second_sigterm_is_default():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionWatch() as watch:
        assert not watch.reached(1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs between bytecodes
        assert watch.reached(2) and watch.signal_at is not None
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # a second notice ends the process
    assert signal.getsignal(signal.SIGTERM) == before
    # a second SIGTERM during the save ends the process at once (in a child, with the default action)
    code = ("import os, signal, time\nfrom gemma_tpu_helpers.fixes.preemption import PreemptionWatch\n"
            "with PreemptionWatch() as w:\n    os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.05)\n"
            "    assert w.reached(1); print('first', flush=True); os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(5); print('survived')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGTERM and r.stdout.split() == ["first"], (r.returncode, r.stdout, r.stderr)


def test_train_help_documents_the_exit_code():
    r = subprocess.run([sys.executable, "-m", "gemma_tpu_helpers", "train", "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and str(PREEMPTED_EXIT) in r.stdout and "SIGTERM" in r.stdout, r.stdout
