"""LoRA on the routed experts of the tiny 26B-A4B replica (fixes/expert_lora.py), on abstract shapes: the count
per expert and layer, and the targets refused. Parity with PEFT and the gradients: tests/e2e/test_tiny_moe.py."""

import numpy as np
import pytest

from gemma_tpu_helpers.course import tiny
from gemma_tpu_helpers.fixes import layout, lora, sharding

RANK, EXPERT_RANK, ALPHA = 4, 2, 8.0


def test_each_expert_gets_its_own_lora_and_the_count_is_the_analytic_one():
    text = tiny.tiny_text_config(6, "26b-a4b")
    model = sharding.model_from_config(text, abstract=True)
    targets = lora.HF_TARGETS + lora.EXPERT_TARGETS
    lm, report = lora.apply_lora(model, targets, rank=RANK, alpha=ALPHA, expert_rank=EXPERT_RANK, abstract=True)
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
