"""How big a Gemma 4 text config is: the parameters it holds (as tunix holds them; the active ones of an MoE) and
each layer kind's KV heads and head size. Arithmetic on the config's numbers, for memory plans (the HBM a server
needs, the bytes a chip holds)."""

from __future__ import annotations

from .hf_checkpoint import kv_shared_layers, layer_kinds


def attn_dims(c: dict, kind: str) -> tuple[int, int]:
    """(kv heads, head dim) of a layer kind."""
    if kind == "global":
        return (c.get("num_global_key_value_heads") or c["num_key_value_heads"]), c["global_head_dim"]
    return c["num_key_value_heads"], c["head_dim"]


def param_count(c: dict) -> int:
    """Parameters of a Gemma 4 text model as tunix holds them: tied embedding once, the KV-shared layers' unused
    k/v weights included (tunix keeps them)."""
    d, n = c["hidden_size"], c["num_attention_heads"]
    pl, layers = c.get("hidden_size_per_layer_input") or 0, c["num_hidden_layers"]
    shared = kv_shared_layers(c)
    total = c["vocab_size"] * d + d  # embedding + final norm
    if pl:  # per-layer input embedding table, model projection and its norm
        total += c.get("vocab_size_per_layer_input", c["vocab_size"]) * layers * pl + d * layers * pl + pl
    for i, kind in enumerate(layer_kinds(c)):
        k, h = attn_dims(c, kind)
        f = c["intermediate_size"] * (2 if i in shared and c.get("use_double_wide_mlp") else 1)
        kv = (1 if kind == "global" and c.get("attention_k_eq_v") else 2) * d * k * h
        total += 2 * d * n * h + kv + 3 * d * f + 4 * d + 2 * h + 1  # q, o, k(/v), mlp, norms, scalar
        if pl:
            total += 2 * d * pl + d  # per-layer input gate and projection, post norm
        if c.get("enable_moe_block"):
            total += moe_layer_params(c) + 3 * d  # router, experts, and the block's three norms
    return total


def expert_param_count(c: dict) -> int:
    """The routed experts' weights of every layer (gate_up [E, 2F, D] and down [E, D, F]); 0 for a dense model."""
    if not c.get("enable_moe_block"):
        return 0
    return c["num_hidden_layers"] * c["num_experts"] * 3 * c["hidden_size"] * c["moe_intermediate_size"]


def moe_layer_params(c: dict, active: bool = False) -> int:
    """One layer's router (proj, scale, per-expert scale) and experts (gate_up [E, 2F, D], down [E, D, F]); with
    ``active``, only the ``top_k_experts`` that run for a token (what the FLOPs see)."""
    d, e, f = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
    return d * e + d + e + (c["top_k_experts"] if active else e) * 3 * d * f


def active_param_count(c: dict) -> int:
    """Parameters a token runs through: :func:`param_count` less the experts it is not routed to (the "A4B")."""
    if not c.get("enable_moe_block"):
        return param_count(c)
    return param_count(c) - c["num_hidden_layers"] * (moe_layer_params(c) - moe_layer_params(c, active=True))
