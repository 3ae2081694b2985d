"""Shared infrastructure, once each: atomic writes of files and directories, a lock between processes, which processes hold a file, log tails,
config hashes, process-group supervision, and the HTTP client for OpenAI-compatible servers (one URL rule, one proxy rule, one key variable).

Standard library only (and :mod:`errors`), so any module (and any project a helper is copied into) can use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterable

from .errors import GemmaTpuError

LOG_TAIL_LINES = 40
REMOTE_SCHEMES = ("gs://",)  # paths handed on as they are (Orbax and tensorstore read them natively)


class PathArgumentError(GemmaTpuError, ValueError):
    """A path argument that names nothing (an empty string)."""


def is_remote(path) -> bool:
    """A ``gs://`` path (a string or an ``etils.epath.Path``)."""
    return os.fspath(path).startswith(REMOTE_SCHEMES)


def to_path(path: str | os.PathLike):
    """``pathlib.Path`` for a local path; ``etils.epath.Path`` (the same API: ``/``, ``exists``, ``iterdir``,
    ``read_text``, ``open``, ...; gcsfs underneath) for ``gs://...``, the path type Orbax itself uses."""
    if is_remote(path):
        _fresh_gcs_listings()
        from etils import epath

        return epath.Path(os.fspath(path))
    return Path(path)


def _fresh_gcs_listings() -> None:
    """gcsfs caches folder listings for the life of a process, and ``exists``/``is_file`` answer from them: a step
    another process saved, or ``done.json`` written since, stays invisible. Off for every gs:// filesystem made
    after this (fsspec's per-protocol defaults; epath and :func:`local_copy` make theirs through fsspec)."""
    import fsspec

    fsspec.config.conf.setdefault("gs", {})["use_listings_cache"] = False


def absolute_path(path: str | os.PathLike, what: str = "path", remote: bool = False):
    """``path`` made absolute against the current directory (``~`` expanded, ``..`` folded), once, where it comes
    in: later code may change directory or hand it to a library that needs an absolute path (Orbax, tensorstore,
    a server started in its log folder). An empty path raises :class:`PathArgumentError` (it would otherwise mean
    the current directory).

    ``gs://...``: an ``etils.epath.Path`` where the caller reads and writes it through that API (``remote=True``),
    else :class:`PathArgumentError` saying so in one line, with the fix (copy it to a local directory)."""
    text = os.fspath(path)
    if not str(text).strip():
        raise PathArgumentError(f"the {what} is empty; give a directory or file name (relative to the current "
                                f"directory, or absolute).")
    if is_remote(text):
        if not remote:
            raise PathArgumentError(f"the {what} {text} is on Cloud Storage, and this step reads and writes it as "
                                    f"local files; copy it to a local directory first (gcloud storage cp -r "
                                    f"{text} DIR) and pass DIR.")
        return to_path(text)
    return Path(os.path.abspath(os.path.expanduser(text)))


def path_id(path: str | os.PathLike) -> str:
    """The text that names ``path`` in records (merge_info.json, ...): resolved locally (links followed),
    the ``gs://`` URL as it is."""
    return os.fspath(path) if is_remote(path) else str(Path(path).resolve())


def cli_path(text: str, remote: bool = False):
    """An ``argparse`` ``type=`` for path arguments: :func:`absolute_path`, with argparse's own one-line usage
    error (exit 2) for an empty one, or for a ``gs://`` path where the step takes local files only."""
    import argparse

    try:
        return absolute_path(text, remote=remote)
    except PathArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cli_path_or_gs(text: str):
    """:func:`cli_path` for arguments that may name Cloud Storage (a run directory, a checkpoint directory)."""
    return cli_path(text, remote=True)


def write_atomic(path: str | os.PathLike, text: str):
    """Write ``text`` to a temp file beside ``path``, then rename it over ``path``: a reader sees the old file or
    the new one, never half of one (also when the writer is killed). On ``gs://`` one upload does the same (an
    object appears whole or not at all)."""
    return write_lines_atomic(path, [text])


def write_lines_atomic(path: str | os.PathLike, chunks: Iterable[str], overwrite: bool = True):
    """:func:`write_atomic` for text produced piece by piece; ``overwrite=False`` refuses to replace a file."""
    path = to_path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True (--overwrite) to replace it")
    if is_remote(path):  # no rename on Cloud Storage (a copy); a single upload is atomic already
        path.write_text("".join(chunks), encoding="utf-8")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def local_copy(url: str, cache_dir: str | os.PathLike) -> Path:
    """A local copy of ``gs://BUCKET/PATH`` (an object, or every object under a folder) in
    ``cache_dir/BUCKET/PATH``, for readers that take local files only (``datasets``' repository loader). Kept in
    step with the bucket: an object is fetched again when its generation differs from the copy's, and files gone
    from the bucket are deleted from the copy. Each file lands whole (temp file, rename)."""
    import fsspec

    _fresh_gcs_listings()
    fs = fsspec.filesystem("gs")
    key = os.fspath(url)[len("gs://"):].rstrip("/")
    dest = Path(cache_dir) / key
    if fs.isfile(key):
        found = {"": fs.info(key)}
    else:
        found = {path[len(key) + 1:]: info for path, info in fs.find(key, detail=True).items()
                 if not path.endswith("/")}
    if not found:
        raise PathArgumentError(f"{url} holds nothing: no object of that name and none under it. Check the bucket "
                                f"and path (gcloud storage ls {url}).")
    manifest = dest.parent / f".{dest.name}.generations.json"
    known = json.loads(manifest.read_text()) if manifest.is_file() else {}
    have = {}
    for rel, info in sorted(found.items()):
        target = dest / rel if rel else dest
        version = str(info.get("generation") or info.get("md5Hash") or info.get("etag"))
        if known.get(rel) != version or not target.is_file() or target.stat().st_size != info.get("size"):
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
            os.close(fd)
            try:
                fs.get_file(info["name"], tmp)
                os.replace(tmp, target)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
        have[rel] = version
    if dest.is_dir():  # files deleted from the bucket since the last copy
        for f in dest.rglob("*"):
            if f.is_file() and not f.name.startswith(".") and str(f.relative_to(dest)) not in have:
                f.unlink()
    write_atomic(manifest, json.dumps(have, indent=1))
    return dest


def temp_dir_beside(path: str | os.PathLike, tag: str = "tmp") -> Path:
    """A new private directory next to ``path`` (same filesystem, so :func:`install_dir` is a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{path.name}.{tag}-", dir=path.parent))


def install_dir(tmp: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Put the finished directory ``tmp`` at ``out_dir`` by renames; an old ``out_dir`` is removed afterwards.
    Whether replacing it is allowed is the caller's question (ask before building ``tmp``)."""
    tmp, out_dir = Path(tmp), Path(out_dir)
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.rename(out_dir, old / "x")
    os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


@contextlib.contextmanager
def locked(path: str | os.PathLike, what: str = "it"):
    """Hold an exclusive lock for ``path`` while the block runs: a second process (another notebook, a CLI step)
    that wants the same artifact waits, then finds it built, instead of building it beside the first and renaming
    over it. The lock is ``.<name>.lock`` beside ``path`` (advisory ``flock``, freed by the OS if the holder dies).
    Not re-entrant: take it once per artifact, around the check and the build."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process that is writing {path} ({what}) ...", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield path
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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


def log_tail(path: str | os.PathLike, n: int = LOG_TAIL_LINES) -> str:
    """The last ``n`` lines of a log file, or ``(no log at PATH)``."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"(no log at {path})"


def config_hash(config: dict, length: int = 16) -> str:
    """A short, stable digest of a JSON-able config (key order does not matter)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:length]


# ----------------------------------------------------------------------------------------------- process groups
# A server (vLLM) or a tool (`vllm bench serve`, a simulator) runs in its own process group, so that stopping it also
# stops what it started (vLLM's engine core and workers), and nothing outlives the notebook or the test.

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


# ----------------------------------------------------------------------------------------------- HTTP client
# One client for OpenAI-compatible servers (vLLM): JSON over the standard library's urllib.
# - URL rule: a user's base URL, with or without /v1 or a trailing slash, names the server's root
#   (:func:`api_root`); endpoints are built from it (:func:`api_url` -> ROOT/v1/..., :func:`health_url` -> ROOT/health).
# - Proxy rule: a server on this machine (127.0.0.1, localhost, ::1) is never reached through a proxy from the
#   environment (http_proxy would swallow the request); other hosts follow the environment.
# - Key rule: the ``api_key`` argument, else $VLLM_API_KEY (the variable the vLLM server itself reads); "" sends none.

API_KEY_ENV = "VLLM_API_KEY"
REQUEST_TIMEOUT_S = 120.0
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
_ENDPOINT_SUFFIXES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1", "/health")


class RequestError(GemmaTpuError, RuntimeError):
    """An HTTP request failed; ``status`` is the HTTP code, or None when no answer came (refused, timed out)."""

    status: int | None = None


def api_root(url: str) -> str:
    """The server's root URL: ``http://h:1``, ``http://h:1/``, ``http://h:1/v1``, ``http://h:1/v1/`` (and a full
    endpoint URL such as ``.../v1/models``) all give ``http://h:1``."""
    url = url.strip().rstrip("/")
    for suffix in _ENDPOINT_SUFFIXES:
        if url.endswith(suffix):
            return url[: -len(suffix)].rstrip("/")
    return url


def api_url(url: str, endpoint: str) -> str:
    """The OpenAI endpoint ``endpoint`` (``"models"``, ``"chat/completions"``, ...) of the server at ``url``."""
    return f"{api_root(url)}/v1/{endpoint.lstrip('/')}"


def health_url(url: str) -> str:
    """vLLM's health check of the server at ``url`` (200 once it serves)."""
    return api_root(url) + "/health"


def resolve_api_key(api_key: str | None = None) -> str | None:
    """The key rule: ``api_key`` if given (``""``: none), else $VLLM_API_KEY, else None."""
    key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
    return key or None


def is_local(url: str) -> bool:
    return urllib.parse.urlsplit(url).hostname in LOCAL_HOSTS


def _opener(url: str) -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(*([urllib.request.ProxyHandler({})] if is_local(url) else []))


def is_timeout(e: BaseException) -> bool:
    """A socket timeout, bare or wrapped in urllib's URLError."""
    return isinstance(e, TimeoutError) or (isinstance(e, urllib.error.URLError) and isinstance(e.reason, TimeoutError))


def _fail(error: type[Exception], message: str, status: int | None = None) -> Exception:
    exc = error(message)
    exc.status = status
    return exc


def timeout_message(method: str, url: str, timeout: float) -> str:
    return (f"{method} {url} timed out after {timeout:g} s: the server is busy or stuck (a CPU server handles a few "
            f"requests at a time; check its log), or raise timeout=.")


def open_request(method: str, url: str, payload: dict | None = None, api_key: str | None = None,
                 timeout: float = REQUEST_TIMEOUT_S, error: type[Exception] = RequestError,
                 headers: dict | None = None):
    """The open response of a JSON request (read it, or iterate it for a stream; close it). Failures raise
    ``error`` (default :class:`RequestError`, with ``.status``) saying what was wrong and how to fix it.
    ``headers`` are added to the request's."""
    key = resolve_api_key(api_key)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
               **(headers or {})}
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    root = api_root(url)
    try:
        return _opener(url).open(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")[:500]
        if e.code == 401:
            why = (f"the key {'was refused' if key else 'is missing'}: the server was started with an API key; pass "
                   f"the same api_key= (--api-key) or set ${API_KEY_ENV}")
        elif e.code == 404:
            why = (f"{url} does not exist on this server; is {root} the server's base URL (such as "
                   f"http://127.0.0.1:8000, with or without /v1)? {body}")
        else:
            why = body
        raise _fail(error, f"{method} {url} failed with HTTP {e.code} {e.reason}: {why}", e.code) from None
    except OSError as e:  # URLError, refused connections and timeouts are all OSErrors
        if is_timeout(e):
            raise _fail(error, timeout_message(method, url, timeout)) from None
        reason = getattr(e, "reason", e)
        if isinstance(reason, ConnectionRefusedError):
            hint = (f"connection refused: is the server running, and is {root} its URL? (start it with serve.start "
                    f"or notebook 08; `curl {root}/health` checks it)")
        else:
            hint = f"{reason}: check the host and port in {root}, and that the server is running"
        raise _fail(error, f"Cannot reach {url}: {hint}") from None


def request_json(method: str, url: str, payload: dict | None = None, api_key: str | None = None,
                 timeout: float = REQUEST_TIMEOUT_S, error: type[Exception] = RequestError) -> dict:
    """One JSON request (``GET`` with no payload, ``POST`` with one) and its decoded JSON answer."""
    resp = open_request(method, url, payload, api_key, timeout, error)
    try:
        with resp:
            body = resp.read()
    except OSError as e:
        if is_timeout(e):
            raise _fail(error, timeout_message(method, url, timeout)) from None
        raise _fail(error, f"{method} {url}: the connection broke while reading the answer ({e})") from None
    try:
        return json.loads(body)
    except ValueError:
        raise _fail(error, f"{method} {url} answered with something that is not JSON ({body[:200]!r}): is "
                           f"{api_root(url)} an OpenAI-compatible server?", resp.status) from None


def get_json(url: str, api_key: str | None = None, timeout: float = REQUEST_TIMEOUT_S,
             error: type[Exception] = RequestError) -> dict:
    return request_json("GET", url, None, api_key, timeout, error)


def post_json(url: str, payload: dict, api_key: str | None = None, timeout: float = REQUEST_TIMEOUT_S,
              error: type[Exception] = RequestError) -> dict:
    return request_json("POST", url, payload, api_key, timeout, error)


def get_text(url: str, headers: dict | None = None, timeout: float = REQUEST_TIMEOUT_S,
             error: type[Exception] = RequestError) -> str:
    """A plain-text ``GET`` (e.g. a cloud metadata server) with the same proxy rule; never sends an API key."""
    resp = open_request("GET", url, None, "", timeout, error, headers)
    try:
        with resp:
            return resp.read().decode(errors="replace")
    except OSError as e:
        raise _fail(error, f"GET {url}: the connection broke while reading the answer ({e})") from None


def health_ok(url: str, timeout: float = 5.0) -> bool:
    """True when ``GET ROOT/health`` answers 200 (no key needed; never raises)."""
    try:
        with _opener(url).open(health_url(url), timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


# ---- the TPU's device files (without importing JAX) ----

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
