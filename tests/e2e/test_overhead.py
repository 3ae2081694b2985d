"""The step time the course records, and what the helpers add to it: one run through the helpers (train.train, an
evaluation every 2 steps) against a bare tunix loop on the same rows (tunix's PeftTrainer, raw qwix LoRA, no
evaluation, checkpoint or metrics file), 5 steps each.

Notebook 06, the report and `make bench` read the same figure: the median of the metrics' ``step_s``, which
``train.clean_step`` leaves empty for a step with an evaluation, a save or a compile in its time (its rules alone:
tests/fast/test_step.py).
"""

import dataclasses
import math

import pytest

from gemma_tpu_helpers.course.training import helper_overhead, train
from support import short_rows

STEPS = 5


@pytest.fixture(scope="module")
def compared(smoke, tiny_dir, tmp_path_factory):
    """(the per-step table of both loops, the helpers' own metrics). Rows of 256 tokens, not 512: the subject is which
    steps are timed and what the loops compute, not the rows' length."""
    profile = short_rows(smoke)
    profile = dataclasses.replace(profile, train=dataclasses.replace(profile.train, eval_every=2,
                                                                      checkpoint_every=1000))
    run_dir = tmp_path_factory.mktemp("overhead") / "run"
    table = helper_overhead.compare(profile, tiny_dir, run_dir, steps=STEPS)
    return table, train.read_metrics(run_dir).dropna(subset=["loss"]).set_index("step")


def test_bare_tunix_loop_computes_what_the_helpers_compute(compared):
    table, _ = compared
    assert list(table["step"]) == list(range(1, STEPS + 1))
    # Same model, LoRA init, batches, loss and optimizer: if either loop trained something else, this fails. The
    # helpers evaluated after steps 2 and 4 and the bare loop never did: evaluating changes no update either.
    assert table.attrs["max_loss_diff"] < 1e-5, table
    assert table["helpers loss"].iloc[-1] != table["helpers loss"].iloc[0]  # it did train
    assert (table["bare tunix step s"] > 0).all() and (table["helpers step s"].dropna() > 0).all()
    assert math.isfinite(table.attrs["ratio"]) and table.attrs["ratio"] > 0
    print(f"\nstep time helpers {table.attrs['helpers_step_s']:.2f} s, bare tunix {table.attrs['bare_step_s']:.2f} s, "
          f"ratio {table.attrs['ratio']:.3f}")


def test_a_run_with_evaluations_reports_the_step_time_of_one_without(compared):
    table, metrics = compared
    # which steps are timed: not the first (compile), not the last (the final save), not those with an evaluation
    assert list(metrics.index[metrics["step_s"].notna()]) == [3]
    assert list(table["helpers step s"].notna()) == [False, False, True, False, False]
    assert (metrics["wall_s"] > 0).all() and metrics.loc[3, "step_s"] == metrics.loc[3, "wall_s"]
    evals = float(metrics.loc[[2, 4], "wall_s"].median())
    a, b = table.attrs["helpers_step_s"], table.attrs["bare_step_s"]
    print(f"\nmedian step: {a:.2f} s with evaluations every 2 steps, {b:.2f} s in the bare loop (none); the steps "
          f"with an evaluation took {evals:.2f} s")
    # The figure is the one step without a compile, evaluation or save in its time: step 3's, exactly. Before
    # clean_step, a step with an evaluation counted its time (notebook 06's smoke run: 8.8 s against 3.3 s); the
    # ratio to the bare loop is printed, not asserted (a timed bound failed at 0.49 on a loaded 2-core CI run).
    assert a == metrics.loc[3, "step_s"] == table["helpers step s"].iloc[2], (a, metrics["step_s"])


def test_compare_refuses_a_used_run_dir_and_too_few_steps(smoke, tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="steps must be at least 2"):
        helper_overhead.compare(smoke, tiny_dir, tmp_path / "a", steps=1)
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="already holds a run"):
        helper_overhead.compare(smoke, tiny_dir, tmp_path / "b", steps=3)
