"""Files, written so that a crash never leaves half of one: paths (local or gs://), atomic writes of files and
directories, a lock between processes, log tails and config hashes. Standard library only."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

from .errors import GemmaTpuError

LOG_TAIL_LINES = 40


REMOTE_SCHEMES = ("gs://",)  # paths handed on as they are (Orbax and tensorstore read them natively)


class PathArgumentError(GemmaTpuError, ValueError):
    """A path argument that names nothing (an empty string)."""


class OutputExistsError(GemmaTpuError, FileExistsError):
    """An output that is there already, and no ``overwrite=True`` to replace it."""


def is_remote(path) -> bool:
    """A ``gs://`` path (a string or an ``etils.epath.Path``)."""
    return os.fspath(path).startswith(REMOTE_SCHEMES)


def to_path(path: str | os.PathLike):
    """``pathlib.Path`` for a local path; for ``gs://...`` an ``etils.epath.Path`` (the same API; Orbax's type)."""
    if is_remote(path):
        _fresh_gcs_listings()
        from etils import epath

        return epath.Path(os.fspath(path))
    return Path(path)


def _fresh_gcs_listings() -> None:
    """Turn off gcsfs's listings cache for every gs:// filesystem made after this: ``exists`` answers from it,
    so a file another process wrote since stays invisible for the life of the process."""
    import fsspec

    fsspec.config.conf.setdefault("gs", {})["use_listings_cache"] = False


def absolute_path(path: str | os.PathLike, what: str = "path", remote: bool = False):
    """``path`` made absolute (``~`` expanded) once, where it comes in, before anything changes directory or needs
    an absolute path. ``gs://...``: an ``etils.epath.Path`` with ``remote``, else refused. Raises
    :class:`PathArgumentError` for that and for an empty path (which would mean the current directory)."""
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


def write_atomic(path: str | os.PathLike, text: str):
    """Write ``text`` to a temp file beside ``path``, then rename it over ``path``: a reader sees the old file or
    the new one, never half of one. On ``gs://`` one upload does the same."""
    return write_lines_atomic(path, [text])


def write_lines_atomic(path: str | os.PathLike, chunks: Iterable[str], overwrite: bool = True):
    """:func:`write_atomic` for text produced piece by piece; ``overwrite=False`` refuses to replace a file."""
    path = to_path(path)
    if path.exists() and not overwrite:
        raise OutputExistsError(f"{path} exists; pass overwrite=True to replace it", params=("overwrite",))
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
    """A local copy of ``gs://BUCKET/PATH`` (an object or a folder) in ``cache_dir/BUCKET/PATH``, for readers of
    local files only; kept in step with the bucket by object generation, files gone from it deleted."""
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
    """Hold an exclusive lock for ``path`` while the block runs, so a second process that wants the same artifact
    waits and then finds it built. An advisory ``flock`` on ``.<name>.lock`` beside it (freed if the holder dies);
    not re-entrant: take it once, around the check and the build."""
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


def log_tail(path: str | os.PathLike, n: int = LOG_TAIL_LINES) -> str:
    """The last ``n`` lines of a log file, or ``(no log at PATH)``."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"(no log at {path})"


def config_hash(config: dict, length: int = 16) -> str:
    """A short, stable digest of a JSON-able config (key order does not matter)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:length]
