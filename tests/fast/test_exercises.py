"""Every exercise accepts its solution, rejects its typical wrong answers (without showing the solution), and
says "not attempted" to an empty answer; the notebooks carry one cell per exercise."""

import inspect
import json
from collections import Counter

import numpy as np
import pytest

from gemma_tpu_helpers.course import exercises
from support import REPO, run_cli

KEYS = list(exercises.EXERCISES)
NOTEBOOKS = {p.stem[:2]: p for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")}


def test_one_to_three_exercises_in_each_notebook_01_to_10():
    counts = Counter(exercises.EXERCISES[k].notebook for k in KEYS)
    assert sorted(counts) == [f"{i:02d}" for i in range(1, 11)]
    assert all(1 <= n <= 3 for n in counts.values()), counts


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

    from gemma_tpu_helpers.course import tiny
    from gemma_tpu_helpers.fixes import lora, sharding

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
    from gemma_tpu_helpers.fixes import data

    tok = tokenizer
    for chat in exercises._MASK_CHATS:
        ids, mask = data.tokenize_example(tok, chat)
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
    nb = json.loads(NOTEBOOKS[exercises.EXERCISES[key].notebook].read_text())
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    mine = [c for c in cells if f'exercises.check("{key}", answer)' in c]
    assert len(mine) == 1, f"{key}: expected one `exercises.check(\"{key}\", answer)` cell"
    assert "answer = None  # your answer" in mine[0]
