"""The tiny Gemma 4: random weights with a real model's structure (31B, E2B, E4B or 26B-A4B) in a replica of the real
checkpoint's files: sharded safetensors under the real keys, a small vision (and audio) tower, and a Gemma tokenizer
trained on the shipped Verilog data with Gemma 4's special tokens at their real ids.
:func:`ensure_tiny_model` builds it on first use and caches it; :func:`tiny_text_config` gives its config alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ...fixes.core import file_io
from ...fixes.core.file_io import OutputExistsError
from ...fixes.model import chat_format
from ...fixes.model.gemma4 import GEMMA4_31B_TEXT_CONFIG, TEXT_CONFIGS
from ...fixes.model.hf_checkpoint import KEY_PREFIX, PATTERN, kv_shared_layers
from . import paths

# What changes from the 31B. Head dims 64/128 are ones vLLM's CPU attention accepts; hidden_size differs from both
# head dims (tunix's loader finds k/v axes by size); every sharded size divides an (fsdp=4, tp=2) mesh. There are
# fewer global KV heads (4) than local ones (8), and 4 global KV heads as in the 31B: tp=4 works and tp=8 fails on
# them, exactly as for the 31B. Few heads keep a training step affordable on a laptop CPU.
TINY_OVERRIDES = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "num_global_key_value_heads": 4,
    "head_dim": 64,
    "global_head_dim": 128,
    "sliding_window": 16,
    "max_position_embeddings": 4096,
    "initializer_range": 0.05,
}
# The E replicas (E2B, E4B): the same small numbers, their own structure. One KV head (E2B) or two (E4B) as in the
# real ones, so E2B loads only on tp=1 (as the real one); per-layer input width 32 (real 256) differs from every
# other width. The KV-shared layers are the last whole periods (real E2B: 20 of 35, E4B 18 of 42), at least one.
TINY_E_OVERRIDES = {
    **{k: TINY_OVERRIDES[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "head_dim", "global_head_dim",
                                      "sliding_window", "max_position_embeddings", "initializer_range")},
    "num_attention_heads": 4,
    "hidden_size_per_layer_input": 32,
}
TINY_E_KV_HEADS = {"e2b": 1, "e4b": 2}
# The 26B-A4B replica: the 31B replica's numbers with the real 26B's MoE structure. 2 global KV heads as in the real
# one (tp <= 2); 8 experts of which 2 run per token (the real 128 / 8: the same 1/16 would leave a tiny model one
# expert, so the ratio is 1/4); the expert width is a quarter of the dense MLP's (real 704 / 2112 is a third) and
# divides tp; 8 experts divide the smoke mesh's fsdp=4.
TINY_MOE_OVERRIDES = {
    **TINY_OVERRIDES,
    "num_global_key_value_heads": 2,
    "num_experts": 8,
    "top_k_experts": 2,
    "moe_intermediate_size": 128,
}
TINY_LAYERS = {"31b": 6, "e2b": 10, "e4b": 12, "26b-a4b": 6}
# The tiny audio tower (E2B/E4B-it carry a 12-layer conformer, hidden 1024): present so every step meets
# `model.audio_tower.*` / `model.embed_audio.*` keys; nothing runs it.
TINY_AUDIO = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "subsampling_conv_channels": [8, 4],
    "output_proj_dims": 48,
    "initializer_range": 0.05,
}
SHARD_SIZE = "4MB"
BUILT_BY = "tiny_model.json"  # stamp: this directory is a cache that tiny.py may rebuild
FORMAT = 2  # 2: Gemma 4 tokenizer files and a vision tower (1: Gemma 3 turn tokens, text only)
VARIANT = "31b"  # whose chat template the replica carries: "31b" (26B/31B) or "e" (E2B/E4B)

# The tiny vision tower: the 31B-it's (27 layers, hidden 1152, 16 heads of 72) with smaller numbers. Nothing trains
# or runs it here; it is there so every step meets `model.vision_tower.*` / `model.embed_vision.*` keys as it will
# in the real checkpoint.
TINY_VISION = {
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "patch_size": 16,
    "pooling_kernel_size": 3,
    "position_embedding_size": 256,
    "initializer_range": 0.05,
}


def _period(variant: str) -> list[str]:
    types = TEXT_CONFIGS[variant]["layer_types"]
    return list(types[: types.index("full_attention") + 1])


def tiny_text_config(layers: int | None = None, variant: str = "31b") -> dict:
    """The tiny model's text config: the real ``variant``'s (31b, e2b, e4b) with smaller numbers, ``layers`` layers."""
    if variant not in TEXT_CONFIGS:
        raise ValueError(f"--variant must be one of {sorted(TEXT_CONFIGS)}, got {variant!r}.")
    layers = TINY_LAYERS[variant] if layers is None else layers
    e_model = variant in TINY_E_KV_HEADS
    period = _period(variant) if e_model else PATTERN
    shared_min = 1 if e_model else 0  # an E replica keeps at least one KV-shared period
    n_sliding = len(period) - 1
    if layers <= 0 or layers % len(period) or layers // len(period) <= shared_min:
        least = len(period) * (shared_min + 1)
        raise ValueError(
            f"--layers must be a positive multiple of {len(period)} for {variant} ({n_sliding} sliding + 1 global "
            f"pattern{', with one unshared and one KV-shared period at least' if shared_min else ''}), got {layers}. "
            f"Try {max(least, layers - layers % len(period))}."
        )
    real = TEXT_CONFIGS[variant]
    cfg = dict(real, **(TINY_E_OVERRIDES if e_model else TINY_MOE_OVERRIDES if variant == "26b-a4b"
                        else TINY_OVERRIDES))
    cfg["num_hidden_layers"] = layers
    cfg["layer_types"] = list(period) * (layers // len(period))
    cfg["vocab_size_per_layer_input"] = cfg["vocab_size"]
    if e_model:
        cfg["num_key_value_heads"] = TINY_E_KV_HEADS[variant]
        periods = layers // len(period)
        real_frac = real["num_kv_shared_layers"] / real["num_hidden_layers"]
        cfg["num_kv_shared_layers"] = len(period) * min(periods - 1, max(1, round(real_frac * periods)))
    cfg.pop("model_type")
    return cfg


def training_texts() -> list[str]:
    """Prompts and responses of the shipped Verilog data (the tokenizer's training corpus)."""
    path = paths.DATA_DIR / "verilog_sft.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [t for r in rows for t in (r["prompt"], r["response"])]


def special_vocab(vocab_size: int) -> tuple[dict[str, int], dict[str, int]]:
    """The replica's special tokens: Gemma 4's low ids at their real ids, the multimodal ones at the top.

    Returns ``(low, top)``, each token -> id. Ids below 107 that the published facts do not name hold ``<unusedN>``
    placeholders (the escape token takes the first free one), so every named token keeps its real id.
    """
    low = {tok: i for i, tok in chat_format.SPECIAL_TOKEN_IDS.items()}
    free = [i for i in range(chat_format.LAST_LOW_SPECIAL_ID + 1) if i not in chat_format.SPECIAL_TOKEN_IDS]
    low[chat_format.ESCAPE_TOKEN] = free.pop(0)
    low.update({f"<unused{i}>": i for i in free})
    mm = chat_format.MULTIMODAL_TOKENS
    top = {tok: vocab_size - len(mm) + k for k, (_, _, tok) in enumerate(mm)}
    return dict(sorted(low.items(), key=lambda kv: kv[1])), top


def build_tokenizer(vocab_size: int, variant: str = VARIANT):
    """A ``GemmaTokenizer`` built the way transformers' Gemma 4 conversion builds the real one.

    BPE with byte fallback, spaces as ``▁`` (GemmaTokenizer's own pipeline), trained on the shipped Verilog data;
    the special tokens at their real ids (:func:`special_vocab`), the 256 byte tokens, the named tokens of the real
    ``tokenizer_config.json``, ``add_bos_token`` false (the chat template writes ``<bos>``) and left padding.
    ``variant`` picks the chat template: ``"31b"`` (empty thought channel in the generation prompt) or ``"e"``.
    """
    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import GemmaTokenizer

    low, top = special_vocab(vocab_size)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    learned = vocab_size - len(low) - len(byte_tokens) - len(top)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.train_from_iterator(training_texts(), trainer=trainers.BpeTrainer(vocab_size=learned, show_progress=False))
    model = json.loads(tok.to_str())["model"]
    if len(model["vocab"]) != learned:
        raise RuntimeError(f"BPE training gave {len(model['vocab'])} tokens, not {learned}: the shipped data is too "
                           f"small for vocab_size={vocab_size}.")
    vocab = dict(low)
    for t in byte_tokens + sorted(model["vocab"], key=model["vocab"].get):
        vocab[t] = len(vocab)
    vocab.update(top)
    return GemmaTokenizer(
        vocab=vocab,
        merges=[tuple(m) for m in model["merges"]],
        add_bos_token=False,
        padding_side="left",
        extra_special_tokens=dict(chat_format.NAMED_TOKENS),
        chat_template=chat_format.CHAT_TEMPLATES[variant],
    )


def write_tokenizer_files(tokenizer, out_dir: Path) -> None:
    """Save the tokenizer with the real checkpoint's file set: no ``special_tokens_map.json`` or ``tokenizer.model``,
    the template in ``chat_template.jinja`` and no ``chat_template`` key in ``tokenizer_config.json``."""
    tokenizer.save_pretrained(out_dir)
    for name in chat_format.ABSENT_FILES:
        (out_dir / name).unlink(missing_ok=True)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    template = cfg.pop("chat_template", None)
    if template is not None:
        (out_dir / "chat_template.jinja").write_text(template)
    cfg.update(chat_format.TOKENIZER_CONFIG)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def write_processor_config(out_dir: Path) -> None:
    (out_dir / "processor_config.json").write_text(json.dumps(chat_format.PROCESSOR_CONFIG, indent=2) + "\n")


def _prepare_out(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():  # never replaced, even with overwrite: it is not a checkpoint
        raise OutputExistsError(f"{out_dir} is a file, not a directory; give a new directory name for the "
                                f"checkpoint (the file is left as it is).")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise OutputExistsError(f"{out_dir} already holds files; pass overwrite=True to replace them.",
                                params=("overwrite",))


def _with_unused_shared_kv(model, text_cfg: dict) -> dict:
    """The state dict with k_proj / v_proj / k_norm on the KV-shared layers, as the released E checkpoints keep them.

    transformers builds no such modules (those layers read an earlier layer's K/V) and lists exactly these keys in
    ``_keys_to_ignore_on_load_unexpected``, which is there for files that hold them; tunix's loader needs them (its
    shared layers keep the parameters and ignore them). Random, like the rest of the replica; nothing reads them.
    """
    import torch

    sd = model.state_dict()
    gen = torch.Generator().manual_seed(len(sd))
    for i in kv_shared_layers(text_cfg):
        full = text_cfg["layer_types"][i] == "full_attention"
        head = text_cfg["global_head_dim"] if full else text_cfg["head_dim"]
        out = text_cfg["num_key_value_heads"] * head
        pre = f"{KEY_PREFIX}layers.{i}.self_attn."
        for name in ("k_proj", "v_proj"):
            w = torch.randn(out, text_cfg["hidden_size"], generator=gen) * text_cfg["initializer_range"]
            sd[pre + name + ".weight"] = w
        sd[pre + "k_norm.weight"] = torch.ones(head)
    return sd


def _randomize_moe_scales(model, seed: int) -> None:
    """Give the MoE block's scales and norms random values near 1 (transformers initialises them to exactly 1).

    A trained checkpoint's are not 1, and with all of them 1 an implementation that feeds the router the wrong
    tensor (the normed one instead of the residual), or applies ``per_expert_scale`` in the wrong place, gives the
    same logits: parity on the replica would then prove nothing about the real model."""
    import torch

    gen = torch.Generator().manual_seed(seed + 4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in (".router.scale", ".router.per_expert_scale", "feedforward_layernorm_1.",
                                              "feedforward_layernorm_2.")):
                p.copy_(1 + 0.5 * (torch.rand(p.shape, generator=gen) - 0.5))


def write_tiny_model(out_dir: str | Path, seed: int = 0, layers: int | None = None, overwrite: bool = False,
                     variant: str = "31b") -> Path:
    """Write the tiny Gemma 4 checkpoint + tokenizer to ``out_dir`` (atomically: temp dir, then rename).

    ``variant`` "31b" (default) replicates gemma-4-31B-it; "e2b" / "e4b" replicate the E models (per-layer input
    embeddings, KV-shared last layers, E2B's doubled MLP there, audio tower, the E chat template); "26b-a4b" the
    mixture of experts (router and 3-D expert tensors beside the dense MLP, the 31B's chat template)."""
    import torch
    from transformers import (
        Gemma4AudioConfig,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4TextConfig,
        Gemma4VisionConfig,
        GenerationConfig,
    )

    out_dir = file_io.absolute_path(out_dir, "output directory")
    text_cfg = tiny_text_config(layers, variant)  # validates layers before anything is written
    layers = text_cfg["num_hidden_layers"]
    _prepare_out(out_dir, overwrite)
    tmp = file_io.temp_dir_beside(out_dir)
    try:
        e_model = variant in TINY_E_KV_HEADS
        tokenizer = build_tokenizer(text_cfg["vocab_size"], "e" if e_model else "31b")
        gen = chat_format.GENERATION_CONFIG
        text_cfg.update(pad_token_id=gen["pad_token_id"], bos_token_id=gen["bos_token_id"],
                        eos_token_id=gen["eos_token_id"][0])
        _, top = special_vocab(text_cfg["vocab_size"])
        mm_ids = {name: top[tok] for name, _, tok in chat_format.MULTIMODAL_TOKENS}
        config = Gemma4Config(text_config=Gemma4TextConfig(**text_cfg), vision_config=Gemma4VisionConfig(**TINY_VISION),
                              audio_config=Gemma4AudioConfig(**TINY_AUDIO) if e_model else None, **mm_ids)
        torch.manual_seed(seed)
        model = Gemma4ForConditionalGeneration(config).eval()
        _randomize_moe_scales(model, seed)
        model.save_pretrained(tmp, max_shard_size=SHARD_SIZE, state_dict=_with_unused_shared_kv(model, text_cfg))
        GenerationConfig(**gen).save_pretrained(tmp)
        write_tokenizer_files(tokenizer, tmp)
        write_processor_config(tmp)
        stamp = {"seed": seed, "layers": layers, "format": FORMAT, **({} if variant == "31b" else {"variant": variant})}
        (tmp / BUILT_BY).write_text(json.dumps(stamp) + "\n")
        file_io.install_dir(tmp, out_dir)  # _prepare_out refused an existing one unless overwrite
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def ensure_tiny_model(out_dir: str | Path, seed: int = 0, layers: int | None = None, variant: str = "31b") -> Path:
    """The cached tiny checkpoint in ``out_dir``, built on first use (how notebooks stay standalone). Processes that
    ask for it at once (two notebooks) build it once: the others wait, then find it (``file_io.locked``)."""
    out_dir = Path(out_dir)
    with file_io.locked(out_dir, "the tiny model"):
        return _cached_or_built(out_dir, seed, layers, variant)


def _cached_or_built(out_dir: Path, seed: int, layers: int | None, variant: str) -> Path:
    if (out_dir / "model.safetensors.index.json").is_file():
        cfg = json.loads((out_dir / "config.json").read_text())["text_config"]
        wanted = tiny_text_config(layers, variant)
        stale = {k for k in (*TINY_MOE_OVERRIDES, *TINY_E_OVERRIDES, "num_hidden_layers", "num_kv_shared_layers",
                             "hidden_size_per_layer_input") if cfg.get(k) != wanted.get(k)}
        stamp = out_dir / BUILT_BY
        if stamp.is_file():
            built = json.loads(stamp.read_text())
            stale |= {k for k, v in (("seed", seed), ("format", FORMAT)) if built.get(k) != v}
            if built.get("variant", "31b") != variant:
                stale.add("variant")
        if not stale:
            return out_dir
        if not (out_dir / BUILT_BY).is_file():
            raise OutputExistsError(f"{out_dir} holds a model that differs from the tiny one in {sorted(stale)} and "
                                    f"was not built by tiny.py; remove it or pass another directory.")
        print(f"{out_dir}: cached tiny model is stale ({', '.join(sorted(stale))} changed); rebuilding it.")
    return write_tiny_model(out_dir, seed=seed, layers=layers, overwrite=True, variant=variant)


def config_comparison(layers: int = 6):
    """The 31B's text config beside the tiny one's (pandas), for the fields that differ or matter."""
    import pandas as pd

    tiny = tiny_text_config(layers)
    rows = []
    for key, big in GEMMA4_31B_TEXT_CONFIG.items():
        if key in ("model_type", "rope_parameters"):
            continue
        small = tiny.get(key)
        if key == "layer_types":
            big, small = f"{big.count('sliding_attention')} sliding : {big.count('full_attention')} full", \
                f"{small.count('sliding_attention')} sliding : {small.count('full_attention')} full"
        rows.append({"field": key, "gemma-4-31B": big, "tiny": small, "same": big == small})
    return pd.DataFrame(rows)
