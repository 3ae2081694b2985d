"""The one mapping from a Hugging Face Gemma 4 ``config.json`` to a tunix ``ModelConfig``, and a checked loader
(:func:`load_model`). The released text configs are here as dicts; a tiny test model is one with smaller numbers.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from . import compat
from .errors import GemmaTpuError

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

PATTERN = ("sliding_attention",) * 5 + ("full_attention",)  # Gemma 4's 5:1 sliding/global period (31B, E4B)
KEY_PREFIX = "model.language_model."
# The -it checkpoints' vision and audio towers: the text model loads none of them; the merge copies them as they are.
MULTIMODAL_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


class CheckpointError(GemmaTpuError, ValueError):
    """A checkpoint directory that cannot be loaded as a Gemma 4 text model."""


def read_text_config(model_dir: str | Path) -> dict:
    """The text part of a Gemma 4 ``config.json`` (multimodal layout or text-only)."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if model_dir.exists() and not model_dir.is_dir():
        raise CheckpointError(f"{model_dir} is a file, not a checkpoint directory: pass the directory that holds "
                              f"config.json and the *.safetensors shards.")
    if not model_dir.is_dir():
        raise CheckpointError(f"Checkpoint directory {model_dir} does not exist. Download the checkpoint "
                              f"there (`hf download REPO --local-dir {model_dir}`) or pass the directory that has it.")
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json; it is not a Hugging Face checkpoint directory.")
    try:
        cfg = json.loads(path.read_text())
        text = cfg.get("text_config", cfg)
    except (ValueError, AttributeError):
        raise CheckpointError(f"{path} is not a JSON object (truncated or damaged); "
                              f"{refetch_hint(model_dir)}.") from None
    if text.get("model_type") not in ("gemma4_text", "gemma4"):
        raise CheckpointError(f"{path} describes model_type={text.get('model_type')!r}, not a Gemma 4 text model.")
    return text


def layer_kinds(text_config: dict) -> list[str]:
    """'global' or 'local' for every layer."""
    return ["global" if t == "full_attention" else "local" for t in text_config["layer_types"]]


def kv_shared_layers(text_config: dict) -> dict[int, int]:
    """Layer -> the earlier layer whose K/V it reads (E2B/E4B; empty for the 31B): as in transformers, the last
    unshared layer of its own type."""
    types = text_config["layer_types"]
    first = text_config["num_hidden_layers"] - (text_config.get("num_kv_shared_layers") or 0)
    if first == len(types):
        return {}
    prev = types[:first]
    out = {}
    for i in range(first, len(types)):
        if types[i] not in prev:
            raise CheckpointError(f"layer {i} ({types[i]}) is KV-shared but no unshared layer before {first} has "
                                  f"that type to share from.")
        out[i] = first - 1 - prev[::-1].index(types[i])
    return out


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


INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header


def refetch_hint(model_dir: str | Path) -> str:
    """How to get a damaged file of ``model_dir`` back: run the merge again for a merged model, rebuild a tiny
    replica, else copy or download it again."""
    d = Path(model_dir)
    if (d / "merge_info.json").is_file():
        return f"run the merge again into {d} (overwrite=True)"
    if (d / "tiny_model.json").is_file():
        return f"rebuild the tiny replica in {d} (overwrite=True)"
    return (f"copy or download it again (`hf download REPO --local-dir {d}` fetches what is missing or "
            f"damaged; delete the damaged file first)")


def read_shard_header(path: str | Path) -> tuple[dict, int]:
    """``(header, data_start)`` of one safetensors file (u64 header length, JSON header, raw data), checked: a
    truncated file, or one that is not safetensors at all, raises CheckpointError naming the file, with the fix."""
    path = Path(path)
    fix = refetch_hint(path.parent)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else None
            text = f.read(n) if n is not None and 0 < n <= MAX_HEADER_BYTES and 8 + n <= size else b""
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e.strerror or e}); {fix}.") from e
    if n is None:
        raise CheckpointError(f"{path} is truncated or not a safetensors file ({size} bytes, shorter than the "
                              f"8-byte header length); {fix}.")
    if n == 0 or n > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path} is not a safetensors file (its first 8 bytes give a header length of "
                              f"{n:,} bytes); {fix}.")
    if 8 + n > size:
        raise CheckpointError(f"{path} is truncated: {size:,} bytes, fewer than its own header needs "
                              f"({8 + n:,}); an interrupted copy or download. {fix[0].upper()}{fix[1:]}.")
    try:
        header = json.loads(text)
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):  # not JSON, or not safetensors' header
        raise CheckpointError(f"{path} is not a safetensors file (its header is not a safetensors JSON header); "
                              f"{fix}.") from None
    need = 8 + n + max(ends, default=0)
    if need > size:
        raise CheckpointError(f"{path} is truncated: {size:,} bytes of the {need:,} its header describes; an "
                              f"interrupted copy or download. {fix[0].upper()}{fix[1:]}.")
    return header, 8 + n


def checkpoint_layout(model_dir: str | Path) -> tuple[dict, dict[str, list[str]], dict[str, dict]]:
    """``(index, {shard: [tensor names]}, {tensor: header entry})`` of a safetensors checkpoint, every shard's header
    checked against the index. Raises CheckpointError naming the file that is missing, truncated or foreign."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX
    fix = refetch_hint(model_dir)
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = dict(index["weight_map"])
        except (ValueError, TypeError, KeyError):
            raise CheckpointError(f"{index_path} is not a safetensors index (no JSON weight_map: truncated or "
                                  f"damaged); {fix}.") from None
    elif (model_dir / "model.safetensors").is_file():  # a single-file checkpoint: same code, one shard
        header, _ = read_shard_header(model_dir / "model.safetensors")
        weight_map = {k: "model.safetensors" for k in header if k != "__metadata__"}
        index = {"metadata": {}, "weight_map": weight_map}
    else:
        raise CheckpointError(f"{model_dir} has no {INDEX} (nor a single model.safetensors): cannot tell which "
                              f"shard holds which tensor. {fix[0].upper()}{fix[1:]}, with its index.")
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, []).append(name)
    entries = {}
    for shard, names in shards.items():
        path = model_dir / shard
        if not path.is_file():
            raise CheckpointError(f"{INDEX} names shard {shard}, which is missing from {model_dir}; {fix}.")
        header, _ = read_shard_header(path)
        for name in names:
            if name not in header:
                raise CheckpointError(f"{index_path} puts {name} in {shard}, but that shard's header does not hold "
                                      f"it: the index and the shards are from different copies. "
                                      f"{fix[0].upper()}{fix[1:]}.")
            entries[name] = header[name]
    return index, shards, entries


def check_checkpoint(model_dir: str | Path) -> dict:
    """Validate a checkpoint's files (every shard's header, against the index) and key layout; return its text
    config. Raises CheckpointError."""
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


class _TowerSkipFilter:
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

        self._logger, self._filter = logging.getLogger("absl"), _TowerSkipFilter()
        self._logger.addFilter(self._filter)

    def __exit__(self, *exc):
        self._logger.removeFilter(self._filter)
