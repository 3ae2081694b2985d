"""Shared infrastructure, once each: atomic writes of files and directories, log tails, config hashes.

Standard library only, so any module (and any project a helper is copied into) can use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

LOG_TAIL_LINES = 40


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to a temp file beside ``path``, then rename it over ``path``: a reader sees the old file or
    the new one, never half of one (also when the writer is killed)."""
    return write_lines_atomic(path, [text])


def write_lines_atomic(path: str | os.PathLike, chunks: Iterable[str], overwrite: bool = True) -> Path:
    """:func:`write_atomic` for text produced piece by piece; ``overwrite=False`` refuses to replace a file."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True (--overwrite) to replace it")
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


def log_tail(path: str | os.PathLike, n: int = LOG_TAIL_LINES) -> str:
    """The last ``n`` lines of a log file, or ``(no log at PATH)``."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"(no log at {path})"


def config_hash(config: dict, length: int = 16) -> str:
    """A short, stable digest of a JSON-able config (key order does not matter)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:length]
