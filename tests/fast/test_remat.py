"""Remat policies on the tiny Gemma 4: the LoRA-before-remat trap, and the policy really is in the train step
(test_step.py trains under BLOCK remat)."""


import pytest

from gemma_tpu_helpers.fixes.model import gemma4
from gemma_tpu_helpers.fixes.train import lora, remat

RANK, ALPHA = 8, 16.0


@pytest.fixture(scope="module")
def lora_model(tiny_dir, mesh):
    """A fresh LoRA model of the tiny checkpoint (its own config object: tests switch its remat)."""
    return remat.lora_then_remat(gemma4.load_model(tiny_dir, mesh), RANK, ALPHA, "none")


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(remat.UnknownPolicyError, match="Valid policies: none, block, decoder.$"):
        remat.check_policy("selective")


def test_the_trap_remat_before_lora_gives_no_lora_params(tiny_dir, mesh):
    import qwix
    from flax import nnx

    model = gemma4.load_model(tiny_dir, mesh, remat="block")
    wrong = qwix.apply_lora_to_model(model, lora.make_provider(lora.HF_TARGETS, rank=RANK, alpha=ALPHA),  # no guard
                                     rngs=nnx.Rngs(0), **model.get_model_input())  # the paper-era order
    assert remat.count_lora_params(wrong) == 0
    with pytest.raises(remat.RematOrderError, match="already BLOCK.*no LoRA params.*apply LoRA, then set remat"):
        remat.lora_then_remat(model, RANK, ALPHA, "block")
    with pytest.raises(remat.RematOrderError, match="Apply LoRA first"):
        remat.set_remat(wrong, "decoder")


def test_right_order_keeps_lora_and_sets_remat(lora_model):
    n = remat.count_lora_params(lora_model)
    # rank 8 over q, kv/k, o, gate, up, down on 6 layers of the tiny config (param_memory.lora_param_count agrees)
    from gemma_tpu_helpers.course.budget import param_memory
    from gemma_tpu_helpers.course.config import tiny

    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert n == param_memory.lora_param_count(tiny.tiny_text_config(6), RANK, targets) > 0
    remat.set_remat(lora_model, "decoder")
    assert remat.remat_config_of(lora_model) == "decoder"
    assert all(layer.config.remat_config.name == "DECODER" for layer in lora_model.layers)  # every module sees it
    remat.set_remat(lora_model, "none")


@pytest.mark.parametrize("policy,regions", [("none", 0), ("block", 12), ("decoder", 6)])
def test_the_policy_is_in_the_train_step(lora_model, mesh, policy, regions):
    """Rematerialised regions in the jaxpr of the train step training runs (sft.train_step): BLOCK wraps
    attention and MLP of each of the 6 layers, DECODER each layer once."""
    from gemma_tpu_helpers.course.config import profiles
    from gemma_tpu_helpers.fixes.model import mesh as mesh_lib
    from gemma_tpu_helpers.fixes.train import sft, step

    remat.set_remat(lora_model, policy)
    spec = profiles.get_profile("smoke").train
    args = (lora_model, sft.optimizer_for(lora_model, spec, 10), step.abstract_batch(mesh, 8, 32))
    with mesh_lib.trainer_context(mesh):
        traced = sft.jitted().trace(*args)
    remat.set_remat(lora_model, "none")
    assert remat.count_remat_regions(traced.traced.jaxpr) == regions  # flax Traced wraps jax.stages.Traced


