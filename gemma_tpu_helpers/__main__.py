"""``python -m gemma_tpu_helpers <step> ...``: the functions the notebooks call, from a shell (for tmux on a TPU VM).
Each step is defined once, in a ``course/commands_*`` module; ``course/cli.py`` holds the pattern."""

from __future__ import annotations

import sys

from .course import commands_course, commands_model, commands_serve, commands_train
from .course.cli import build_parser, run_cli

COMMANDS = commands_model.COMMANDS + commands_train.COMMANDS + commands_serve.COMMANDS + commands_course.COMMANDS


def main(argv=None) -> int:
    try:
        args = build_parser(COMMANDS).parse_args(argv)
    except SystemExit as e:  # a usage error (2, one line) or --help (0): an exit code, as a command's
        return e.code
    return run_cli(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
