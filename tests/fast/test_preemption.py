"""Spot-TPU preemption (issue 29, item 3): the SIGTERM watch and the launcher's exit codes, with real signals.

A SIGTERM during training (one process, one of two, on gs://) and the resume after it are in test_resume.py.
"""

import os
import signal
import subprocess
import sys
import time
import types

import pytest

from gemma_tpu_helpers.course.training import launch, train
from gemma_tpu_helpers.fixes.train.preemption import PREEMPTED_EXIT, NoticeBeforeTraining, PreemptionWatch
from support import REPO


def test_launcher_waits_for_the_others_when_one_worker_is_preempted(tmp_path):
    """A worker exiting 75 does not kill the others (they are saving the same step); the launcher returns 75 once
    all have stopped. Any other failure still ends the others at once."""
    slow_75 = [sys.executable, "-c", f"import sys, time; time.sleep(1.5); open({str(tmp_path / 'ok')!r}, 'w'); "
               f"sys.exit({PREEMPTED_EXIT})"]
    fast_75 = [sys.executable, "-c", f"import sys; sys.exit({PREEMPTED_EXIT})"]
    assert launch.run_commands([fast_75, slow_75], timeout_s=60, wait_on=(PREEMPTED_EXIT,)) == PREEMPTED_EXIT
    assert (tmp_path / "ok").is_file()  # the slow worker finished, not killed
    slow_0 = [sys.executable, "-c", f"import time; time.sleep(30); open({str(tmp_path / 'late')!r}, 'w')"]
    t = time.monotonic()
    assert launch.run_commands([[sys.executable, "-c", "import sys; sys.exit(3)"], slow_0], timeout_s=60,
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
    code = ("import os, signal, time\nfrom gemma_tpu_helpers.fixes.train.preemption import PreemptionWatch\n"
            "with PreemptionWatch() as w:\n    os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.05)\n"
            "    assert w.reached(1); print('first', flush=True); os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(5); print('survived')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGTERM and r.stdout.split() == ["first"], (r.returncode, r.stdout, r.stderr)


def test_train_help_documents_the_exit_code():
    r = subprocess.run([sys.executable, "-m", "gemma_tpu_helpers", "train", "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and str(PREEMPTED_EXIT) in r.stdout and "SIGTERM" in r.stdout, r.stdout


def test_a_notice_while_loading_stops_at_once_and_one_while_training_at_the_step():
    """Before training (loading, restoring) there is no step to finish: the notice raises at once. From
    ``training()`` on it only sets the flag that ``reached`` reports at the next step."""
    with PreemptionWatch(at_once=True):
        with pytest.raises(NoticeBeforeTraining):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises between bytecodes, long before this ends
    with PreemptionWatch(at_once=True) as watch:
        with watch.training():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            assert watch.reached(1)
        assert not watch.at_once  # after the steps too: a notice then has nothing to stop


def test_a_notice_inside_a_gc_callback_prints_nothing_and_still_stops(capfd):
    """The handler runs between any two bytecodes of the main thread, also inside a gc callback (JAX has one), where
    Python cannot raise and prints "Exception ignored in ... Traceback" instead. Seen in CI: the run stopped with
    exit 75, but after a traceback. Now nothing is printed and training() stops the run."""
    import gc

    fired = []

    def callback(phase, info):
        if phase == "start" and not fired:
            fired.append(1)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the handler raises here, inside the callback

    hook, sys.unraisablehook = sys.unraisablehook, sys.__unraisablehook__  # Python's own: it prints (pytest's warns)
    try:
        with PreemptionWatch(at_once=True) as watch:
            gc.callbacks.append(callback)
            try:
                gc.collect()
            finally:
                gc.callbacks.remove(callback)
            assert fired and watch.signal_at is not None
            with pytest.raises(NoticeBeforeTraining):
                with watch.training():
                    pass
        assert sys.unraisablehook is sys.__unraisablehook__  # put back on exit
    finally:
        sys.unraisablehook = hook
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err, err


class AskedWatch:
    """Says "stop" from ``stop_at`` on, and keeps the steps it was asked about (every process must be asked the
    same step numbers, once each: JAX's sync point)."""

    def __init__(self, stop_at):
        self.stop_at, self.asked = stop_at, []

    def reached(self, step):
        self.asked.append(step)
        return step >= self.stop_at


def test_the_stopping_step_is_saved_before_its_evaluation(tmp_path):
    """tunix runs an evaluation after step k and before step k+1: the recorder asks the watch before the
    evaluation, so a notice stops there (the save fits the grace period), and it asks once per step."""
    watch = AskedWatch(stop_at=2)
    recorder = train.metrics_recorder(tmp_path / "metrics.jsonl", 0, [10] * 4, lambda s: 0.0, "p", write=False,
                                      watch=watch)
    recorder.on_eval_step_start(types.SimpleNamespace(iter_steps=1, train_steps=1))  # evaluation after step 1
    recorder.on_train_step_start(types.SimpleNamespace(iter_steps=1, train_steps=1))  # step 2: step 1 asked already
    assert watch.asked == [1] and recorder.preempted_at is None
    with pytest.raises(train.StopForPreemption):
        recorder.on_eval_step_start(types.SimpleNamespace(iter_steps=2, train_steps=2))  # evaluation after step 2
    assert watch.asked == [1, 2] and recorder.preempted_at == 2
