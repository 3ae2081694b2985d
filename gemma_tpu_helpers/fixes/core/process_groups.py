"""Processes: start a command in its own process group and stop the whole group; which processes hold a file
(the TPU device files, a lock). Standard library only; /proc is read on Linux."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import signal
import subprocess
import time
from pathlib import Path


def process_cmdline(pid: int) -> str:
    """A process's command line (120 characters at most), or ``?`` when it cannot be read."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def open_by(paths: list[str]) -> dict[int, str]:
    """Other processes with any of ``paths`` open: {pid: command line}. (Only processes this user may inspect.)"""
    wanted = {os.path.realpath(p) for p in paths}
    found = {}
    for fd_dir in glob.glob("/proc/[0-9]*/fd"):
        pid = int(fd_dir.split("/")[2])
        if pid == os.getpid():
            continue
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") in wanted:
                    found[pid] = process_cmdline(pid)
                    break
            except OSError:
                continue
    return found


def lock_holders(path: str) -> dict[int, str]:
    """Other processes holding a POSIX lock on ``path`` (as libtpu does on its lock file), from /proc/locks:
    {pid: command line}."""
    try:
        st = os.stat(path)
        locks = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return {}
    found = {}
    for line in locks:
        # "1: POSIX  ADVISORY  WRITE 6733 fe:00:2147992 0 EOF" (a blocked waiter's line has "->" after the id)
        m = re.search(r"\s(\d+)\s+([0-9a-f]+):([0-9a-f]+):(\d+)\s", line)
        if not m:
            continue
        pid, major, minor, inode = int(m[1]), int(m[2], 16), int(m[3], 16), int(m[4])
        if inode == st.st_ino and (major, minor) == (os.major(st.st_dev), os.minor(st.st_dev)) and pid != os.getpid():
            found[pid] = process_cmdline(pid)
    return found


STOP_GRACE_S = 15.0  # SIGTERM, then SIGKILL the whole group after this


def start_group(argv: list[str], log_path: str | os.PathLike, *, env: dict | None = None,
                cwd: str | os.PathLike | None = None, header: str | None = None) -> subprocess.Popen:
    """Start ``argv`` as the leader of a new process group (session), stdin closed, stdout and stderr to
    ``log_path`` (truncated; ``header`` written first). Stop it with :func:`stop_group`."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        if header is not None:
            log.write(header.encode())
            log.flush()
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=cwd, start_new_session=True)


def pid_running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def group_exists(pgid: int) -> bool:
    """Some process (a zombie included) is still in group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_members(pgid: int) -> list[int]:
    """PIDs running in process group ``pgid`` (Linux /proc; elsewhere just the leader if the group exists)."""
    if not os.path.isdir("/proc"):
        return [pgid] if group_exists(pgid) else []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry)) == pgid and pid_running(int(entry)):
                    pids.append(int(entry))
    return pids


def stop_group(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """Stop the group that :func:`start_group` made: SIGTERM to all of it, wait up to ``grace`` s for it to empty,
    then SIGKILL; reap the leader. ``grace=0`` kills at once. Safe to call again or after the group has exited."""
    pgid = proc.pid  # the leader of a new session: its pid is the group id
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)  # reap the leader, or it stays a zombie and the group never empties
        if not group_exists(pgid):
            return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=max(grace, 5.0))
    deadline = time.monotonic() + max(grace, 1.0)  # orphaned grandchildren are reaped by init: give it a moment
    while group_exists(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


TPU_DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")  # what libtpu opens


# libtpu takes a POSIX write lock on this file while a process uses the TPU; the file stays after the process ends.
LIBTPU_LOCKFILE = "/tmp/libtpu_lockfile"


def tpu_device_files() -> list[str]:
    return [p for g in TPU_DEVICE_GLOBS for p in glob.glob(g)]


def tpu_visible() -> bool:
    """True on a TPU VM (TPU device files present), without importing JAX."""
    return bool(tpu_device_files())


def tpu_holders() -> dict[int, str]:
    """Other processes using the TPU (its device files open, or libtpu's lock held): {pid: command line}. libtpu
    admits one process, so while this is not empty nothing else here can open the chip."""
    return {**open_by(tpu_device_files()), **lock_holders(LIBTPU_LOCKFILE)}

