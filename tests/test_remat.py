"""Remat policies on the tiny Gemma 4: the LoRA-before-remat trap, LoRA still trains with remat on, the policy
really is in the compiled step, and the decoder loop computes what the model computes."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma_tpu_helpers import gemma4, remat

RANK, ALPHA = 8, 16.0


@pytest.fixture(scope="module")
def lora_model(tiny_dir, mesh):
    """A fresh LoRA model of the tiny checkpoint (its own config object: tests switch its remat)."""
    return remat.lora_then_remat(gemma4.load_model(tiny_dir, mesh), RANK, ALPHA, "none")


def tokens(batch=2, seq=32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(3, 512, (batch, seq)), jnp.int32)


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(remat.UnknownPolicyError, match="Valid policies: none, block, decoder, dots, dots_no_batch"):
        remat.check_policy("selective")


def test_the_trap_remat_before_lora_gives_no_lora_params(tiny_dir, mesh):
    model = gemma4.load_model(tiny_dir, mesh, remat="block")
    wrong = remat._apply_lora(model, RANK, ALPHA)  # raw qwix, no guard: the paper-era order
    assert remat.count_lora_params(wrong) == 0
    with pytest.raises(remat.RematOrderError, match="already BLOCK.*no LoRA params.*apply LoRA, then set remat"):
        remat.lora_then_remat(model, RANK, ALPHA, "block")
    with pytest.raises(remat.RematOrderError, match="Apply LoRA first"):
        remat.set_remat(wrong, "decoder")


def test_right_order_keeps_lora_and_sets_remat(lora_model):
    n = remat.count_lora_params(lora_model)
    # rank 8 over q, kv/k, o, gate, up, down on 6 layers of the tiny config (plan.lora_param_count agrees)
    from gemma_tpu_helpers import plan, tiny

    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert n == plan.lora_param_count(tiny.tiny_text_config(6), RANK, targets) > 0
    remat.set_remat(lora_model, "decoder")
    assert remat.remat_config_of(lora_model) == "decoder"
    assert all(layer.config.remat_config.name == "DECODER" for layer in lora_model.layers)  # every module sees it
    remat.set_remat(lora_model, "dots")  # jax-kind policies leave tunix's switch off
    assert remat.remat_config_of(lora_model) == "none"


@pytest.mark.parametrize("policy,regions", [("none", 0), ("block", 12), ("decoder", 6), ("dots_no_batch", 6)])
def test_the_policy_is_in_the_train_step(lora_model, policy, regions):
    """Rematerialised regions in the step's jaxpr: BLOCK wraps attention and MLP of each of the 6 layers, DECODER
    and the nnx.remat policies wrap each layer once."""
    step = remat.make_train_step(lora_model, policy, RANK, ALPHA, donate=False)
    assert remat.count_remat_regions(step, *step.init(), tokens()) == regions
    remat.set_remat(lora_model, "none")


@pytest.mark.parametrize("policy", ["block"])  # the nnx.remat policies train in test_compare_policies_table
def test_lora_trains_with_remat_on(lora_model, policy):
    step = remat.make_train_step(lora_model, policy, RANK, ALPHA, learning_rate=3e-3, donate=False)
    lora, opt, frozen = step.init()
    b0 = [np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(lora) if "lora_b" in jax.tree_util.keystr(p)]
    assert b0 and all(not b.any() for b in b0)  # LoRA B starts at zero
    batch = tokens(seq=16)
    losses = []
    for _ in range(4):
        lora, opt, loss = step(lora, opt, frozen, batch)
        losses.append(float(loss))
    remat.set_remat(lora_model, "none")
    b1 = [np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(lora) if "lora_b" in jax.tree_util.keystr(p)]
    assert sum(int(b.any()) for b in b1) == len(b1), "every LoRA B must have moved"
    assert losses[-1] < losses[0] - 1e-3, losses


def test_decoder_loop_computes_the_model(lora_model):
    """With non-zero LoRA weights, the loop (any policy) gives the model's own logits: LoRA is active in it."""
    from flax import nnx

    model = nnx.clone(lora_model)
    for i, (_, v) in enumerate(nnx.iter_graph(model)):
        if isinstance(v, nnx.LoRAParam):
            v[...] = v[...] + 0.02 * jax.random.normal(jax.random.key(i), v.shape, v.dtype)
    t = tokens(seq=24)
    positions, mask = remat.causal_inputs(t)
    ref = np.asarray(model(t, positions, None, mask)[0])
    base = np.asarray(lora_model(t, positions, None, mask)[0])
    assert np.abs(ref - base).max() > 1e-2  # the perturbed LoRA changes the logits
    for policy in ("none", "dots"):
        loop = remat.decoder_loop(model, policy, RANK, ALPHA)
        out = np.asarray(nnx.jit(lambda m, t: m(t))(loop, t))
        np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)  # jit vs eager fp32 rounding: 3e-5


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_compare_policies_table_with_tpu_columns(tiny_dir, mesh):
    """The CPU steps and the v5p-8 AOT compiles (a background thread) of one tunix and one jax.checkpoint policy.

    Notebook 04 compiles the TPU columns only with GEMMA_TPU_AOT=1, so this is where CI runs that path."""
    df = remat.compare_policies(tiny_dir, mesh, policies=("decoder", "dots_no_batch"), seq_len=16, steps=1,
                                tpu_profile="v5p-8", tpu_seq_len=512)
    assert list(df.policy) == ["decoder", "dots_no_batch"] and list(df.how) == ["tunix", "jax"]
    assert (df["step ms"] > 0).all() and (df["CPU temp MiB"] > 0).all()
    # same math under every policy: same first loss, and it trains
    assert abs(df["first loss"].iloc[0] - df["first loss"].iloc[1]) < 1e-4
    assert (df["last loss"] < df["first loss"]).all()
    # each policy got its own TPU compile: DECODER keeps only layer inputs, dots_no_batch keeps every weight matmul
    # (measured: 21.1 vs 37.6 MiB per chip at seq 512, batch 2)
    assert df.attrs["tpu_profile"] == "v5p-8" and (df["TPU compile s"] > 0).all()
    assert df["TPU temp MiB"].iloc[0] < 0.8 * df["TPU temp MiB"].iloc[1]
    fig = remat.plot_policies(df)
    assert len(fig.axes) == 2 and "v5p-8" in fig.axes[0].get_ylabel()
