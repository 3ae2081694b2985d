"""``python -m gemma_tpu_helpers <step> ...``: the functions the notebooks call, from a shell (for tmux on a TPU VM).
Each step is defined once, in a ``course/commands/commands_*`` module; ``course/commands/cli.py`` holds the pattern."""

from __future__ import annotations

import gc
import sys

from .course.commands import commands_course, commands_model, commands_serve, commands_train
from .course.commands.cli import build_parser, run_cli

COMMANDS = commands_model.COMMANDS + commands_train.COMMANDS + commands_serve.COMMANDS + commands_course.COMMANDS


def main(argv=None) -> int:
    try:
        args = build_parser(COMMANDS).parse_args(argv)
    except SystemExit as e:  # a usage error (2, one line) or --help (0): an exit code, as a command's
        return e.code
    return run_cli(args.func, args)


if __name__ == "__main__":
    code = main()
    # The process ends here. Python's shutdown would run its cyclic garbage collector over the whole heap (JAX,
    # tunix, transformers and torch: about 4,500 modules), 1.3-2 s of CPU at the end of every command that trained,
    # merged or loaded a model, to free memory the process is about to give back anyway. Frozen objects are skipped;
    # shutdown still runs the atexit handlers (logging's flush, temporary directories) and frees what reference
    # counting frees, so nothing a command wrote is lost.
    gc.freeze()
    sys.exit(code)
