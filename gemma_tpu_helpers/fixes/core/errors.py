"""The base class of every error raised on purpose: each derives from :class:`GemmaTpuError` *and* a builtin
(``ValueError`` ...), so ``except ValueError`` keeps working; its message says what was wrong and how to fix it."""

from __future__ import annotations


class GemmaTpuError(Exception):
    """An expected failure with a message for the user. ``params``: the names the message tells its caller to set
    (``("overwrite",)``), spelled as a Python call spells them (``overwrite=True``); a front end that takes them under
    other names (a command line's flags) reads ``params`` to say so. ``path``: the file or directory it is about."""

    def __init__(self, *args, params: tuple[str, ...] = (), path=None):
        super().__init__(*args)
        self.params = tuple(params)
        self.path = path


class DataError(GemmaTpuError, ValueError):
    """Data that cannot be loaded, rendered with its chat template or packed as asked (data, chat_tokens, packing)."""
