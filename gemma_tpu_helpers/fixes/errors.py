"""The base class of every error raised on purpose (bad input, a missing artifact, a failed step).

Error classes derive from :class:`GemmaTpuError` *and* a builtin (``ValueError`` ...), so ``except ValueError``
keeps working; the message says what was wrong and how to fix it, in the terms of a Python caller.
"""

from __future__ import annotations


class GemmaTpuError(Exception):
    """An expected failure with a message for the user.

    ``params``: the names the message tells its caller to set or call (``("overwrite",)``), spelled in the message
    as a Python call spells them (``overwrite=True``). A front end that takes them under other names, such as a
    command line's flags, reads ``params`` to say so: the message itself names no front end.
    ``path``: the file or directory the failure is about, when there is one (a front end may know more about it).
    """

    def __init__(self, *args, params: tuple[str, ...] = (), path=None):
        super().__init__(*args)
        self.params = tuple(params)
        self.path = path
