"""The helpers' train loop against a bare tunix loop: the same losses, and a step-time ratio to report."""

import math

import pytest

from gemma_tpu_helpers.course import helper_overhead
from support import short_rows


def test_bare_tunix_loop_computes_what_the_helpers_compute(smoke, tiny_dir, tmp_path):
    # both loops get the same rows, of any length: 256 tokens, not 512
    table = helper_overhead.compare(short_rows(smoke), tiny_dir, tmp_path / "run", steps=3)
    assert list(table["step"]) == [1, 2, 3]
    # Same model, LoRA init, batches, loss and optimizer: if either loop trained something else, this fails.
    assert table.attrs["max_loss_diff"] < 1e-5, table
    assert table["helpers loss"].iloc[-1] != table["helpers loss"].iloc[0]  # it did train
    assert (table["bare tunix step s"] > 0).all() and (table["helpers step s"].dropna() > 0).all()
    assert list(table["helpers step s"].notna()) == [False, True, False]  # timed: not the compile, not the last
    assert math.isfinite(table.attrs["ratio"]) and table.attrs["ratio"] > 0
    print(f"\nstep time helpers {table.attrs['helpers_step_s']:.2f} s, bare tunix {table.attrs['bare_step_s']:.2f} s, "
          f"ratio {table.attrs['ratio']:.3f}")


def test_compare_refuses_a_used_run_dir_and_too_few_steps(smoke, tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="steps must be at least 2"):
        helper_overhead.compare(smoke, tiny_dir, tmp_path / "a", steps=1)
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="already holds a run"):
        helper_overhead.compare(smoke, tiny_dir, tmp_path / "b", steps=3)
