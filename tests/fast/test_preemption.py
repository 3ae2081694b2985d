"""Spot-TPU preemption (issue 29, item 3): the SIGTERM watch and the launcher's exit codes, with real signals.

A SIGTERM during training (one process, one of two, on gs://) and the resume after it are in test_resume.py.
"""

import os
import signal
import subprocess
import sys
import time

from gemma_tpu_helpers.course import launch
from gemma_tpu_helpers.fixes.preemption import PREEMPTED_EXIT, PreemptionWatch
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
