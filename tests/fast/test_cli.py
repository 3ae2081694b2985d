"""The command line: each step defined once, in one pattern (course/commands/), every parser
builds, and bad input as a new user types it is one line on stderr, exit 2, no traceback."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import gemma_tpu_helpers
import support
from gemma_tpu_helpers import __main__ as main_module
from gemma_tpu_helpers.course.commands import cli
from gemma_tpu_helpers.fixes.train import data
from support import run_cli

PKG = Path(gemma_tpu_helpers.__file__).parent
CLI_MODULES = sorted([PKG / "course" / "commands" / "cli.py", *(PKG / "course" / "commands").glob("commands_*.py")])


# ------------------------------------------------------------------------------------------- as a new user typed it

def test_data_stats_on_an_empty_file(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    line = support.one_line_error(run_cli("data-stats", "--source", "empty.jsonl", cwd=tmp_path))
    assert line.startswith("error: ") and "--source" in line and "empty.jsonl is an empty file" in line


def test_the_data_fix_says_an_empty_file_is_empty(tmp_path):
    """A notebook or a copied fix (no CLI in between): the data fix's own error, not datasets' StopIteration."""
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(data.DataError, match="empty.jsonl is empty"):
        data.load_rows(str(tmp_path / "empty.jsonl"))


def test_serve_on_a_port_out_of_range(tmp_path):
    line = support.one_line_error(run_cli("serve", "--model", "DIR", "--port", "99999", cwd=tmp_path))
    assert "--port" in line and "from 1 to 65535, got '99999'" in line


def test_train_with_negative_max_steps(tmp_path):
    line = support.one_line_error(run_cli("train", "--max-steps", "-3", cwd=tmp_path))
    assert "--max-steps" in line and "a positive integer, got '-3'" in line and "packed" not in line


# ------------------------------------------------------------------------------------------- validated when parsed

@pytest.mark.parametrize("argv, flag", [
    (["launch", "--workers", "0"], "--workers"),
    (["train", "--checkpoint-every", "0"], "--checkpoint-every"),
    (["train", "--process-id", "-1"], "--process-id"),
    (["train", "--join-timeout", "0"], "--join-timeout"),
    (["eval", "--url", "u", "--n", "0"], "--n"),
    (["eval", "--url", "u", "--top-k", "-1"], "--top-k"),
    (["eval", "--url", "u", "--workers", "x"], "--workers"),
    (["eval", "--url", "u", "--k", "0,1"], "--k"),
    (["serve", "--model", "m", "--timeout", "nan"], "--timeout"),
    (["tiny-model", "out", "--layers", "0"], "--layers"),
    (["tiny-model", "out", "--seed", "-1"], "--seed"),
    (["learn", "--seed", "-1"], "--seed"),
    (["plan", "--seq-len", "0"], "--seq-len"),
    (["bench", "--url", "u", "--num-prompts", "0"], "--num-prompts"),
    (["data-stats", "--show-example", "-1"], "--show-example"),
])
def test_a_bad_value_is_one_line_at_parse_time(argv, flag, capsys):
    assert main_module.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"argument {flag}" in err, err


def test_zero_where_zero_means_something():
    args = cli.build_parser(main_module.COMMANDS).parse_args(["eval", "--url", "u", "--top-k", "0"])
    assert args.top_k == 0
    args = cli.build_parser(main_module.COMMANDS).parse_args(["train", "--process-id", "0", "--max-steps", "1"])
    assert (args.process_id, args.max_steps) == (0, 1)


def test_a_learning_check_of_another_seed_is_another_cached_result():
    """``learn --seed N`` trains another LoRA: the seed is in the settings its cache is keyed on."""
    from gemma_tpu_helpers.course.config import profiles
    from gemma_tpu_helpers.course.training import learning_check

    smoke = profiles.get_profile("smoke")
    args = cli.build_parser(main_module.COMMANDS).parse_args(["learn", "--seed", "3"])
    seeded = learning_check.with_seed(smoke, args.seed)
    assert seeded.train.seed == 3 and learning_check.with_seed(smoke, None) is smoke
    tasks = ["Prob001_majority3"]
    assert learning_check.settings(seeded, tasks, None) != learning_check.settings(smoke, tasks, None)
    assert learning_check.settings(seeded, tasks, None)["seed"] == 3


# An atexit hook registered before the command runs is called after `python -m gemma_tpu_helpers` returned from it.
_FREEZE_AT_EXIT = ("import atexit, gc, runpy, sys; "
                   "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count(), flush=True)); "
                   "sys.argv = ['gemma_tpu_helpers', *sys.argv[1:]]; "
                   "runpy.run_module('gemma_tpu_helpers', run_name='__main__', alter_sys=True)")


@pytest.mark.parametrize("argv, code", [(["cost", "--tpu-hours", "10", "--gpu-hours", "16"], 0), (["cost"], 2)])
def test_a_command_leaves_its_heap_to_the_process_exit(tmp_path, argv, code):
    """`python -m gemma_tpu_helpers` freezes the heap once the command returned, so that Python's shutdown does not
    run its cyclic collector over JAX, tunix, transformers and torch (__main__.py): what the command printed, and its
    exit code, are the same."""
    r = subprocess.run([sys.executable, "-c", _FREEZE_AT_EXIT, *argv], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120)
    assert r.returncode == code, r.stderr[-2000:]
    *printed, last = r.stdout.splitlines()
    assert last.startswith("frozen at exit:") and int(last.split(":")[1]) > 0, r.stdout[-2000:]
    typed = run_cli(*argv, cwd=tmp_path)
    assert (printed, r.stderr) == (typed.stdout.splitlines(), typed.stderr) and (printed or code), r.stdout


# ------------------------------------------------------------------------------------------------ one pattern, once

def test_each_step_is_defined_once_and_its_parser_builds():
    names = [c.name for c in main_module.COMMANDS]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    choices = cli.build_parser(main_module.COMMANDS)._subparsers._group_actions[0].choices
    assert list(choices) == names
    for c in main_module.COMMANDS:
        assert c.name in choices[c.name].format_help()
        assert c.run.__name__ == "run_" + c.name.replace("-", "_"), c


def test_only_the_command_modules_add_arguments():
    """No second pattern grows back: sub-commands and their arguments are added in course/commands/cli.py and
    course/commands/commands_*.py alone (a vLLM launcher script inside a string does not count)."""
    found = [f"{path.relative_to(PKG)}:{node.lineno}" for path in sorted(PKG.rglob("*.py")) if path not in CLI_MODULES
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr in ("add_argument", "add_parser", "add_subparsers")]
    assert not found, found


def _run_raising(error, capsys) -> tuple[int, str]:
    def command(args):
        raise error

    code = cli.run_cli(command, None)
    return code, capsys.readouterr().err


def test_the_cli_says_what_a_fix_errors_parameters_are_called_here(tmp_path, capsys):
    """A fix's error names its parameters as a Python call spells them (GemmaTpuError.params); run_cli adds their
    flags from its one table (cli.FLAGS), and for a damaged tiny replica the step that rebuilds it."""
    from gemma_tpu_helpers.course.config import tiny
    from gemma_tpu_helpers.fixes.core import file_io
    from gemma_tpu_helpers.fixes.core.errors import GemmaTpuError
    from gemma_tpu_helpers.fixes.export import safetensors_io
    from gemma_tpu_helpers.fixes.model import hf_checkpoint

    out = tmp_path / "results.jsonl"
    out.write_text("keep me")
    with pytest.raises(file_io.OutputExistsError) as e:
        file_io.write_lines_atomic(out, ["new"], overwrite=False)
    assert "--" not in str(e.value) and e.value.params == ("overwrite",)
    assert _run_raising(e.value, capsys) == (2, f"error: {out} exists; pass overwrite=True to replace it. On the "
                                                f"command line, overwrite is --overwrite.\n")
    both = GemmaTpuError("merge step=2 again (overwrite=True)", params=("step", "overwrite"))
    assert _run_raising(both, capsys)[1] == ("error: merge step=2 again (overwrite=True). On the command line, step is "
                                             "--step and overwrite is --overwrite.\n")
    assert _run_raising(GemmaTpuError("no such split", params=("split",)), capsys)[1] == "error: no such split\n"

    base = tmp_path / "base"
    base.mkdir()
    shard = base / "model-00001-of-00001.safetensors"
    shard.write_bytes(b"\x00" * 4)
    with pytest.raises(hf_checkpoint.CheckpointError) as damaged:
        hf_checkpoint.read_shard_header(shard)
    assert damaged.value.path == base and "tiny-model" not in str(damaged.value)
    assert "tiny-model" not in _run_raising(damaged.value, capsys)[1]  # not built by the course: no rebuild hint
    (base / tiny.BUILT_BY).write_text("{}")
    wrapped = safetensors_io.SafetensorsError(str(damaged.value))
    wrapped.__cause__ = damaged.value  # the merge raises its own class from the checkpoint's error
    line = _run_raising(wrapped, capsys)[1]
    assert line.startswith(f"error: {shard} is truncated") and line.endswith(
        f"It is a tiny replica: rebuild it with `python -m gemma_tpu_helpers tiny-model {base} --overwrite`.\n")
    (base / hf_checkpoint.MERGE_INFO).write_text("{}")  # a merged model: the fix says "run the merge again"
    with pytest.raises(hf_checkpoint.CheckpointError) as merged:
        hf_checkpoint.read_shard_header(shard)
    wrapped = safetensors_io.SafetensorsError(str(merged.value))
    wrapped.__cause__ = merged.value
    assert "(overwrite=True). On the command line, overwrite is --overwrite." in _run_raising(wrapped, capsys)[1]


def test_every_flag_of_the_table_is_the_clis_and_every_name_a_fixs():
    """cli.FLAGS stays true: each flag it gives exists on the command line, and each parameter name is one a fix's
    error declares (``params=``), so a renamed flag or parameter fails here."""
    import re

    parser = cli.build_parser(main_module.COMMANDS)
    options = {s for sub in parser._subparsers._group_actions[0].choices.values() for a in sub._actions
               for s in a.option_strings}
    assert not [f for v in cli.FLAGS.values() for f in re.findall(r"--[a-z][a-z0-9-]*", v) if f not in options]
    declared = set()
    for path in (PKG / "fixes").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "params":
                declared |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "WHO" for t in node.targets):
                declared |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_fail" and len(node.args) > 3:
                declared |= {c.value for c in ast.walk(node.args[3]) if isinstance(c, ast.Constant)}
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "problem" \
                    and len(node.args) > 1:  # a result's params (weight_check: found.problem(text, param))
                declared |= {c.value for c in node.args[1:] if isinstance(c, ast.Constant)}
    assert set(cli.FLAGS) <= declared, sorted(set(cli.FLAGS) - declared)
