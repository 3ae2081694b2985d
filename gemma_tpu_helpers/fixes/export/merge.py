"""Merge a trained LoRA from tunix's Orbax checkpoints into the base's sharded safetensors, streamed.

:func:`merge_lora` restores only the LoRA arrays (:mod:`lora_checkpoint`), plans one ΔW per HF tensor
(:mod:`merge_plan`) and streams the base one shard at a time (:mod:`safetensors_io`), so peak memory is the LoRA
plus a few blocks. Everything is written to a temporary directory beside ``out_dir`` and renamed at the end: a crash
never leaves a directory that looks complete. ``merge_info.json`` records what was merged.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
import warnings
from pathlib import Path

from tqdm.auto import tqdm

from ..core.errors import GemmaTpuError
from ..core.file_io import absolute_path, config_hash, install_dir, path_id, temp_dir_beside
from ..model import hf_checkpoint
from ..train import lora_checkpoint
from . import merge_plan, safetensors_io

SKIP_FILES = {"tiny_model.json"}  # a tiny replica's cache stamp: the merged dir is not that cache


class MergeError(GemmaTpuError, ValueError):
    """A merge that cannot run as asked (another host than process 0, an unknown kernel, a LoRA that does not fit)."""


class OutputExistsError(MergeError, FileExistsError):
    pass


def _return_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim; a no-op elsewhere): freed buffers leave the RSS."""
    import ctypes.util  # binds ctypes too

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _copy_extras(base_dir: Path, dst: Path, shard_names) -> list[str]:
    """Copy everything that is not a weight (config, generation config, tokenizer, chat template ...)."""
    copied = []
    for p in sorted(base_dir.iterdir()):
        if p.name in shard_names | SKIP_FILES | {hf_checkpoint.INDEX, hf_checkpoint.MERGE_INFO} \
                or p.name.endswith(".safetensors") or p.name.startswith("."):
            continue
        (shutil.copytree if p.is_dir() else shutil.copy2)(p, dst / p.name)
        copied.append(p.name)
    return copied


def prepare_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse a ``out_dir`` that is a file, or a non-empty directory without ``overwrite`` (ask before building)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputExistsError(f"{out_dir} exists and is not a directory.")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise OutputExistsError(f"{out_dir} is not empty; pass overwrite=True to replace it.", params=("overwrite",))


@dataclasses.dataclass
class MergeResult:
    out_dir: Path
    step: int
    shards: int
    merged_tensors: int
    copied_tensors: int
    bytes: int
    seconds: float
    info: dict

    def summary(self) -> dict:
        return {"out_dir": str(self.out_dir), "step": self.step, "shards": self.shards,
                "merged tensors": self.merged_tensors, "copied tensors": self.copied_tensors,
                "GB written": round(self.bytes / 1e9, 4), "seconds": round(self.seconds, 2)}


def _by_tensor(deltas: list, entries: dict) -> dict[str, merge_plan.Delta]:
    """The LoRA's updates by the base tensor each changes; one that the base lacks, or two on one tensor, stop it."""
    by_name: dict[str, merge_plan.Delta] = {}
    for d in deltas:
        if d.hf in by_name:
            raise MergeError(f"{d.hf} would get two LoRA updates ({by_name[d.hf].module} and {d.module}).")
        if d.hf not in entries:
            raise MergeError(f"{d.hf} (LoRA of {d.module}) is not in the base checkpoint: wrong base model.")
        if tuple(entries[d.hf]["shape"]) != d.shape:
            raise MergeError(f"{d.hf}: base shape {tuple(entries[d.hf]['shape'])}, LoRA gives {d.shape}: the base is "
                             f"another model (other heads/widths) than the one trained on.")
        by_name[d.hf] = d
    return by_name


def _write_shards(base_dir: Path, tmp: Path, shards: dict, by_name: dict, kernel: str, ones: list,
                  progress: bool) -> tuple[dict[str, float], int]:
    """Every merged shard written into ``tmp``, each update applied once: ({tensor: max |ΔW|}, bytes written)."""
    applied, total = {}, 0
    bar = tqdm(sorted(shards), desc="merging shards", unit="shard", disable=not progress)
    for shard in bar:
        bar.set_postfix_str(shard)
        todo = {n: by_name[n] for n in shards[shard] if n in by_name}
        got = safetensors_io.write_merged_shard(base_dir / shard, tmp / shard, todo, kernel, set(ones))
        twice = set(got) & set(applied)
        if twice or set(got) != set(todo):
            raise MergeError(f"{shard}: applied {sorted(got)} but expected {sorted(todo)}"
                             + (f"; {sorted(twice)} twice" if twice else ""))
        applied.update(got)
        _return_freed_memory()
        header, _ = safetensors_io.read_header(tmp / shard)
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    if set(applied) != set(by_name):
        raise MergeError(f"LoRA updates never applied: {sorted(set(by_name) - set(applied))[:5]}")
    return applied, total


def merge_lora(base_dir: str | Path, checkpoint_dir: str | Path, out_dir: str | Path, step: int | None = None,
               overwrite: bool = False, progress: bool = True, kernel: str = "xla",
               fold_expert_scale: bool = True) -> MergeResult:
    """Merge the LoRA of ``checkpoint_dir`` (latest step, or ``step``) into ``base_dir``; write ``out_dir``.
    ``kernel``: "xla" (XLA on the host CPU) or "numpy"; ``fold_expert_scale``: merge_plan.fold_expert_scales (MoE).
    Raises before writing anything: ``LoraCheckpointError``, ``SafetensorsError``, ``LoraMismatchError``,
    :class:`MergeError`, :class:`OutputExistsError` (a non-empty ``out_dir`` without ``overwrite``). A failure while
    writing (e.g. a full disk) removes the temp dir and leaves ``out_dir`` as it was.
    """
    # A host-side step: in a multi-process program, call it from one process only (it reads every host's shards).
    if kernel not in safetensors_io.MERGE_KERNELS:
        raise MergeError(f"kernel must be one of {safetensors_io.MERGE_KERNELS}, got {kernel!r}.")
    started = time.perf_counter()
    base_dir = absolute_path(base_dir, "base directory")
    checkpoint_dir = absolute_path(checkpoint_dir, "checkpoint directory", remote=True)
    out_dir = absolute_path(out_dir, "output directory")
    prepare_out_dir(out_dir, overwrite)
    index, shards, entries = safetensors_io.base_layout(base_dir)
    text = hf_checkpoint.read_text_config(base_dir)
    meta = lora_checkpoint.read_lora_config(checkpoint_dir)
    step, arrays = lora_checkpoint.restore_lora(checkpoint_dir, step)
    _return_freed_memory()  # TensorStore's read buffers: the peak RSS is then the LoRA + a few blocks
    by_name = _by_tensor(merge_plan.plan_merge(arrays, meta, text), entries)
    lora_names, read = set(by_name), lambda n: safetensors_io.read_tensor(base_dir, index, n)
    by_name, ones = merge_plan.fold_expert_scales(by_name, entries, read) if fold_expert_scale else (by_name, [])
    cfg_hash = config_hash(text)
    if meta.get("base_config_sha256") and meta["base_config_sha256"] != cfg_hash:
        warnings.warn(f"{base_dir}/config.json differs from the config the LoRA was trained on (hash "
                      f"{cfg_hash} vs {meta['base_config_sha256']}); every shape fits, so merging anyway.")

    tmp = temp_dir_beside(out_dir)
    try:
        applied, total = _write_shards(base_dir, tmp, shards, by_name, kernel, ones, progress)
        out_index = {"metadata": {**index.get("metadata", {}), "total_size": total}, "weight_map": index["weight_map"]}
        if (base_dir / hf_checkpoint.INDEX).is_file():
            (tmp / hf_checkpoint.INDEX).write_text(json.dumps(out_index, indent=2) + "\n")
        copied = _copy_extras(base_dir, tmp, set(shards))
        info = {"base_dir": path_id(base_dir), "checkpoint_dir": path_id(checkpoint_dir), "step": step,
                "lora": {k: meta.get(k) for k in ("targets", "rank", "alpha", "base_model", "base_config_sha256")},
                "scale": float(meta["alpha"]) / int(meta["rank"]), "lora_sha256": lora_checkpoint.lora_digest(arrays),
                "base_config_sha256": cfg_hash, "merged_tensors": len(lora_names), "fold_expert_scale": bool(ones),
                "copied_tensors": len(entries) - len(applied) - len(ones), "total_size": total,
                "copied_files": copied, "max_abs_delta": max(applied.values(), default=0.0), "kernel": kernel,
                "shards": sorted(shards), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "seconds": round(time.perf_counter() - started, 2)}  # so far: every shard written, LoRA restored
        (tmp / hf_checkpoint.MERGE_INFO).write_text(json.dumps(info, indent=1) + "\n")
        install_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return MergeResult(out_dir, step, len(shards), len(lora_names), info["copied_tensors"], total,
                       time.perf_counter() - started, info)


def read_merge_info(merged_dir: str | Path) -> dict | None:
    p = Path(merged_dir) / hf_checkpoint.MERGE_INFO
    return json.loads(p.read_text()) if p.is_file() else None
