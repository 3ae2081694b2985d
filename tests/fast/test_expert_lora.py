"""LoRA on the routed experts of the tiny 26B-A4B replica (fixes/expert_lora.py): the count, parity with PEFT's
``target_parameters`` on transformers' model, and gradients that reach exactly the experts a token is routed to."""

import numpy as np
import pytest

from gemma_tpu_helpers.course import profiles, tiny
from gemma_tpu_helpers.fixes import gemma4, layout, lora, parity

RANK, EXPERT_RANK, ALPHA = 4, 2, 8.0


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return tiny.write_tiny_model(tmp_path_factory.mktemp("moe") / "base", seed=0, layers=6, variant="26b-a4b")


@pytest.fixture(scope="module")
def moe_mesh():
    return profiles.get_profile("smoke-moe").make_mesh()


@pytest.fixture(scope="module")
def moe_model(moe_dir, moe_mesh):
    return gemma4.load_model(moe_dir, moe_mesh, dtype="float32")


def _expert_lora(model, seed: int = 0, b_std: float = 0.0):
    """Expert-only LoRA (rank RANK); B drawn with ``b_std`` (0: as qwix creates it) from ``seed``."""
    lm, report = lora.apply_lora(model, lora.EXPERT_TARGETS, rank=RANK, alpha=ALPHA, seed=seed)
    if b_std:
        rng = np.random.default_rng(seed)
        for layer in lm.layers:
            for row in layout.EXPERT_ROWS:
                b = getattr(layer.moe, row.param + "_lora_b")
                b.value = (rng.standard_normal(b.value.shape) * b_std).astype(np.float32)
    return lm, report


def _lora_arrays(lm) -> dict:
    """``{(layer, tunix param): (A, B)}`` of every expert LoRA, as numpy."""
    return {(i, row.param): (np.asarray(getattr(layer.moe, row.param + "_lora_a").value),
                             np.asarray(getattr(layer.moe, row.param + "_lora_b").value))
            for i, layer in enumerate(lm.layers) for row in layout.EXPERT_ROWS}


def test_each_expert_gets_its_own_lora_and_the_count_is_the_analytic_one(moe_dir, moe_model):
    text = gemma4.read_text_config(moe_dir)
    targets = lora.HF_TARGETS + lora.EXPERT_TARGETS
    lm, report = lora.apply_lora(moe_model, targets, rank=RANK, alpha=ALPHA, expert_rank=EXPERT_RANK)
    shapes = layout.expert_lora_shapes(text, EXPERT_RANK)
    e, d, f = text["num_experts"], text["hidden_size"], text["moe_intermediate_size"]
    assert shapes["layers/0/moe/gating_einsum_lora_a"] == (e, d, EXPERT_RANK)
    assert shapes["layers/0/moe/gating_einsum_lora_b"] == (e, EXPERT_RANK, 2 * f)
    assert shapes["layers/0/moe/linear_lora_a"] == (e, f, EXPERT_RANK)
    assert shapes["layers/0/moe/linear_lora_b"] == (e, EXPERT_RANK, d)
    for path, shape in shapes.items():
        layer, _, name = path.split("/", 3)[1:]
        assert tuple(getattr(lm.layers[int(layer)].moe, name).value.shape) == shape, path
    experts = sum(int(np.prod(s)) for s in shapes.values())
    assert experts == 6 * e * EXPERT_RANK * (d + 2 * f + f + d)
    dense = layout.lora_param_count(text, RANK, lora.HF_TARGETS)
    assert report.attrs["lora_params"] == dense + experts
    got = report[report["target"].isin(lora.EXPERT_TARGETS)].groupby("target")["LoRA params"].sum()
    assert got["experts.gate_up_proj"] == 6 * e * EXPERT_RANK * (d + 2 * f)
    assert got["experts.down_proj"] == 6 * e * EXPERT_RANK * (f + d)
    assert report[report["target"] == "router.proj"]["LoRA params"].sum() == 0  # the router keeps no LoRA
    assert f"{experts:,} LoRA parameters reach them" in report.attrs["experts"]
    assert report.attrs["expert_rank"] == EXPERT_RANK


def test_expert_targets_on_a_dense_model_are_refused(tunix_model):
    with pytest.raises(lora.LoraCoverageError, match="no routed experts"):
        lora.apply_lora(tunix_model, ["q_proj", "experts.down_proj"], rank=2, abstract=True)
    with pytest.raises(lora.LoraConfigError, match="experts.gate_up_proj and experts.down_proj"):
        lora.validate_targets(["q_proj", "experts"])


def test_expert_lora_equals_peft_target_parameters_on_transformers(moe_dir, moe_model, moe_mesh):
    """The same A and B in tunix and in PEFT (``target_parameters``, one A and B per expert) give the same logits,
    within the bound every parity check uses (fp32 rounding: ~1e-5 relative; a misplaced expert or a transposed
    factor: O(1)); and the LoRA moves the logits by far more than that bound, so the check can fail."""
    import torch
    from peft import LoraConfig, get_peft_model

    lm, _ = _expert_lora(moe_model, seed=1, b_std=0.3)
    hf = parity.load_hf(moe_dir)
    peft_model = get_peft_model(hf, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=[],
                                               target_parameters=list(lora.EXPERT_TARGETS)))
    arrays = _lora_arrays(lm)
    param_of = {row.target.split(".")[1]: row.param for row in layout.EXPERT_ROWS}
    copied = 0
    with torch.no_grad():
        for name, module in peft_model.named_modules():
            if getattr(module, "parameter_name", None) in param_of and hasattr(module, "lora_A"):
                layer = int(name.split(".layers.")[1].split(".")[0])
                a, b = layout.expert_peft_factors(*arrays[(layer, param_of[module.parameter_name])])
                module.lora_A["default"].weight.copy_(torch.from_numpy(np.ascontiguousarray(a)))
                module.lora_B["default"].weight.copy_(torch.from_numpy(np.ascontiguousarray(b)))
                copied += 1
    assert copied == 6 * 2
    tokens = parity.sample_tokens(gemma4.read_text_config(moe_dir)["vocab_size"], 40)
    ours = parity.tunix_logits(lm, tokens, moe_mesh)
    with torch.no_grad():
        ref = peft_model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.double().numpy()
    base = parity.tunix_logits(moe_model, tokens, moe_mesh)
    scale = np.abs(ref).max()
    rel, moved = np.abs(ours - ref).max() / scale, np.abs(ours - base).max() / scale
    print(f"\nexpert LoRA vs PEFT target_parameters: relative {rel:.2e}; the LoRA moved the logits by {moved:.2e}")
    assert rel <= parity.DEFAULT_REL_BOUND
    assert moved > 100 * parity.DEFAULT_REL_BOUND


def test_only_the_experts_a_token_is_routed_to_get_a_gradient(moe_dir, moe_model, moe_mesh):
    """Two tokens (one would be tunix's decoding path): each layer's router picks top_k experts per token
    (transformers' router, hooked, is the reference); those experts' B get a gradient, every other expert's B
    exactly zero."""
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from gemma_tpu_helpers.fixes.forward_inputs import causal_inputs

    text = gemma4.read_text_config(moe_dir)
    lm, _ = _expert_lora(moe_model, seed=2)  # B = 0, as training starts
    tokens = parity.sample_tokens(text["vocab_size"], 2, seed=3)

    @nnx.jit
    def grads(m, toks, positions, mask):
        return nnx.grad(lambda m: jnp.mean(m(toks, positions, None, mask)[0] ** 2),
                        argnums=nnx.DiffState(0, nnx.LoRAParam))(m)

    with jax.set_mesh(moe_mesh):
        g = grads(lm, *causal_inputs(tokens))
    hf, chosen = parity.load_hf(moe_dir), {}
    hooks = [layer.router.register_forward_hook(lambda m, i, o, at=at: chosen.__setitem__(at, o[2]))
             for at, layer in enumerate(hf.model.language_model.layers)]
    with torch.no_grad():
        hf(input_ids=torch.as_tensor(tokens, dtype=torch.long))
    for h in hooks:
        h.remove()
    for i in range(text["num_hidden_layers"]):
        want = set(chosen[i].flatten().tolist())
        assert text["top_k_experts"] <= len(want) < text["num_experts"]  # some experts get no token
        for row in layout.EXPERT_ROWS:
            gb = np.asarray(g["layers"][i]["moe"][row.param + "_lora_b"].value)
            nonzero = {e for e in range(text["num_experts"]) if np.any(gb[e] != 0)}
            assert nonzero == want, (i, row.param, nonzero, want)
