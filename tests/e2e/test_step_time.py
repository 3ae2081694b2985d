"""The step time the course records is the step's own: evaluations, checkpoint saves and the compile are not in it.

Notebook 06, the report and `make bench` read the same figure: the median of the metrics' ``step_s``, which
``train.clean_step`` leaves empty for a step with an evaluation, a save or a compile in its time.
"""

import dataclasses

import numpy as np

from gemma_tpu_helpers.course import train
from support import short_rows

STEPS = 5


def _run(smoke, tiny_dir, run_dir, eval_every):
    smoke = short_rows(smoke)  # the subject is which steps are timed, not the rows' length
    profile = dataclasses.replace(smoke, train=dataclasses.replace(smoke.train, eval_every=eval_every,
                                                                   checkpoint_every=1000))
    return train.train(profile, run_dir=run_dir, base_dir=tiny_dir, max_steps=STEPS,
                       progress=False).metrics.dropna(subset=["loss"]).set_index("step")


def test_a_run_with_evaluations_reports_the_step_time_of_one_without(smoke, tiny_dir, tmp_path):
    with_eval = _run(smoke, tiny_dir, tmp_path / "eval", eval_every=2)
    without = _run(smoke, tiny_dir, tmp_path / "plain", eval_every=1000)
    # which steps are timed: not the first (compile), not the last (the final save), not those with an evaluation
    assert list(with_eval.index[with_eval["step_s"].notna()]) == [3]
    assert list(without.index[without["step_s"].notna()]) == [2, 3, 4]
    assert (with_eval["wall_s"] > 0).all()
    assert with_eval.loc[3, "step_s"] == with_eval.loc[3, "wall_s"]
    a, b = float(with_eval["step_s"].median()), float(without["step_s"].median())
    evals = float(with_eval.loc[[2, 4], "wall_s"].median())
    print(f"\nmedian step: {a:.2f} s with evaluations every 2 steps, {b:.2f} s without; the steps with an "
          f"evaluation took {evals:.2f} s")
    # Same program, same batches: the figure may differ by the machine's noise only. Before clean_step, a step with
    # an evaluation counted its time (notebook 06's smoke run: 8.8 s against 3.3 s for a clean step).
    assert 0.5 < a / b < 2, (a, b)
    assert np.allclose(with_eval["loss"], without["loss"], atol=1e-5)  # evaluating changes no update
