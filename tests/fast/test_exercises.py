"""Every exercise accepts its solution, rejects its typical wrong answers (without showing the solution), and
says "not attempted" to an empty answer; the notebooks carry one cell per exercise; the texts in
gemma_tpu_helpers/data/exercises.toml and the code in exercises.py name the same exercises."""

import copy
import fnmatch
import inspect
import json
import tomllib
from collections import Counter

import numpy as np
import pytest

from gemma_tpu_helpers.course.front import exercises
from support import REPO, run_cli

KEYS = list(exercises.EXERCISES)
NOTEBOOKS = {p.stem[:2]: p for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")}


def test_one_to_three_exercises_in_each_notebook_01_to_10():
    counts = Counter(exercises.EXERCISES[k].notebook for k in KEYS)
    assert sorted(counts) == [f"{i:02d}" for i in range(1, 11)]
    assert all(1 <= n <= 3 for n in counts.values()), counts


def _texts() -> dict:
    return tomllib.loads(exercises.TEXTS_FILE.read_text(encoding="utf-8"))


def test_the_texts_file_and_the_code_agree():
    """Each exercise in the code has its texts in the data file and each entry there has its exercise: no text
    without code, no code without text, no required text missing, every $name filled."""
    texts = _texts()
    assert exercises.text_problems(texts) == []
    assert list(texts) == KEYS, "the data file lists the exercises in the course's order"


SEEDED = {  # a disagreement seeded into a copy of the data file -> what text_problems must say
    "an entry with no exercise": (lambda t: t.update({"99.extra": dict(t["01.tp"])}), "99.extra has texts but no"),
    "an exercise with no entry": (lambda t: t.pop("05.use"), "05.use is an exercise in exercises.py with no texts"),
    "a missing title": (lambda t: t["02.regex"].pop("title"), "02.regex has no title"),
    "a missing hint": (lambda t: t["10.ratio"].pop("hint"), "10.ratio has no hint"),
    "a misspelt field": (lambda t: t["08.flags"].update(rigth_note="x"), "08.flags.rigth_note is not a text field"),
    "a text that is not a string": (lambda t: t["01.tp"].update(answer_hint=4), "01.tp.answer_hint is not a string"),
    "a $name the code does not fill": (lambda t: t["01.tp"].update(hint="$tp"), "01.tp shows $tp, which its code"),
    "a fill no text shows": (lambda t: t["09.pass"].update(task="pass@k?"), "09.pass's code fills $c, which none"),
    "a stray $": (lambda t: t["10.per_million"].update(hint="in $ per hour"), "10.per_million.hint has a $ that"),
}


@pytest.mark.parametrize("seed", SEEDED)
def test_a_disagreement_between_the_texts_and_the_code_is_named(seed):
    change, says = SEEDED[seed]
    texts = copy.deepcopy(_texts())
    change(texts)
    problems = exercises.text_problems(texts)
    assert [p for p in problems if p.startswith(says)], problems
    with pytest.raises(exercises.ExerciseError, match="disagrees with exercises.py"):
        exercises.build_exercises(texts)


def test_the_texts_file_ships_with_the_package():
    """pyproject's package data installs data/exercises.toml, the file exercises.py reads."""
    package = REPO / "gemma_tpu_helpers"
    shipped = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    name = exercises.TEXTS_FILE.relative_to(package).as_posix()
    assert name == "data/exercises.toml"
    assert [p for p in shipped["gemma_tpu_helpers"] if fnmatch.fnmatch(name, p)], shipped


@pytest.mark.parametrize("key", KEYS)
def test_the_solution_is_right(key):
    fb = exercises.check(key, exercises.solution(key))
    assert fb.ok, fb


def _solution_text(sol) -> list[str]:
    """Fragments of the solution that feedback must never contain."""
    if callable(sol):
        body = inspect.getsource(sol).splitlines()[1:]
        return [line.strip() for line in body if len(line.strip()) > 20 and not line.strip().startswith(('"""', "#"))]
    if isinstance(sol, str) and len(sol) > 3:
        return [sol]
    if isinstance(sol, (dict, list, tuple)):
        return [repr(sol)]
    return []


@pytest.mark.parametrize("key", KEYS)
def test_typical_wrong_answers_are_rejected_with_why_and_hint_but_no_solution(key):
    ex = exercises.EXERCISES[key]
    assert ex.wrong, f"{key} needs at least one typical wrong answer"
    secret = _solution_text(exercises.solution(key))
    for answer in ex.wrong:
        fb = exercises.check(key, answer)
        assert fb.status == exercises.WRONG, (answer, fb)
        assert fb.why and fb.hint
        shown = str(fb) + fb._repr_markdown_()
        assert not [s for s in secret if s in shown], (key, shown)


@pytest.mark.parametrize("key", KEYS)
def test_an_empty_answer_is_not_attempted(key):
    fb = exercises.check(key, None)
    assert fb.status == exercises.NOT_ATTEMPTED and not fb.ok
    assert "answer = None" in fb.why and "not attempted" in str(fb).lower()


def test_bad_answers_are_wrong_answers_not_errors():
    assert "ZeroDivisionError" in exercises.check("05.mask", lambda pieces: 1 / 0).why
    assert "cannot compile" in exercises.check("02.regex", "(").why
    assert exercises.check("01.tp", "four").status == exercises.WRONG
    assert "missing key" in exercises.check("08.flags", {"tensor_parallel_size": 4}).why
    assert exercises.check("07.delta_q", lambda a, b, s: np.zeros(3)).status == exercises.WRONG


def test_an_unknown_exercise_lists_the_known_ones():
    with pytest.raises(KeyError, match="02.regex"):
        exercises.check("02.regexp", "x")


def test_the_regex_checker_knows_tunix_s_real_module_paths(smoke):
    """The paths the 02.regex checker judges against exist in a real tunix Gemma 4 (built from shapes), and the
    solution gives LoRA to every projection in it through qwix itself."""
    from flax import nnx

    from gemma_tpu_helpers.course.config import tiny
    from gemma_tpu_helpers.fixes.model import sharding
    from gemma_tpu_helpers.fixes.train import lora

    cfg = tiny.tiny_text_config()
    model = sharding.model_from_config(cfg, abstract=True)
    real = {"/".join(map(str, p)) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Module)}
    targets, others = exercises.module_paths(cfg)
    assert set(targets) <= real and set(others) <= real
    assert "layers/5/attn/k_einsum" in targets
    report = lora.coverage_of_regex(model, exercises.solution("02.regex"), rank=smoke.lora.rank)
    present = report[report["module"] != "(none)"]
    assert present["has LoRA"].all() and not report.attrs["unused_rules"]


def test_the_mask_exercise_means_what_data_tokenize_example_does(tokenizer):
    """Both train on the last answer and its closing end-of-turn token, and on nothing else."""
    from gemma_tpu_helpers.fixes.train import chat_tokens

    tok = tokenizer
    for chat in exercises._MASK_CHATS:
        ids, mask = chat_tokens.tokenize_example(tok, chat)
        trained = ids[mask == 1].tolist()
        assert mask[-len(trained):].all(), "the trained tokens are the tail of the sequence"
        eot = tok.convert_ids_to_tokens(trained[-1])
        assert tok.decode(trained[:-1]).strip() == chat[-1]["content"]
        pieces = exercises.gemma4_pieces(chat)
        ours = [p for p, m in zip(pieces, exercises.solution("05.mask")(pieces)) if m]
        assert "".join(ours) == chat[-1]["content"] + exercises.EOT
        assert eot in (exercises.EOT, "<end_of_turn>")


def test_solutions_command_prints_tasks_and_solutions():
    r = run_cli("solutions", "02")
    assert r.returncode == 0, r.stderr
    assert "02.regex" in r.stdout and "02.module" in r.stdout and "01.tp" not in r.stdout
    assert exercises.solution("02.regex") in r.stdout
    assert "def solution_05_mask" in run_cli("solutions", "5").stdout
    bad = run_cli("solutions", "11")
    assert bad.returncode == 2 and "notebooks with exercises" in bad.stderr


@pytest.mark.parametrize("key", KEYS)
def test_each_exercise_has_its_cell_in_its_notebook(key):
    """One check cell per exercise, after a markdown cell that shows the exercise's title and task as the data file
    has them (a notebook reads without running, so it carries a copy: this keeps the copy equal)."""
    ex = exercises.EXERCISES[key]
    cells = json.loads(NOTEBOOKS[ex.notebook].read_text())["cells"]
    mine = [i for i, c in enumerate(cells)
            if c["cell_type"] == "code" and f'exercises.check("{key}", answer)' in "".join(c["source"])]
    assert len(mine) == 1, f"{key}: expected one `exercises.check(\"{key}\", answer)` cell"
    assert f"answer = None  # your answer: {ex.answer_hint}" in "".join(cells[mine[0]]["source"])
    assert "".join(cells[mine[0] - 1]["source"]) == f"### Your turn: {ex.title}\n{ex.task}"
