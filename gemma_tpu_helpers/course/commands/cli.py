"""The command line's one pattern. Each step is a :class:`Command` (its arguments, what it runs), defined once in a
``commands_*`` module; :func:`build_parser` makes them sub-commands and :func:`run_cli` runs the one chosen. Bad input
is one line and exit 2: argparse's errors through :class:`OneLineParser` (the ``type=`` checks below among them), the
package's errors through :func:`run_cli`, which says what a fix's parameters are called here (:data:`FLAGS`)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import Callable

from ...fixes.core.errors import GemmaTpuError
from ...fixes.core.file_io import PathArgumentError, absolute_path
from ...fixes.train.data import NO_CONFIG
from ..config import paths, profiles, tiny

PROG = "python -m gemma_tpu_helpers"
DESCRIPTION = "gemma-tpu course steps. Each sub-command is what a notebook calls."


@dataclasses.dataclass(frozen=True)
class Command:
    """A sub-command: ``arguments(parser)`` adds its arguments, ``run(args)`` returns its exit code."""
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str | None = None
    epilog: str | None = None


class OneLineParser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (``error: ...``, exit 2), as every other bad input here. Its
    sub-command parsers are of this class too."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message} (see `{self.prog} --help`)\n")


def build_parser(commands) -> OneLineParser:
    ap = OneLineParser(prog=PROG, description=DESCRIPTION)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="STEP")
    for c in commands:
        p = sub.add_parser(c.name, help=c.help, description=c.description, epilog=c.epilog)
        c.arguments(p)
        p.set_defaults(func=c.run)
    return ap


# What the parameters a fix's error is about (GemmaTpuError.params, spelled in its message as a Python call spells
# them) are on this command line: the one place the course maps a fix's terms to its own.
FLAGS = {
    "overwrite": "--overwrite",
    "fold_expert_scale": "--no-fold-expert-scale (left out: folded)",
    "port": "--port (left out: a free one)",
    "num_processes": "--num-processes",
    "process_id": "--process-id",
    "config": f"--config NAME (--config {NO_CONFIG}: a source without configs)",
    "completions": "--completions FILE",
    "calibrate": "`eval --calibrate --problems DIR`",
    "step": "--step",
    "model_dir": "--model (bench: --serve-model)",
    "api_key": "--api-key",
}


def flags_note(params) -> str:
    """What the parameters a fix's message names (``GemmaTpuError.params``, or a result's ``params``) are called on
    this command line (:data:`FLAGS`), as a sentence."""
    named = [f"{p} is {FLAGS[p]}" for p in params if p in FLAGS]
    return f" On the command line, {' and '.join(named)}." if named else ""


def causes(error) -> list:
    """``error`` and what it was raised from (a fix may raise its own class from another fix's error)."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__
    return chain


def course_note(error) -> str:
    """What the course knows about the file a failure is about (``error.path``, or a cause's): a damaged tiny
    replica is rebuilt by the ``tiny-model`` step."""
    for e in causes(error):
        path = getattr(e, "path", None)
        if path is not None and (Path(path) / tiny.BUILT_BY).is_file():
            return f" It is a tiny replica: rebuild it with `{PROG} tiny-model {path} --overwrite`."
    return ""


def run_cli(command, args) -> int:
    """Run ``command(args) -> exit code``; an expected failure prints ``error: <message>`` (no traceback) and exits 2,
    the message followed by what its parameters are called here. An error class may set its own ``label`` and
    ``exit_code`` (a preempted training: ``preempted: ...``, 75)."""
    try:
        return command(args)
    except (GemmaTpuError, ValueError, FileExistsError) as e:
        message, note = str(e), flags_note(dict.fromkeys(p for c in causes(e) for p in getattr(c, "params", ()))) + \
            course_note(e)
        if note and message.rstrip()[-1:] not in (".", "!", "?"):
            message = message.rstrip() + "."
        print(f"{getattr(e, 'label', 'error')}: {message}{note}", file=sys.stderr)
        return getattr(e, "exit_code", 2)


# ------------------------------------------------------------------------------- argument types (argparse type=)

def _checked(kind, ok, what: str, name: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = name
    return parse


positive_int = _checked(int, lambda v: v >= 1, "a positive integer", "positive_int")
non_negative_int = _checked(int, lambda v: v >= 0, "an integer of 0 or more", "non_negative_int")
tcp_port = _checked(int, lambda v: 1 <= v <= 65535, "a port number from 1 to 65535", "tcp_port")
positive_seconds = _checked(float, lambda v: math.isfinite(v) and v > 0, "a positive number of seconds",
                            "positive_seconds")


def cli_path(text: str, remote: bool = False):
    """A path argument: ``file_io.absolute_path``, with argparse's own one-line usage error (exit 2) for an empty
    one, or for a ``gs://`` path where the step takes local files only."""
    try:
        return absolute_path(text, remote=remote)
    except PathArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cli_path_or_gs(text: str):
    """:func:`cli_path` for arguments that may name Cloud Storage (a run directory, a checkpoint directory)."""
    return cli_path(text, remote=True)


def _not_empty(text: str, path: Path) -> None:
    if path.is_file() and path.stat().st_size == 0:
        raise argparse.ArgumentTypeError(f"{text} is an empty file: it has no rows")


def input_file(text: str) -> Path:
    """A local input file, as :func:`cli_path` takes it; an empty one is an error here, where it is named."""
    path = cli_path(text)
    _not_empty(text, path)
    return path


def data_source(text: str) -> str:
    """A ``--source`` (:func:`paths.data_source`); an empty local file is an error here, where it is named."""
    source = paths.data_source(text)
    _not_empty(text, Path(source).expanduser())
    return source


# ------------------------------------------------------------------------------- arguments several steps share

def profile_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=None, help=f"one of {', '.join(profiles.PROFILES)} "
                   f"(default: ${profiles.ENV_VAR}, else smoke when no TPU is visible)")


def runs_argument(p, text: str = "runs root (default ./runs)") -> None:
    p.add_argument("--runs", type=cli_path, default=None, help=text)


def data_source_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", type=data_source, default=None,
                   help="another copy of the profile's data: a local copy of the dataset's repository, a dataset id, "
                        "a .jsonl/.json/.parquet file or 'shipped' (the course's replica; default: the profile's)")
    p.add_argument("--config", default=None,
                   help=f"the dataset's config (default: the profile's, e.g. sft for CodeV-R1, which a copy of the "
                        f"repository needs too; a single file has none; '{NO_CONFIG}' for a source without configs)")
