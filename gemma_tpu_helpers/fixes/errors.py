"""The base class of every error raised on purpose (bad input, a missing artifact, a failed step).

Error classes derive from :class:`GemmaTpuError` *and* a builtin (``ValueError`` ...), so ``except ValueError``
keeps working; the CLI prints their message, which says what was wrong and how to fix it.
"""

from __future__ import annotations


class GemmaTpuError(Exception):
    """An expected failure with a message for the user (the CLI prints it and exits 2)."""

