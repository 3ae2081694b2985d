"""Gemma 4 on tunix: the released text configs as dicts, the one mapping from a Hugging Face text config to a
tunix ``ModelConfig`` (:func:`to_tunix_config`), what a mesh can divide, and a checked loader (:func:`load_model`).
A tiny test model is a released config with smaller numbers. Reading a checkpoint without tunix: :mod:`hf_checkpoint`.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..core import compat
from .hf_checkpoint import (
    KEY_PREFIX,
    MULTIMODAL_PREFIXES,
    CheckpointError,
    checkpoint_layout,
    kv_shared_layers,
    layer_kinds,
    read_text_config,
)

# The text config of google/gemma-4-31B-it (the fields this course reads), as in its config.json "text_config".
GEMMA4_31B_TEXT_CONFIG: dict = {
    "model_type": "gemma4_text",
    "vocab_size": 262144,
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "num_hidden_layers": 60,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "num_global_key_value_heads": 4,
    "head_dim": 256,
    "global_head_dim": 512,
    "attention_k_eq_v": True,
    "sliding_window": 1024,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10,
    "final_logit_softcapping": 30.0,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size_per_layer_input": 0,
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
    "tie_word_embeddings": True,
    "use_bidirectional_attention": "vision",  # image tokens attend both ways; text stays causal
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}

# google/gemma-4-E2B-it and -E4B-it (tunix's presets agree): per-layer input embeddings, the last layers reuse an
# earlier layer's K/V (num_kv_shared_layers; E2B doubles their MLP), no k=v.
_E_COMMON = {
    k: v for k, v in GEMMA4_31B_TEXT_CONFIG.items()
    if k not in ("hidden_size", "intermediate_size", "num_hidden_layers", "layer_types", "num_key_value_heads",
                 "num_global_key_value_heads", "attention_k_eq_v", "sliding_window", "hidden_size_per_layer_input",
                 "num_kv_shared_layers", "use_double_wide_mlp", "num_attention_heads", "max_position_embeddings")
}
GEMMA4_E2B_TEXT_CONFIG: dict = dict(
    _E_COMMON, hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
    num_key_value_heads=1, num_global_key_value_heads=None, attention_k_eq_v=False, sliding_window=512,
    layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7, hidden_size_per_layer_input=256,
    vocab_size_per_layer_input=262144, num_kv_shared_layers=20, use_double_wide_mlp=True,
    max_position_embeddings=131072,
)
GEMMA4_E4B_TEXT_CONFIG: dict = dict(
    _E_COMMON, hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, num_attention_heads=8,
    num_key_value_heads=2, num_global_key_value_heads=None, attention_k_eq_v=False, sliding_window=512,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 7, hidden_size_per_layer_input=256,
    vocab_size_per_layer_input=262144, num_kv_shared_layers=18, use_double_wide_mlp=False,
    max_position_embeddings=131072,
)
# google/gemma-4-26B-A4B-it: each layer has the dense MLP and beside it a router and 128 experts, 8 run per token
# (`experts.gate_up_proj` [E, 2F, D], `experts.down_proj` [E, D, F]); 2 global KV heads, so tp <= 2.
GEMMA4_26B_A4B_TEXT_CONFIG: dict = dict(
    GEMMA4_31B_TEXT_CONFIG, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
    num_key_value_heads=8, num_global_key_value_heads=2, layer_types=list(GEMMA4_31B_TEXT_CONFIG["layer_types"][:30]),
    enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
)
TEXT_CONFIGS = {"31b": GEMMA4_31B_TEXT_CONFIG, "e2b": GEMMA4_E2B_TEXT_CONFIG, "e4b": GEMMA4_E4B_TEXT_CONFIG,
                "26b-a4b": GEMMA4_26B_A4B_TEXT_CONFIG}


def _tunix_kv_sharing(c: dict, pattern) -> dict:
    """ModelConfig fields for KV sharing. tunix shares with layer first-1 (global) and first-2 (local) and keeps the
    count as a fraction, so check that this gives transformers' layers exactly."""
    from tunix.models.gemma4 import model as gm

    n, shared = c["num_hidden_layers"], c.get("num_kv_shared_layers") or 0
    if not shared:
        return {}
    frac = shared / n
    theirs = gm.create_kv_cache_sharing_patterns(n, frac, True, True, pattern)
    ours = [kv_shared_layers(c).get(i, i) for i in range(n)]
    if theirs != ours:
        raise CheckpointError(f"tunix would share K/V as {theirs}, transformers as {ours}: tunix needs the last two "
                              f"unshared layers to be one sliding then one full-attention layer.")
    fields = {"frac_shared_layers": frac}
    if c.get("use_double_wide_mlp"):
        fields["override_kv_shared_ffw_hidden"] = 2 * c["intermediate_size"]
    return fields


def to_tunix_config(text_config: dict, dtype: str = "float32", remat: str = "none"):
    """The tunix ``gemma4.ModelConfig`` for a HF Gemma 4 text config (the only mapping in this package)."""
    import jax.numpy as jnp
    from tunix.models.gemma4 import model as gm

    c = text_config
    if c.get("use_double_wide_mlp") and not c.get("num_kv_shared_layers"):
        raise CheckpointError("use_double_wide_mlp widens the KV-shared layers' MLP, but num_kv_shared_layers is 0.")
    rope = c["rope_parameters"]
    pattern = tuple(
        gm.AttentionType.GLOBAL if k == "global" else gm.AttentionType.LOCAL_SLIDING for k in layer_kinds(c)
    )
    jdtype = jnp.dtype(dtype)
    return gm.ModelConfig(
        num_layers=c["num_hidden_layers"],
        num_embed=c["vocab_size"],
        embed_dim=c["hidden_size"],
        hidden_dim=c["intermediate_size"],
        num_heads=c["num_attention_heads"],
        head_dim=c["head_dim"],
        num_kv_heads=c["num_key_value_heads"],
        num_global_kv_heads=c.get("num_global_key_value_heads"),
        global_key_size=c["global_head_dim"],
        k_eq_v_global=bool(c.get("attention_k_eq_v")),
        final_logit_softcap=c.get("final_logit_softcapping"),
        sliding_window_size=c["sliding_window"],
        per_layer_input_dim=c.get("hidden_size_per_layer_input", 0) or 0,
        attention_pattern=pattern,
        local_base_frequency=int(rope["sliding_attention"]["rope_theta"]),
        global_base_frequency=int(rope["full_attention"]["rope_theta"]),
        global_rope_proportion=rope["full_attention"].get("partial_rotary_factor", 1.0),
        param_dtype=jdtype,
        dtype=jdtype,
        remat_config=getattr(gm.RematConfig, remat.upper()),
        **_tunix_kv_sharing(c, pattern),
        **_tunix_moe(c),
    )


def _tunix_moe(c: dict) -> dict:
    """ModelConfig fields for the MoE block (26B-A4B): experts beside the dense MLP of ``intermediate_size``."""
    if not c.get("enable_moe_block"):
        return {}
    compat.patch_gemma4_moe_router()  # tunix 0.1.7 feeds the router the wrong tensor (see compat)
    return {"enable_moe": True, "num_experts": c["num_experts"], "num_experts_per_tok": c["top_k_experts"],
            "expert_dim": c["moe_intermediate_size"], "moe_dense_hidden_dim": c["intermediate_size"]}


def head_divisibility_problems(text_config: dict, mesh_axes: dict[str, int]) -> list[str]:
    """Sharded dims that the mesh cannot divide, as sentences naming the tensor and the axis."""
    c = text_config
    tp = mesh_axes.get("tp", 1)
    fsdp = mesh_axes.get("fsdp", 1)
    checks = [
        ("q_proj (attention heads)", c["num_attention_heads"], "tp", tp),
        ("k_proj/v_proj on local layers (KV heads)", c["num_key_value_heads"], "tp", tp),
        ("k_proj on global layers (global KV heads)", c.get("num_global_key_value_heads") or c["num_key_value_heads"],
         "tp", tp),
        ("embed_tokens (vocab)", c["vocab_size"], "tp", tp),
        ("mlp (intermediate_size)", c["intermediate_size"], "tp", tp),
        ("hidden_size", c["hidden_size"], "fsdp", fsdp),
    ]
    if c.get("enable_moe_block"):  # tunix shards experts [E, 2, F, D] (fsdp, -, -, tp) and [E, F, D] (fsdp, tp, -)
        checks += [
            ("experts (num_experts)", c["num_experts"], "fsdp", fsdp),
            ("experts (moe_intermediate_size)", c["moe_intermediate_size"], "tp", tp),
            ("experts.gate_up_proj (hidden_size)", c["hidden_size"], "tp", tp),
        ]
    return [
        f"{name}: {n} is not divisible by mesh axis {axis!r} of size {size}"
        for name, n, axis, size in checks
        if n % size
    ]


def valid_tp_sizes(text_config: dict, max_tp: int = 64) -> list[int]:
    """The tp sizes whose head counts and widths divide (e.g. [1, 2, 4] for the 31B: 4 global KV heads)."""
    return [tp for tp in range(1, max_tp + 1) if not head_divisibility_problems(text_config, {"tp": tp})]


def check_checkpoint(model_dir: str | Path) -> dict:
    """Validate a checkpoint's files (every shard's header, against the index) and the key layout tunix's loader
    needs; return its text config. Raises CheckpointError."""
    return checked_layout(model_dir)[0]


def checked_layout(model_dir: str | Path) -> tuple[dict, tuple[dict, dict[str, list[str]], dict[str, dict]]]:
    """:func:`check_checkpoint`, returning ``(text config, checkpoint_layout(model_dir))`` (headers read once)."""
    model_dir = Path(model_dir)
    text = read_text_config(model_dir)
    if not any(model_dir.glob("*.safetensors")):
        raise CheckpointError(f"{model_dir} has config.json but no *.safetensors weights.")
    layout = checkpoint_layout(model_dir)
    keys = list(layout[0]["weight_map"])
    layer_keys = [k for k in keys if re.search(r"layers\.\d+\.", k) and not k.startswith(MULTIMODAL_PREFIXES)]
    wrong = [k for k in layer_keys if not k.startswith(KEY_PREFIX)]
    if wrong or not layer_keys:
        example = wrong[0] if wrong else "(no decoder layer keys at all)"
        raise CheckpointError(
            f"{model_dir}: tensor {example!r} does not use the Gemma 4 checkpoint layout "
            f"(keys under {KEY_PREFIX!r}, as google/gemma-4-31B-it saves them). A plain Gemma4ForCausalLM "
            f"saves 'model.layers...'; save with Gemma4ForConditionalGeneration or rename the keys."
        )
    return text, layout


def load_model(model_dir: str | Path, mesh, dtype: str = "float32", remat: str = "none"):
    """Load a HF Gemma 4 checkpoint into a sharded tunix model on ``mesh``. Raises CheckpointError, naming the
    tensor and mesh axis, for a bad layout or a mesh that cannot divide the heads, before tunix reads the files."""
    from tunix.models.gemma4 import params_safetensors

    text = check_checkpoint(model_dir)
    axes = dict(zip(mesh.axis_names, mesh.devices.shape))
    problems = head_divisibility_problems(text, axes)
    if problems:
        raise CheckpointError(
            "The mesh cannot shard this model: " + "; ".join(problems)
            + f". Valid tp sizes for this config: {valid_tp_sizes(text)}."
        )
    cfg = to_tunix_config(text, dtype=dtype, remat=remat)
    with _towers_skipped_quietly():
        # dtype=: else tunix keeps each tensor's file dtype (bf16 in the releases), whatever param_dtype says
        return params_safetensors.create_model_from_safe_tensors(str(model_dir), cfg, mesh=mesh,
                                                                 dtype=cfg.param_dtype)


class TowerSkipFilter:
    """Drops tunix's 'Skipped loading N keys ...' warning when every skipped key is a vision/audio tower's (the
    expected case for an -it checkpoint: the text model has no towers); any other skipped key still warns."""

    def filter(self, record) -> bool:
        msg = record.getMessage()
        if not msg.startswith("Skipped loading") or "Missing keys: [" not in msg:
            return True
        keys = [k.strip() for k in msg.split("Missing keys: [", 1)[1].rstrip("]").split(",")]
        return not all(k.startswith(MULTIMODAL_PREFIXES) for k in keys if k)


class _towers_skipped_quietly:
    def __enter__(self):
        import logging

        self._logger, self._filter = logging.getLogger("absl"), TowerSkipFilter()
        self._logger.addFilter(self._filter)

    def __exit__(self, *exc):
        self._logger.removeFilter(self._filter)
