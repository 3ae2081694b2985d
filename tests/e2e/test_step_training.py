"""The train step trains: LoRA under BLOCK remat with dropout, a few real steps (about 90 s), and remat changes
the memory, not the loss. The program the trainer runs and the plan compiles: tests/fast/test_step.py; what remat
saves on a TPU: notebook 04 and tests/e2e/test_plan_aot.py compile the step for a v5p."""

import dataclasses

import numpy as np

from gemma_tpu_helpers.fixes.model import gemma4
from gemma_tpu_helpers.fixes.train import remat, sft


def test_lora_trains_under_remat_with_dropout(smoke, tiny_dir, mesh):
    """Every LoRA B moves off zero and the loss falls under BLOCK remat, with the paper's LoRA dropout (0.05, the TPU
    profiles'): qwix draws the masks from rngs it unsets after creating the params, so without remat.lora_then_remat's
    stream the first step fails ("Cannot find rngs")."""
    from flax import nnx

    from gemma_tpu_helpers.fixes.model import mesh as mesh_lib

    spec = dataclasses.replace(smoke.train, grad_accum=1, warmup_steps=0, learning_rate=3e-3)
    model = remat.lora_then_remat(gemma4.load_model(tiny_dir, mesh), 8, 16.0, "block", dropout=0.05)
    optimizer = sft.optimizer_for(model, spec, 10)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 1000, (8, 16)).astype(np.int32)
    batch = {"tokens": tokens, "loss_mask": np.ones_like(tokens, np.int8), "segment_ids": np.ones_like(tokens),
             "positions": np.broadcast_to(np.arange(16, dtype=np.int32), tokens.shape).copy()}
    def lora_b():
        return [np.asarray(v.value) for path, v in nnx.iter_graph(model)
                if isinstance(v, nnx.LoRAParam) and str(path[-1]).endswith("_b")]

    assert lora_b() and not any(b.any() for b in lora_b())  # LoRA B starts at zero
    fn = sft.jitted()
    with mesh_lib.trainer_context(mesh):
        losses = [float(fn(model, optimizer, batch)[0]) for _ in range(3)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 1e-3, losses
    assert all(b.any() for b in lora_b()), "every LoRA B must have moved"


def test_remat_changes_memory_not_the_loss(smoke, tiny_dir, mesh):
    """The same rows through the same seeded LoRA model without remat and under DECODER: the same first loss. remat
    recomputes the forward in the backward pass; the forward itself is the same program, so the two can differ only
    by how XLA fuses it: at most the reassociation of the mean over the 128 tokens (128 float32 ulps of the loss)."""
    from gemma_tpu_helpers.fixes.model import mesh as mesh_lib

    spec = dataclasses.replace(smoke.train, grad_accum=1, warmup_steps=0, learning_rate=3e-3)
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, 1000, (8, 16)).astype(np.int32)
    batch = {"tokens": tokens, "loss_mask": np.ones_like(tokens, np.int8), "segment_ids": np.ones_like(tokens),
             "positions": np.broadcast_to(np.arange(16, dtype=np.int32), tokens.shape).copy()}
    first = {}
    for policy in ("none", "decoder"):
        model = remat.lora_then_remat(gemma4.load_model(tiny_dir, mesh, dtype="float32"), 8, 16.0, policy, seed=0)
        with mesh_lib.trainer_context(mesh):
            first[policy] = float(sft.jitted()(model, sft.optimizer_for(model, spec, 10), batch)[0])
    bound = tokens.size * np.finfo(np.float32).eps * abs(first["none"])
    print(f"first loss without remat {first['none']!r}, DECODER {first['decoder']!r}, bound {bound:.1e}")
    assert np.isfinite(first["none"]) and abs(first["none"] - first["decoder"]) <= bound, first
