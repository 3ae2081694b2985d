"""Remat policies measured: the CPU steps and the v5p-8 AOT compiles of the train step under two policies (about
100 s). The policy rules and the trap: tests/fast/test_remat.py."""

import importlib.util

import pytest


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_compare_policies_table_with_tpu_columns(smoke, tiny_dir, mesh):
    """The CPU steps and the v5p-8 AOT compiles (a background thread) of the train step under two policies.

    Notebook 04 compiles the TPU columns only with GEMMA_TPU_AOT=1, so this is where CI runs that path."""
    from gemma_tpu_helpers.course import plan

    df = plan.compare_policies(smoke, tiny_dir, mesh, policies=("none", "decoder"), seq_len=16, steps=1,
                               tpu_profile="v5p-8", tpu_seq_len=512)
    assert list(df.policy) == ["none", "decoder"]
    assert (df["step ms"] > 0).all() and (df["CPU temp MiB"] > 0).all()
    # same math under every policy: same first loss, and it trains
    assert abs(df["first loss"].iloc[0] - df["first loss"].iloc[1]) < 1e-4
    assert (df["last loss"] < df["first loss"]).all()
    # each policy got its own TPU compile: DECODER keeps only each layer's input
    assert df.attrs["tpu_profile"] == "v5p-8" and (df["TPU compile s"] > 0).all()
    print(df.round(2).to_string())
    assert df["TPU temp MiB"].iloc[1] < 0.8 * df["TPU temp MiB"].iloc[0]
    fig = plan.plot_policies(df)
    assert len(fig.axes) == 2 and "v5p-8" in fig.axes[0].get_ylabel()
