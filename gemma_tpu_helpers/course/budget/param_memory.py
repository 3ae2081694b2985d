"""How much memory a profile needs per chip before activations, counted from the HF config: frozen parameters
(sharded; nf4 where QLoRA quantizes), LoRA parameters, their fp32 gradients and AdamW state (:func:`memory_estimate`),
and whether the 26B-A4B's weights fit one chip (:func:`one_chip_moe`). XLA's own figures: :mod:`plan`.
"""

from __future__ import annotations

import math

from ...fixes.model import layout
from ...fixes.model.model_size import expert_param_count, param_count
from ..config.profiles import Profile

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
GIB = 1024**3


def lora_param_count(c: dict, rank: int, targets, expert_rank: int | None = None) -> int:
    """LoRA parameters for HF target names, from the layout table (``layout.lora_param_count``).

    k and v share one ``kv_einsum`` (one A) on local layers; global k=v layers have only ``k_einsum``; the routed
    experts (``experts.gate_up_proj``, ``experts.down_proj``) count at ``expert_rank`` (default ``rank``).
    """
    return layout.lora_param_count(c, rank, targets, expert_rank)


def memory_estimate(profile: Profile, text_config: dict) -> dict:
    """Per-device bytes for frozen params (fully sharded), LoRA params, their grads and AdamW state (replicated)."""
    p = param_count(text_config)
    lora = lora_param_count(text_config, profile.lora.rank, profile.lora.targets, profile.lora.expert_rank)
    nbytes = DTYPE_BYTES[profile.model.dtype]
    devices = profile.hardware.num_devices
    quantized = quantized_param_count(text_config, profile.lora.targets) if profile.lora.qlora else 0
    base = (p - quantized) * nbytes + quantized * nf4_bytes(nbytes)
    per_device = {
        "base params (sharded)" if not quantized else f"base params (sharded; {quantized / p:.0%} in nf4)":
            base / devices,
        "LoRA params (replicated)": lora * nbytes,
        "LoRA grads (fp32)": lora * 4,
        "AdamW state (fp32, 2x)": lora * 8,
    }
    total = sum(per_device.values())
    return {
        "profile": profile.name,
        "params": p,
        "lora_params": lora,
        "trainable_pct": 100 * lora / p,
        "devices": devices,
        "per_device_bytes": per_device,
        "total_per_device_gib": total / GIB,
        "hbm_gib_per_chip": profile.hardware.hbm_gib_per_chip,
    }


NF4_TILE = 64  # QLoRA's tile on the real Gemma 4 sizes (lora.apply_lora picks the largest <= 256 that divides)


def nf4_bytes(scale_bytes: int = 2, tile: int = NF4_TILE) -> float:
    """Bytes a weight takes in nf4: 4 bits, plus its share of one scale per ``tile`` weights."""
    return 0.5 + scale_bytes / tile


def quantized_param_count(text_config: dict, targets) -> int:
    """The frozen weights QLoRA stores in nf4: every weight a LoRA on ``targets`` adapts, and the routed experts of a
    MoE, targeted or not (``expert_lora.quantize_experts``)."""
    dense = [t for t in targets if t not in layout.EXPERT_TARGETS]
    return (sum(math.prod(s) for s in layout.targeted_weights(text_config, dense).values())
            + expert_param_count(text_config))


def one_chip_moe(text_config: dict, usable_gib: float, tile: int = NF4_TILE):
    """Can an MoE (26B-A4B) train on one chip? Its frozen weights per chip, before activations, three ways (pandas):
    bf16 (LoRA); QLoRA as qwix does it (nf4 on what LoRA targets: attention and the dense MLP; the experts, which
    run through ``ragged_dot``, and the embedding stay bf16); and nf4 experts too (``lora.apply_lora(qlora="nf4")``
    on a MoE: ``expert_lora.quantize_experts``). nf4: 4 bits a weight plus a bf16 scale per ``tile`` weights
    (default: the tile QLoRA picks on the real 26B)."""
    import pandas as pd

    c = text_config
    total = param_count(c)
    embed = c["vocab_size"] * c["hidden_size"]
    experts = expert_param_count(c)
    other = total - embed - experts  # attention, dense MLP, router, norms
    nf4 = nf4_bytes(2, tile)
    rows = [("LoRA, bf16 weights", total * 2),
            ("QLoRA nf4 as qwix does it (experts stay bf16)", (embed + experts) * 2 + other * nf4),
            ("QLoRA with nf4 experts (the course's QLoRA: colab-v6e-1-moe)", embed * 2 + (experts + other) * nf4)]
    return pd.DataFrame([{"setting": name, "weights GiB": round(b / GIB, 1), "XLA can use GiB": usable_gib,
                          "fits before activations": b / GIB < usable_gib} for name, b in rows])


def memory_table(estimate: dict):
    import pandas as pd

    rows = [{"what": k, "GiB per device": v / GIB} for k, v in estimate["per_device_bytes"].items()]
    rows.append({"what": "total (before activations)", "GiB per device": estimate["total_per_device_gib"]})
    return pd.DataFrame(rows)
