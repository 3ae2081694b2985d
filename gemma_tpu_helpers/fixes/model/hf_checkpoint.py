"""A Hugging Face Gemma 4 checkpoint, read without loading it: its text config and what it says about each layer
(sliding or global, KV sharing), and its files checked (the index against every shard's header).

A damaged or foreign file is a :class:`CheckpointError` of one line that names the file and how to get it back.
Standard library only: a merge, a server or a plan reads a checkpoint here without JAX or tunix.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ..core.errors import GemmaTpuError

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
        raise damaged(f"{path} is not a JSON object (truncated or damaged); {refetch_hint(model_dir)}.",
                      model_dir) from None
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


INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header


# merge.merge_lora writes it last, inside its temp dir: a merged directory without it is not one
MERGE_INFO = "merge_info.json"


def refetch_hint(model_dir: str | Path) -> str:
    """How to get a damaged file of ``model_dir`` back: run the merge again for a merged model, else copy or
    download it again."""
    d = Path(model_dir)
    if (d / MERGE_INFO).is_file():
        return f"run the merge again into {d} (overwrite=True)"
    return (f"copy or download it again (`hf download REPO --local-dir {d}` fetches what is missing or "
            f"damaged; delete the damaged file first)")


def damaged(message: str, model_dir: str | Path) -> CheckpointError:
    """The error for a damaged file of ``model_dir``, ``message`` ending in :func:`refetch_hint`'s fix: its ``path``
    the directory, its ``params`` what the fix names."""
    merged = (Path(model_dir) / MERGE_INFO).is_file()
    return CheckpointError(message, params=("overwrite",) if merged else (), path=Path(model_dir))


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
        raise damaged(f"{path} cannot be read ({e.strerror or e}); {fix}.", path.parent) from e
    if n is None:
        raise damaged(f"{path} is truncated or not a safetensors file ({size} bytes, shorter than the "
                      f"8-byte header length); {fix}.", path.parent)
    if n == 0 or n > MAX_HEADER_BYTES:
        raise damaged(f"{path} is not a safetensors file (its first 8 bytes give a header length of "
                      f"{n:,} bytes); {fix}.", path.parent)
    if 8 + n > size:
        raise damaged(f"{path} is truncated: {size:,} bytes, fewer than its own header needs "
                      f"({8 + n:,}); an interrupted copy or download. {fix[0].upper()}{fix[1:]}.", path.parent)
    try:
        header = json.loads(text)
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):  # not JSON, or not safetensors' header
        raise damaged(f"{path} is not a safetensors file (its header is not a safetensors JSON header); "
                      f"{fix}.", path.parent) from None
    need = 8 + n + max(ends, default=0)
    if need > size:
        raise damaged(f"{path} is truncated: {size:,} bytes of the {need:,} its header describes; an "
                      f"interrupted copy or download. {fix[0].upper()}{fix[1:]}.", path.parent)
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
            raise damaged(f"{index_path} is not a safetensors index (no JSON weight_map: truncated or "
                          f"damaged); {fix}.", model_dir) from None
    elif (model_dir / "model.safetensors").is_file():  # a single-file checkpoint: same code, one shard
        header, _ = read_shard_header(model_dir / "model.safetensors")
        weight_map = {k: "model.safetensors" for k in header if k != "__metadata__"}
        index = {"metadata": {}, "weight_map": weight_map}
    else:
        raise damaged(f"{model_dir} has no {INDEX} (nor a single model.safetensors): cannot tell which "
                      f"shard holds which tensor. {fix[0].upper()}{fix[1:]}, with its index.", model_dir)
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, []).append(name)
    entries = {}
    for shard, names in shards.items():
        path = model_dir / shard
        if not path.is_file():
            raise damaged(f"{INDEX} names shard {shard}, which is missing from {model_dir}; {fix}.", model_dir)
        header, _ = read_shard_header(path)
        for name in names:
            if name not in header:
                raise damaged(f"{index_path} puts {name} in {shard}, but that shard's header does not hold "
                              f"it: the index and the shards are from different copies. "
                              f"{fix[0].upper()}{fix[1:]}.", model_dir)
            entries[name] = header[name]
    return index, shards, entries
