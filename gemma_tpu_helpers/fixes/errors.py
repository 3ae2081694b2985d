"""The one base class of every error this package raises on purpose (bad input, a missing artifact, a failed step).

Each module's error classes derive from :class:`GemmaTpuError` *and* the builtin they always were (``ValueError``,
``RuntimeError``, ...), so ``except ValueError`` in a user's code keeps working. The CLI (``__main__``) catches
``GemmaTpuError`` once and prints ``error: <message>``: every message says what was wrong and how to fix it.
"""

from __future__ import annotations


class GemmaTpuError(Exception):
    """An expected failure with a message for the user (the CLI prints it and exits 2)."""


def run_cli(command, args) -> int:
    """Run a CLI command ``command(args) -> exit code``; an expected failure prints ``error: <message>`` (no
    traceback) and exits 2. Every command of a command-line tool goes through here, once. An error
    class may set its own ``label`` and ``exit_code`` (a preempted training: ``preempted: ...``, 75)."""
    import sys

    try:
        return command(args)
    except (GemmaTpuError, ValueError, FileExistsError) as e:  # bad input or set-up (ValueError: argparse values)
        print(f"{getattr(e, 'label', 'error')}: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
