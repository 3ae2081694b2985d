"""How much memory a profile needs per device, before anything is compiled.

:func:`memory_estimate` counts parameters from the HF config analytically (the same config mapping the loader
uses). Activations are not in it: the ahead-of-time compile plan gives XLA's own figures for those.
"""

from __future__ import annotations

from .profiles import Profile

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
GIB = 1024**3


def _attn_dims(c: dict, kind: str) -> tuple[int, int]:
    """(kv heads, head dim) of a layer kind."""
    if kind == "global":
        return (c.get("num_global_key_value_heads") or c["num_key_value_heads"]), c["global_head_dim"]
    return c["num_key_value_heads"], c["head_dim"]


def param_count(c: dict) -> int:
    """Parameters of a Gemma 4 text model (tied embedding counted once)."""
    from .gemma4 import layer_kinds

    d, f, n = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    total = c["vocab_size"] * d + d  # embedding + final norm
    for kind in layer_kinds(c):
        k, h = _attn_dims(c, kind)
        kv = (1 if kind == "global" and c.get("attention_k_eq_v") else 2) * d * k * h
        total += 2 * d * n * h + kv + 3 * d * f + 4 * d + 2 * h + 1  # q, o, k(/v), mlp, norms, scalar
    return total


def lora_param_count(c: dict, rank: int, targets) -> int:
    """LoRA parameters for HF target names, following the tunix module layout.

    k and v share one ``kv_einsum`` (one A) on local layers; global k=v layers have only ``k_einsum``.
    """
    from .gemma4 import layer_kinds

    t = set(targets)
    d, f, n = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    total = 0
    for kind in layer_kinds(c):
        k, h = _attn_dims(c, kind)
        if "q_proj" in t:
            total += rank * (d + n * h)
        if "o_proj" in t:
            total += rank * (n * h + d)
        if kind == "global" and c.get("attention_k_eq_v"):
            if "k_proj" in t:
                total += rank * (d + k * h)
        elif t & {"k_proj", "v_proj"}:
            total += rank * (d + 2 * k * h)
        total += sum(rank * (d + f) for name in ("gate_proj", "up_proj", "down_proj") if name in t)
    return total


def memory_estimate(profile: Profile, text_config: dict) -> dict:
    """Per-device bytes for frozen params (fully sharded), LoRA params, their grads and AdamW state (replicated)."""
    p = param_count(text_config)
    lora = lora_param_count(text_config, profile.lora.rank, profile.lora.targets)
    nbytes = _DTYPE_BYTES[profile.model.dtype]
    devices = profile.hardware.num_devices
    per_device = {
        "base params (sharded)": p * nbytes / devices,
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


def memory_table(estimate: dict):
    import pandas as pd

    rows = [{"what": k, "GiB per device": v / GIB} for k, v in estimate["per_device_bytes"].items()]
    rows.append({"what": "total (before activations)", "GiB per device": estimate["total_per_device_gib"]})
    return pd.DataFrame(rows)
