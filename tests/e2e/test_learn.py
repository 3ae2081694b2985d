"""The learning check (issue 27): a fine-tune that visibly works, and fails when a link of the chain breaks.

- The README's command, as a user types it, from another directory with a relative run directory: train on the
  profile's 4 problems, merge, serve the merged model with vLLM, score. Before 0, after at least 0.75; the held-out
  problems stay at 0 (memorisation, not generalisation).
- Each broken link scores lower than the working chain: the Gemma 3 template trained and Gemma 4's served (the
  paper's trap), the loss mask on the prompt, a merge that drops the LoRA, the base model served. They answer with
  transformers in-process (no server start); the working chain's merged model gives the same answers there as
  through vLLM, which one test checks.
"""

import dataclasses
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from gemma_tpu_helpers.course.config import paths, profiles
from gemma_tpu_helpers.course.training import learning_check
from gemma_tpu_helpers.fixes.eval import eval_problems
from gemma_tpu_helpers.fixes.model.chat_format import GEMMA3_TURN_TOKENS
from gemma_tpu_helpers.fixes.train import chat_tokens, data
from support import run_cli

SMOKE = profiles.get_profile("smoke")
LINE = re.compile(r"^pass@1 before (\d\.\d\d) after (\d\.\d\d) \((\d+) trained problems; (\d+) held out: before "
                  r"(\d\.\d\d) after (\d\.\d\d)\)$", re.M)


@pytest.fixture(scope="module")
def working(tmp_path_factory):
    """The README's `learn --profile smoke`, run from an empty directory with GEMMA_TPU_RUNS=runs (relative).
    Returns (stdout, the LearnResult it wrote, its run directory).

    `make test` names that directory (GEMMA_TPU_TEST_LEARNER, a fresh temporary one) and then runs the notebooks
    on its runs/: notebooks 06 and 09 read this check back (same settings) instead of training and serving it again
    (test_equivalence leaves notebook 06's parity run there too, on the other worker)."""
    shared = os.environ.get("GEMMA_TPU_TEST_LEARNER")
    d = Path(shared) if shared else tmp_path_factory.mktemp("learner")
    assert not (d / "runs" / "smoke" / "learn").exists(), f"GEMMA_TPU_TEST_LEARNER={d} holds a learning check already"
    r = run_cli("learn", "--profile", "smoke", cwd=d, env={"GEMMA_TPU_RUNS": "runs"}, timeout=1500)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-5000:])
    run_dir = d / "runs" / "smoke"
    result = learning_check.LearnResult.from_json(
        json.loads((learning_check.learn_dir(SMOKE, run_dir) / learning_check.RESULT).read_text()))
    return r.stdout, result, run_dir


def test_learn_command_takes_pass_at_1_from_0_to_at_least_075(working):
    out, result, _ = working
    m = LINE.search(out)
    assert m and out.rstrip().endswith(m.group(0)), out[-2000:]
    before, after, k, held, held_before, held_after = m.groups()
    assert (float(before), int(k), int(held)) == (0.0, SMOKE.learn.tasks, SMOKE.learn.held_out), out[-2000:]
    assert float(after) >= 0.75, out[-3000:]
    # memorisation: the problems never trained on stay where the base model is
    assert float(held_before) == 0.0 and float(held_after) == 0.0, out[-3000:]
    assert result.tasks == learning_check.default_tasks(SMOKE.learn.tasks, SMOKE.learn.held_out)[0]
    assert result.losses[-1] < 0.25 * result.losses[0], result.losses
    assert result.pass_at_1("after") == float(after) and result.generator == "vllm"


def test_vllm_and_transformers_answer_alike_on_the_trained_model(working):
    """The broken variants below answer with transformers: on the working chain's merged model it scores each
    problem as vLLM's answers did, so a lower score there is the broken link, not the generator."""
    _, result, run_dir = working
    problems = eval_problems.load_problems(paths.SHIPPED_EVAL, tasks=result.tasks + result.held_out)
    rows = learning_check.transformers_answers(learning_check.learn_dir(SMOKE, run_dir) / "merged", problems,
                                               SMOKE.learn.max_tokens)
    scored = learning_check.score(problems, rows)
    assert dict(zip(scored["task_id"], scored["category"])) == dict(zip(result.after["task_id"],
                                                                         result.after["category"]))


@pytest.mark.parametrize("broken", list(learning_check.BROKEN))
def test_each_broken_link_scores_lower(working, broken, tmp_path):
    """Each broken link, with half the steps: a break shows as no answer passing, which needs no full training (the
    working chain passes 3 of 4 or more with 20 steps already)."""
    _, good, run_dir = working
    half = dataclasses.replace(SMOKE, learn=dataclasses.replace(SMOKE.learn, steps=SMOKE.learn.steps // 2))
    res = learning_check.learn(half, tasks=good.tasks, held_out=[], run_dir=tmp_path, broken=broken,
                      generator="transformers", before=good.before, progress=False, log=lambda *_: None)
    assert res.pass_at_1("after") < good.pass_at_1("after"), (broken, res.table(), good.table())
    assert (tmp_path / "base" / "config.json").is_file()  # the base in the run directory given, not in runs/
    if broken in ("gemma3-template", "prompt-mask"):  # it trained, and the loss fell: the link, not the training
        assert res.losses[-1] < 0.5 * res.losses[0], (broken, res.losses)


def test_the_gemma3_variant_is_what_the_mask_check_refuses(tokenizer):
    """The paper's trap, built by hand because the pipeline refuses it: Gemma 3's template on Gemma 4's tokenizer."""
    tok = tokenizer
    problem = eval_problems.load_problems(paths.SHIPPED_EVAL, tasks=[learning_check.default_tasks(1, 0)[0][0]])[0]
    ids, mask = learning_check.example(tok, problem, broken="gemma3-template")
    text = tok.decode(ids)
    assert all(t in text for t in GEMMA3_TURN_TOKENS) and "<|turn>" not in text
    assert tok.decode(ids[mask == 1]).startswith("```verilog\n")
    from gemma_tpu_helpers.fixes.model.chat_format import GEMMA3_CHAT_TEMPLATE

    with pytest.raises(data.DataError, match="end-of-turn"):
        chat_tokens.tokenize_example(tok, eval_problems.prompt_messages(problem) + [{"role": "assistant",
                                                                                      "content": "x"}],
                                     chat_template=GEMMA3_CHAT_TEMPLATE)
    good_ids, good_mask = learning_check.example(tok, problem)
    flipped_ids, flipped = learning_check.example(tok, problem, broken="prompt-mask")
    assert np.array_equal(good_ids, flipped_ids) and np.array_equal(flipped, 1 - good_mask)
    assert tok.decode(good_ids[good_mask == 1]) == learning_check.answer(problem) + "<turn|>"


def test_rows_fill_the_fsdp_axis_and_each_step_sees_every_problem(tokenizer):
    tok = tokenizer
    problems = eval_problems.load_problems(paths.SHIPPED_EVAL, tasks=learning_check.default_tasks(5, 0)[0])
    prepared, rows, seq = learning_check.training_rows(tok, problems, fsdp=4)
    assert (rows, len(prepared.train), seq % 64) == (8, 8, 0)  # 5 problems -> 8 rows: the fsdp axis splits them
    firsts = {tuple(r[:seq]) for r in prepared.train.tokens}
    assert len(firsts) == 5
    prof = learning_check.learn_profile(SMOKE, rows, seq)
    assert (prof.train.micro_batch, prof.train.grad_accum, prof.train.max_steps) == (8, 1, SMOKE.learn.steps)
    assert (prof.lora.rank, prof.train.learning_rate) == (SMOKE.learn.rank, SMOKE.learn.learning_rate)


def test_bad_requests_get_one_line(tmp_path):
    for args, needle in ((["--tasks", "Prob999_nothing"], "Unknown task id"),
                         (["--tasks", "Prob001_majority3", "--held-out", "Prob001_majority3"], "both trained on"),
                         (["--profile", "v5p-8"], "no learning check")):
        r = run_cli("learn", *args, cwd=tmp_path, env={"GEMMA_TPU_RUNS": "runs"}, timeout=300)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], (args, r.stderr[-2000:])
