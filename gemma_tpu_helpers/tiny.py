"""The tiny Gemma 4: random weights, the 31B's structure, the real checkpoint format.

Its config is :data:`gemma4.GEMMA4_31B_TEXT_CONFIG` with smaller numbers (same fields, same 5:1 sliding/global
pattern, k=v global layers with fewer KV heads, softcap, tied embedding), saved by
``Gemma4ForConditionalGeneration`` so the keys sit under ``model.language_model.`` in several safetensors shards
with an index, as in ``google/gemma-4-31B-it``. A byte-level BPE tokenizer is trained on the shipped Verilog
data, with Gemma's special tokens and turn-based chat template.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from .gemma4 import GEMMA4_31B_TEXT_CONFIG, PATTERN

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
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
END_OF_TURN = "<end_of_turn>"
SHARD_SIZE = "4MB"
BUILT_BY = "tiny_model.json"  # stamp: this directory is a cache that tiny.py may rebuild

# Gemma's turn format. Gemma has no system role: a system message is folded into the first user turn.
# {% generation %} marks the assistant's tokens, so `return_assistant_tokens_mask=True` gives the loss mask.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<start_of_turn>model\n' }}{% generation %}{{ message['content'] + '<end_of_turn>' }}{% endgeneration %}{{ '\n' }}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + message['role'] + '\n' + (first_user_prefix if loop.first else '') "
    "+ message['content'] + '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


class OutputExistsError(FileExistsError):
    pass


def tiny_text_config(layers: int = 6) -> dict:
    """The tiny model's text config: the 31B's with smaller numbers and ``layers`` layers."""
    if layers <= 0 or layers % len(PATTERN):
        raise ValueError(
            f"--layers must be a positive multiple of {len(PATTERN)} (Gemma 4's 5 sliding + 1 global pattern), "
            f"got {layers}. Try {max(len(PATTERN), layers - layers % len(PATTERN))}."
        )
    cfg = dict(GEMMA4_31B_TEXT_CONFIG, **TINY_OVERRIDES)
    cfg["num_hidden_layers"] = layers
    cfg["layer_types"] = list(PATTERN) * (layers // len(PATTERN))
    cfg["vocab_size_per_layer_input"] = cfg["vocab_size"]
    cfg.pop("model_type")
    return cfg


def training_texts() -> list[str]:
    """Prompts and responses of the shipped Verilog data (the tokenizer's training corpus)."""
    path = Path(__file__).parent / "data" / "verilog_sft.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [t for r in rows for t in (r["prompt"], r["response"])]


def build_tokenizer(vocab_size: int):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with Gemma's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_texts(), trainer=trainer)
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        extra_special_tokens=["<start_of_turn>", END_OF_TURN],
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _prepare_out(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise OutputExistsError(f"{out_dir} already holds files; pass --overwrite (overwrite=True) to replace them.")


def write_tiny_model(out_dir: str | Path, seed: int = 0, layers: int = 6, overwrite: bool = False) -> Path:
    """Write the tiny Gemma 4 checkpoint + tokenizer to ``out_dir`` (atomically: temp dir, then rename)."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig, GenerationConfig

    out_dir = Path(out_dir)
    text_cfg = tiny_text_config(layers)  # validates layers before anything is written
    _prepare_out(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tokenizer = build_tokenizer(text_cfg["vocab_size"])
        special = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<pad>", "<eos>", "<bos>", END_OF_TURN)}
        text_cfg.update(pad_token_id=special["<pad>"], eos_token_id=special["<eos>"], bos_token_id=special["<bos>"])
        config = Gemma4Config(text_config=Gemma4TextConfig(**text_cfg), vision_config=None, audio_config=None)
        torch.manual_seed(seed)
        model = Gemma4ForConditionalGeneration(config).eval()
        model.save_pretrained(tmp, max_shard_size=SHARD_SIZE)
        GenerationConfig(
            bos_token_id=special["<bos>"],
            eos_token_id=[special["<eos>"], special[END_OF_TURN]],
            pad_token_id=special["<pad>"],
            do_sample=False,
        ).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / BUILT_BY).write_text(json.dumps({"seed": seed, "layers": layers}) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def ensure_tiny_model(out_dir: str | Path, seed: int = 0, layers: int = 6) -> Path:
    """The cached tiny checkpoint in ``out_dir``, built on first use (how notebooks stay standalone)."""
    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors.index.json").is_file():
        cfg = json.loads((out_dir / "config.json").read_text())["text_config"]
        wanted = tiny_text_config(layers)
        stale = {k for k in (*TINY_OVERRIDES, "num_hidden_layers") if k in cfg and cfg[k] != wanted[k]}
        stamp = out_dir / BUILT_BY
        if stamp.is_file() and json.loads(stamp.read_text()).get("seed") != seed:
            stale.add("seed")
        if not stale:
            return out_dir
        if not (out_dir / BUILT_BY).is_file():
            raise OutputExistsError(f"{out_dir} holds a model that differs from the tiny one in {sorted(stale)} and "
                                    f"was not built by tiny.py; remove it or pass another directory.")
        print(f"{out_dir}: cached tiny model is stale ({', '.join(sorted(stale))} changed); rebuilding it.")
    return write_tiny_model(out_dir, seed=seed, layers=layers, overwrite=True)


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
