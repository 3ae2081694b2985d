"""Paths as users type them (issue: the README's own merge command failed on a healthy checkpoint).

- The shell commands of the README, the pages in docs/ and the notebooks, extracted from the files and run literally
  in a fresh working directory (the profile name substituted by ``smoke``): a documented command that fails, fails
  here.
- Every CLI step from that directory with relative paths only: train and its resume, merge, verify, export-adapter,
  serve's pre-check, eval with ``--completions``.
- Bad paths (missing, empty, a file for a directory, a damaged safetensors shard) give one line and exit 2.
"""

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

import support
from gemma_tpu_helpers import __main__ as cli
from gemma_tpu_helpers.course.commands.cli import build_parser
from gemma_tpu_helpers.course.config import paths, profiles
from gemma_tpu_helpers.fixes.eval import eval_problems
from gemma_tpu_helpers.fixes.serve import vllm_command
from support import REPO, run_cli

CMD = re.compile(r"python -m gemma_tpu_helpers((?: [^`#\n]*)?)")
PLACEHOLDER = re.compile(r"^(DIR|NAME|N|Z|\.\.\.)$|[<>]")
STEPS = set(build_parser(cli.COMMANDS)._subparsers._group_actions[0].choices)
# The order the documented commands run in (each needs what an earlier one made: train builds runs/smoke/base).
ORDER = ["setup", "tiny-model", "data-stats", "lora", "sharding", "train", "parity", "merge", "verify", "eval",
         "report", "cost", "solutions", "launch"]
# Documented commands that are parsed but not run here, and why (each is run elsewhere in the suite).
NOT_RUN = {
    "learn": "trains, merges and starts vLLM twice (minutes); test_learn runs it as documented, from a fresh "
             "directory with relative paths",
    "serve": "starts vLLM (about 20 s on 2 cores); test_serve starts it from relative paths, and test_steps_... runs "
             "its pre-check",
    "plan": "an AOT compile; test_plan compiles the train step",
    "setup --check": "the workshop's readiness screen; test_workshop runs it",
    "eval --url": "needs a server; test_evaluate and notebook 09 run it",
    "bench --url": "needs a server; test_bench runs the sweep",
    "eval --calibrate": "needs VerilogEval's data set, not shipped; test_evaluate calibrates the shipped problems",
    "badges": "rewrites the checkout's notebooks from pyproject's URL; tests/fast/test_colab.py runs `badges --check` "
              "as typed, and the writing on a copy",
    "train --profile smoke --max-steps 20": "docs/tpu-vm.md's first run, a second training into its own run "
                                            "directory (a minute here); the documented `train` runs above, and "
                                            "test_train and test_resume train with --max-steps",
}


def doc_texts():
    """Every page that documents a command: the README, docs/*.md and the notebooks' cells."""
    yield "README.md", (REPO / "README.md").read_text()
    for page in sorted((REPO / "docs").glob("*.md")):
        yield f"docs/{page.name}", page.read_text()
    for nb in sorted((REPO / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            yield nb.name, "".join(cell["source"])


def documented_commands() -> list[tuple[str, list[str]]]:
    """``(file, argv)`` of every ``python -m gemma_tpu_helpers ...`` in a code span or block of the README, docs/ and
    the notebooks, with ``--profile X`` and ``runs/X`` made ``smoke`` (a placeholder such as DIR leaves it out)."""
    others = [p for p in profiles.PROFILES if not p.startswith("smoke")]
    out = []
    for name, text in doc_texts():
        text = text.replace("\\\n", " ")
        for span in re.finditer(r"```.*?```|`[^`]+`", text, re.S):
            for line in span.group(0).strip("`").splitlines() if span.group(0).startswith("```") \
                    else [span.group(0).strip("`").replace("\n", " ")]:
                for m in CMD.finditer(line):
                    argv = shlex.split(m.group(1), comments=True)
                    if not argv or argv[0] not in STEPS | {"--help"} or any(PLACEHOLDER.search(a) for a in argv):
                        continue  # prose ("... in tmux") or a placeholder to fill in
                    argv = [("smoke" if a in others and argv[i - 1] in ("--profile", "GEMMA_TPU_PROFILE") else a)
                            for i, a in enumerate(argv)]
                    argv = [re.sub(r"^(runs/)(%s)(/|$)" % "|".join(map(re.escape, others)), r"\1smoke\3", a)
                            for a in argv]
                    if len(argv) == 1 and argv[0] != "--help" and not parses(argv):
                        continue  # a mention of a step ("see `python -m gemma_tpu_helpers verify`"), not a command
                    if argv not in [a for _, a in out]:  # the same command in two places runs once
                        out.append((name, argv))
    return out


def parses(argv) -> bool:
    try:
        build_parser(cli.COMMANDS).parse_args(argv)
        return True
    except SystemExit:
        return False


def not_run_reason(argv) -> str | None:
    text = " ".join(argv)
    return next((why for key, why in NOT_RUN.items() if text == key or text.startswith(key + " ")), None)


def test_documented_commands_are_found_and_parse():
    """Every documented command is found, and the parser takes it (a renamed or removed flag fails here)."""
    found = documented_commands()
    texts = [" ".join(a) for _, a in found]
    for must in ("merge --base runs/smoke/base --checkpoint runs/smoke/checkpoints --out runs/smoke/merged",
                 "train --profile smoke --stop-after 20", "parity runs/smoke/base --layers",
                 "eval --completions answers.jsonl",
                 "launch --workers 2 --coordinator 10.0.0.2:8476 -- train --max-steps 10"):  # docs/multi-host.md
        assert must in texts, f"{must!r} is no longer documented as it was: update this test with the docs"
    unparsed = [(name, argv) for name, argv in found if argv != ["--help"] and not parses(argv)]
    assert not unparsed, f"documented commands the CLI refuses (a renamed or removed flag?): {unparsed}"


def answers_file(path: Path, tasks) -> None:
    """A completions file as notebook 09's `eval --completions answers.jsonl` reads: the references, fenced."""
    probs = eval_problems.load_problems(paths.SHIPPED_EVAL, tasks=tasks)
    path.write_text("".join(json.dumps({"task_id": p.task_id, "completion": "```verilog\n"
                                        + eval_problems.reference_code(p) + "\n```"}) + "\n" for p in probs))


EVAL_TASKS = None  # filled from the shipped problems: the two shortest references


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A fresh working directory outside the checkout, where the documented commands ran literally, in ORDER;
    runs/ is there (GEMMA_TPU_RUNS=runs, relative, as a user sets it). Yields (dir, {command: result})."""
    global EVAL_TASKS
    d = tmp_path_factory.mktemp("user") / "work"
    d.mkdir()
    probs = sorted(eval_problems.load_problems(paths.SHIPPED_EVAL),
                   key=lambda p: len(eval_problems.reference_code(p)))[:2]
    EVAL_TASKS = [p.task_id for p in probs]
    answers_file(d / "answers.jsonl", EVAL_TASKS)
    env = {"GEMMA_TPU_RUNS": "runs", "GEMMA_TPU_PROFILE": "smoke"}
    results = {}
    todo = [(n, a) for n, a in documented_commands() if a != ["--help"] and not not_run_reason(a)]
    todo.sort(key=lambda na: ORDER.index(na[1][0]))
    for name, argv in todo:
        if argv[0] == "eval":  # the shipped problem set is 28 problems: score the two that answers.jsonl holds
            argv = [*argv, "--tasks", ",".join(EVAL_TASKS)]
        results[" ".join(argv)] = run_cli(*argv, cwd=d, env=env, timeout=900)
    return d, results


def test_documented_commands_run_literally(work):
    d, results = work
    assert any(k.startswith("train ") for k in results) and any(k.startswith("merge ") for k in results)
    failed = {k: (r.returncode, r.stderr[-1500:]) for k, r in results.items() if r.returncode != 0}
    assert not failed, failed
    # what they made, where a user expects it: relative to the working directory
    assert ((d / "runs/smoke/checkpoints/lora_config.json").is_file()
            and (d / "runs/smoke/merged/merge_info.json").is_file())
    assert (d / "runs/tiny/config.json").is_file()
    info = json.loads((d / "runs/smoke/merged/merge_info.json").read_text())
    assert info["checkpoint_dir"] == str((d / "runs/smoke/checkpoints").resolve())
    merge_out = next(r.stdout for k, r in results.items() if k.startswith("merge "))
    assert f"-> {d.resolve() / 'runs/smoke/merged'}" in merge_out
    assert "parity: OK" in next(r.stdout for k, r in results.items() if k.startswith("parity "))
    assert "pass@1" in next(r.stdout for k, r in results.items() if k.startswith("eval "))


def test_the_report_of_the_documented_run(work):
    """docs/tpu-vm.md's `report --profile v5p-8 --hardware`, run on the smoke run the documented commands made:
    versions, the training's devices, the clean step time (the median of the clean steps' step_s), peak HBM n/a on a
    CPU, the merge's seconds from merge_info.json, pass@1 of the documented eval, and the missing sweep with its
    step; the same block in runs/smoke/hardware_report.md."""
    from gemma_tpu_helpers.course.front import logbook

    d, results = work
    r = results["report --profile smoke --hardware"]
    out = r.stdout
    v = logbook.versions()
    assert f"| versions | python {v['python']}, jax {v['jax']}, jaxlib {v['jaxlib']}" in out, out
    assert "| training devices | cpu x 8 (1 process) |" in out, out
    trained = int(re.search(r"\| training \| (\d+) steps in ", out)[1])
    rows = {}  # the steps of that training (test_steps_with_relative_paths_only trains one more later)
    for line in (d / "runs/smoke/train/metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row and row["step"] <= trained:
            rows[row["step"]] = row
    clean = sorted(x["step_s"] for x in rows.values() if x["step_s"] is not None)
    m = re.search(r"\| clean step time \| (\d+\.\d\d) s per optimizer step \(median of (\d+) clean steps of (\d+)\)",
                  out)
    assert m and clean, out
    median = clean[len(clean) // 2] if len(clean) % 2 else (clean[len(clean) // 2 - 1] + clean[len(clean) // 2]) / 2
    assert (float(m[1]), int(m[2]), int(m[3])) == (round(median, 2), len(clean), len(rows)), (m.groups(), clean)
    assert "| peak HBM (training) | n/a on CPU |" in out, out
    info = json.loads((d / "runs/smoke/merged/merge_info.json").read_text())
    assert info["seconds"] > 0 and f"| merge | {info['seconds']:.1f} s (step {info['step']}, " in out, out
    assert f"| pass@1 | 1.0000 on {len(EVAL_TASKS)} problems (answers from {d.resolve() / 'answers.jsonl'}" in out, out
    assert ("| serving (bench sweep) | missing: run `python -m gemma_tpu_helpers bench --url http://127.0.0.1:8000 "
            "--profile smoke` (with the server up) |") in out, out
    assert out.startswith((d / "runs/smoke/hardware_report.md").read_text()), out
    # the first run's report (docs/tpu-vm.md, step 5): that run is not made here, so each figure names its step
    first = results["report --profile smoke --hardware --runs runs/first"].stdout
    assert "| clean step time | missing: run `python -m gemma_tpu_helpers train --profile smoke` |" in first, first


def test_steps_with_relative_paths_only(work):
    """Every step from the working directory, relative paths only (the multi-host README's `--run-dir <dir>`)."""
    d, _ = work
    run = lambda *a: run_cli(*a, cwd=d, timeout=900)  # noqa: E731
    ckpt = "runs/smoke/checkpoints"
    steps_before = sorted(int(p.name) for p in (d / ckpt).iterdir() if p.name.isdigit())
    r = run("train", "--profile", "smoke", "--run-dir", "runs/smoke", "--max-steps", str(steps_before[-1] + 1),
            "--checkpoint-every", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"trained steps {steps_before[-1]}..{steps_before[-1] + 1}" in r.stdout  # resumed, not restarted
    assert not list((d / ckpt).glob("*orbax-checkpoint-tmp*"))
    r = run("merge", "--base", "runs/smoke/base", "--checkpoint", ckpt, "--out", "merged")
    assert r.returncode == 0 and f"merged step {steps_before[-1] + 1}" in r.stdout, r.stderr[-3000:]
    r = run("verify", "--base", "runs/smoke/base", "--checkpoint", ckpt, "--merged", "merged")
    assert r.returncode == 0 and "verify: OK" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])
    r = run("export-adapter", "--base", "runs/smoke/base", "--checkpoint", ckpt, "--out", "adapter")
    assert r.returncode == 0 and (d / "adapter/adapter_model.safetensors").is_file(), r.stderr[-3000:]
    out = "results.jsonl"
    r = run("eval", "--completions", "answers.jsonl", "--tasks", ",".join(EVAL_TASKS), "--out", out, "--k", "1",
            "--run-dir", "runs/smoke")  # its score goes to RUN_DIR/eval: here, not the checkout's runs/
    assert r.returncode == 0 and "pass@1" in r.stdout, r.stderr[-3000:]
    assert len((d / out).read_text().splitlines()) == len(EVAL_TASKS)
    # serve's pre-check on the relative path: a damaged copy is refused before vLLM starts, naming the shard
    shutil.copytree(d / "merged", d / "cut")
    shard = sorted((d / "cut").glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:5000])
    support.one_line_error(run("serve", "--model", "cut", "--smoke-test"),
                           f"{d.resolve() / 'cut' / shard.name} is truncated", "merge again")


def test_serve_precheck_resolves_a_relative_model_dir(work, monkeypatch):
    d, _ = work
    monkeypatch.chdir(d / "runs")
    assert vllm_command.check_model_dir("smoke/merged") == (d / "runs/smoke/merged").resolve()


# ---------------------------------------------------------------------------------------------- bad paths, in process

def cli_error(capsys, *argv) -> str:
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse's own errors (an empty path) leave through exit(2)
        rc = e.code
    assert rc == 2, (argv, rc)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_bad_paths_get_one_line(work, tmp_path, monkeypatch, capsys):
    """Each command with a path: missing, empty, a file where a directory belongs (relative, from tmp_path)."""
    d, _ = work
    monkeypatch.chdir(tmp_path)
    Path("afile").write_text("x")
    shutil.copytree(d / "runs/smoke/base", "base")
    shutil.copytree(d / "runs/smoke/checkpoints", "ckpt")
    cases = {
        ("merge", "--base", "nowhere", "--checkpoint", "ckpt", "--out", "o"): "nowhere does not exist",
        ("merge", "--base", "afile", "--checkpoint", "ckpt", "--out", "o"): "afile is a file",
        ("merge", "--base", "base", "--checkpoint", "nowhere", "--out", "o"): "nowhere does not exist",
        ("merge", "--base", "base", "--checkpoint", "afile", "--out", "o"): "afile is a file",
        ("merge", "--base", "base", "--checkpoint", "ckpt", "--out", "afile"): "afile exists and is not a directory",
        ("merge", "--base", "", "--checkpoint", "ckpt", "--out", "o"): "is empty",
        ("verify", "--base", "base", "--checkpoint", "ckpt", "--merged", "nowhere"): "nowhere does not exist",
        ("verify", "--base", "base", "--checkpoint", "ckpt", "--merged", "afile"): "afile is a file",
        ("verify", "--base", "base", "--checkpoint", "ckpt", "--merged", ""): "is empty",
        ("export-adapter", "--base", "base", "--checkpoint", "nowhere", "--out", "a"): "nowhere does not exist",
        ("export-adapter", "--base", "base", "--checkpoint", "ckpt", "--out", "afile"): "afile exists and is not",
        ("parity", "nowhere"): "nowhere does not exist",
        ("parity", "afile"): "afile is a file",
        ("parity", ""): "is empty",
        ("tiny-model", "afile"): "afile is a file, not a directory",
        ("tiny-model", ""): "is empty",
        ("eval", "--completions", "nowhere.jsonl"): "nowhere.jsonl",
        ("eval", "--completions", "base"): "base",
        ("eval", "--completions", ""): "is empty",
        ("serve", "--model", "nowhere", "--smoke-test"): "nowhere does not exist",
        ("serve", "--model", "afile", "--smoke-test"): "afile is a file",
        ("serve", "--model", "", "--smoke-test"): "is empty",
        ("train", "--profile", "smoke", "--run-dir", "afile"): "afile is a file",
        ("data-stats", "--profile", "smoke", "--base", "afile"): "afile",
        ("report", "--profile", "smoke", "--runs", "afile"): "afile is a file",
        ("site", "--profile", "smoke", "--runs", "afile", "--no-screenshot"): "afile is a file",
        ("eval", "--completions", "answers.jsonl", "--out", "afile"): "afile exists",
    }
    for argv, needle in cases.items():
        line = cli_error(capsys, *argv)
        assert needle in line, (argv, line)
    assert Path("afile").read_text() == "x" and not Path("o").exists() and not Path("a").exists()


def test_damaged_safetensors_name_the_file(work, tmp_path, monkeypatch, capsys):
    """A truncated shard, a shard that is not safetensors, and an index its shards do not match: one line naming
    the file, with the fix, for the base (merge, parity, verify) and the merged model (verify, serve)."""
    d, _ = work
    monkeypatch.chdir(tmp_path)
    shutil.copytree(d / "runs/smoke/checkpoints", "ckpt")
    shutil.copytree(d / "runs/smoke/merged", "merged")

    def damaged(kind: str, src: Path, name: str) -> Path:
        out = Path(name)
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(src, out)
        shard = sorted(out.glob("*.safetensors"))[0]
        if kind == "truncated":
            shard.write_bytes(shard.read_bytes()[:1000])
        elif kind == "foreign":
            shard.write_text("<html>404 Not Found</html>\n")
        else:  # the index names a tensor the shard does not hold
            index = json.loads((out / "model.safetensors.index.json").read_text())
            key = next(k for k, v in index["weight_map"].items() if v == shard.name)
            index["weight_map"][key + ".renamed"] = index["weight_map"].pop(key)
            (out / "model.safetensors.index.json").write_text(json.dumps(index))
        return shard

    expect = {"truncated": "is truncated", "foreign": "is not a safetensors file", "index": "does not hold it"}
    for kind, needle in expect.items():
        shard = damaged(kind, d / "runs/smoke/base", "base")
        fix = "rebuild it" if (Path("base") / "tiny_model.json").is_file() else "download it again"
        for argv in (("merge", "--base", "base", "--checkpoint", "ckpt", "--out", "o"), ("parity", "base"),
                     ("verify", "--base", "base", "--checkpoint", "ckpt", "--merged", "merged")):
            line = cli_error(capsys, *argv)
            assert (needle in line and (shard.name in line or "index" in line)
                    and fix in line.lower()), (kind, argv, line)
        shutil.rmtree("base")
        shutil.copytree(d / "runs/smoke/base", "base")
        shard = damaged(kind, d / "runs/smoke/merged", "bad_merged")
        for argv in (("verify", "--base", "base", "--checkpoint", "ckpt", "--merged", "bad_merged"),
                     ("serve", "--model", "bad_merged", "--smoke-test")):
            line = cli_error(capsys, *argv)
            assert (needle in line and "merge again" in line
                    and str(Path("bad_merged").resolve()) in line), (kind, argv, line)
    assert not Path("o").exists()


def test_relative_checkpoint_restores_as_the_absolute_one(work, monkeypatch):
    """The root of the README bug: Orbax given a relative path failed inside, and the message blamed the data."""
    from gemma_tpu_helpers.fixes.train import lora_checkpoint

    d, _ = work
    step, absolute = lora_checkpoint.restore_lora(d / "runs/smoke/checkpoints")
    monkeypatch.chdir(d)
    step2, relative = lora_checkpoint.restore_lora("runs/smoke/checkpoints")
    assert step == step2 and absolute.keys() == relative.keys()
    assert all((absolute[k] == relative[k]).all() for k in absolute)
