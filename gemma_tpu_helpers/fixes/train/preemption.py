"""Spot and preemptible TPUs: on the preemption notice (SIGTERM, then about 30 s), stop at a step every process
agrees on, with a checkpoint of that step::

    with PreemptionWatch(at_once=True) as watch:
        load_or_restore()                    # a notice here stops at once: NoticeBeforeTraining
        with watch.training():               # from here, at the next step every process reaches
            watch.reached(start)             # at once: JAX's sync drops a notice that comes before any report
            for step in range(start + 1, end + 1):
                train_step(...)
                if watch.reached(step):      # every process, every step, the same step numbers
                    save_checkpoint(step)    # Orbax's CheckpointManager.should_save asks the same question
                    sys.exit(PREEMPTED_EXIT) # a restart resumes from the saved step

With several processes, JAX's preemption service tells every process (a flag of one host's own would leave the
others waiting in the next collective); with one, a SIGTERM handler sets a flag, and a second SIGTERM kills.
JAX's service drops a notice that comes before any process has reported a step (while loading), but it records
every notice in the distributed runtime's key-value store: on entering :meth:`PreemptionWatch.training`, process 0
reads it there and tells the others, so that every process stops at once, or none.
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import sys
import time

from . import multihost

PREEMPTED_EXIT = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, run the same command again to resume
NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"  # where JAX's preemption service records the first notice of any process
_CALLS = itertools.count()  # every process enters training() in the same order: the n-th entry's key is its own


class NoticeBeforeTraining(BaseException):
    """The preemption notice came while the watch stops at once (loading, restoring: no step to finish or save).
    A BaseException, so that no ``except Exception`` on the way swallows it."""


class PreemptionWatch:
    """Watches for the preemption notice while training runs; a context manager (the SIGTERM handler of one
    process is installed on entry and the previous one put back on exit).

    ``at_once``: a notice before :meth:`training` is entered stops the run, as :class:`NoticeBeforeTraining`: there is
    no step to finish while the model loads or a checkpoint restores. One process: raised in the main thread as soon
    as the notice comes. Several: raised in every process on entering :meth:`training`, if any process had one."""

    def __init__(self, at_once: bool = False):
        self.signal_at: float | None = None  # this process's SIGTERM, time.monotonic() (one process only)
        self.at_once = at_once
        self._previous = None
        self._previous_hook = None
        self._installed = False

    @contextlib.contextmanager
    def training(self):
        """From here on a notice stops at the next step that every process reaches (``reached``), not at once."""
        if self.at_once and (self.signal_at is not None or (self._distributed() and self._any_notice())):
            raise NoticeBeforeTraining
        self.at_once = False  # and it stays off: after the steps, a notice has nothing left to stop
        yield self

    @staticmethod
    def _distributed() -> bool:
        """JAX's preemption service runs (it starts with ``jax.distributed.initialize`` unless switched off)."""
        import jax

        return jax.distributed.is_initialized() and bool(jax.config.jax_enable_preemption_service)

    @staticmethod
    def _any_notice(timeout_s: float = 24 * 3600) -> bool:
        """Whether any process has had a notice: process 0 looks and tells the others (one answer for all; a
        notice that comes after it looked goes to the step protocol). The others wait for process 0 as long as it
        may take to load (a download: hours)."""
        from jax._src.distributed import global_state

        def look() -> str:
            try:
                global_state.client.key_value_try_get(NOTICE_KEY)
                return "stop"
            except Exception:  # not found: no notice yet
                return "go"

        key = f"gemma_tpu/preemption/before_training/{next(_CALLS)}"
        return multihost.process_0_says(key, look, "load", timeout_s) == "stop"

    def __enter__(self) -> "PreemptionWatch":
        if not self._distributed():
            try:
                self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
                self._installed = True
                self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
            except ValueError:  # not the main thread: no handler, the default action stays
                pass
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            sys.unraisablehook = self._previous_hook
            self._installed = False

    def _unraisable(self, unraisable) -> None:
        """A notice raised where Python can only print it (inside a gc callback or a finalizer, e.g. JAX's
        ``_xla_gc_callback``) is not an error to show: the flag is set, and :meth:`training` stops the run."""
        if not isinstance(unraisable.exc_value, NoticeBeforeTraining):
            self._previous_hook(unraisable)

    def _on_sigterm(self, signum, frame) -> None:
        self.signal_at = time.monotonic()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process
        if self.at_once:
            raise NoticeBeforeTraining

    def reached(self, step: int) -> bool:
        """True at the step where this process (and, with several, every process) should save and stop. Call it
        once per step, with the same increasing step numbers in every process."""
        if self._distributed():
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(int(step))
        return self.signal_at is not None
