"""Merge a trained LoRA from tunix's Orbax checkpoints into the base's sharded safetensors, streamed (notebook 07).

The paper's merge loaded every base shard into RAM (about 62 GB for the 31B in bf16), restored the whole trained model
on the accelerator, and wrote one ``model.safetensors``. Here:

- **Only the LoRA arrays** are restored from ``<checkpoints>/<step>/model_params`` (what tunix's ``PeftTrainer``
  saves: the ``nnx.LoRAParam`` state), as host numpy arrays. No model, no accelerator, no mesh. On a multi-host run
  the checkpoint was written by several processes; Orbax reassembles each global array when it restores it as a
  numpy array, so one host (any machine that can read the checkpoint directory) merges it alone.
- Rank, alpha and targets come from ``<checkpoints>/lora_config.json`` (written by training), never from flags.
- The base is **streamed one shard at a time**: each output shard gets the input shard's header (the merged tensors
  keep their dtype and shape, so every offset stays valid); untouched tensors are copied byte for byte, and each
  targeted tensor is read alone, gets ``ΔW = (alpha/rank)·(A·B)ᵀ`` computed in fp32, and is rounded once to the
  base dtype, in row blocks of ~1M elements, each one XLA computation on the host CPU (the same arithmetic as the
  numpy reference, ``kernel="numpy"``). Peak memory is the LoRA arrays plus a few blocks, not a shard, let alone
  the model. Shard names and
  ``model.safetensors.index.json`` are kept; config, generation config, tokenizer and chat template are copied.
- Everything is written to a temporary directory next to ``out_dir`` and renamed at the end, so a crash (a full
  disk, a kill) never leaves a directory that looks complete. ``merge_info.json`` records what was merged.
- :func:`verify` checks the result against transformers and tunix; :func:`export_peft_adapter` writes the same LoRA
  as an unmerged PEFT adapter (for ``vllm --enable-lora`` and ``peft.PeftModel``).

Layouts (tunix 0.1.7 / qwix 0.1.8; HF weights are ``[out, in]``; ``A2 = A.reshape(-1, r)``, ``B2 = B.reshape(r, -1)``):

===================================  ==============  =============  ==========================================
tunix LoRA module                    A               B              HF tensor(s) and ΔW / scale
===================================  ==============  =============  ==========================================
``layers/i/attn/q_einsum/w``         (D, r)          (r, N, H)      ``q_proj``: (A2·B2)ᵀ  [N·H, D]
``layers/i/attn/kv_einsum/w``        (D, r)          (r, 2, K, H)   ``k_proj``: (A·B[:,0])ᵀ, ``v_proj``: (A·B[:,1])ᵀ
``layers/i/attn/k_einsum/w``         (D, r)          (r, K, H)      ``k_proj`` only (global k=v layer: no v_proj)
``layers/i/attn/attn_vec_einsum/w``  (N, H, r)       (r, D)         ``o_proj``: (A2·B2)ᵀ  [D, N·H]
``layers/i/mlp/{gate,up}_proj/kernel``  (D, r)       (r, F)         ``{gate,up}_proj``: (A·B)ᵀ  [F, D]
``layers/i/mlp/down_proj/kernel``    (F, r)          (r, D)         ``down_proj``: (A·B)ᵀ  [D, F]
===================================  ==============  =============  ==========================================
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from .gemma4 import KEY_PREFIX

METADATA = "lora_config.json"  # = train.METADATA (not imported: train pulls in more than a merge needs)
INDEX = "model.safetensors.index.json"
MERGE_INFO = "merge_info.json"  # written last, inside the temp dir: a merged dir without it is not ours
PARAMS_ITEM = "model_params"
SKIP_FILES = {"tiny_model.json"}  # tiny.py's cache stamp: the merged dir is not a tiny.py cache
COPY_CHUNK = 64 << 20
# Elements per row block of a merged tensor (~4 MB of fp32 ΔW): big enough to amortise one XLA call, small enough
# to stay in the caches and keep the memory bounded whatever the tensor's size.
MERGE_BLOCK_ELEMENTS = 1 << 20
MERGE_KERNELS = ("xla", "numpy")  # how targeted tensors are merged: XLA on the host CPU, or the numpy reference


class MergeError(ValueError):
    """A checkpoint, base or output directory that cannot be merged (the message says which and why)."""


class OutputExistsError(MergeError, FileExistsError):
    pass


# ---------------------------------------------------------------------------------------------------------------
# The Orbax side: steps, metadata, LoRA arrays

def list_steps(checkpoint_dir: str | Path) -> list[int]:
    d = Path(checkpoint_dir)
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and p.is_dir()) if d.is_dir() else []


def resolve_step(checkpoint_dir: str | Path, step: int | None = None) -> tuple[int, Path]:
    """``(step, <checkpoint_dir>/<step>/model_params)``; the latest step by default. Raises MergeError."""
    d = Path(checkpoint_dir)
    if not d.is_dir():
        raise MergeError(f"Checkpoint directory {d} does not exist (train first: `python -m gemma_tpu_helpers train`).")
    steps = list_steps(d)
    if not steps:
        raise MergeError(f"{d} holds no Orbax step directories (<step>/{PARAMS_ITEM}); train first, or pass the "
                         f"`checkpoints` folder of a run.")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise MergeError(f"{d} has no step {step}; its steps are {steps}.")
    item = d / str(step) / PARAMS_ITEM
    if not item.is_dir():
        raise MergeError(f"{d / str(step)} has no {PARAMS_ITEM}/ (an unfinished or foreign checkpoint); "
                         f"steps present: {steps}.")
    return step, item


def read_lora_config(checkpoint_dir: str | Path) -> dict:
    """``lora_config.json`` written by training: targets, rank, alpha, ... (the only source of rank and alpha)."""
    if not Path(checkpoint_dir).is_dir():
        resolve_step(checkpoint_dir)  # raises the "does not exist" error
    path = Path(checkpoint_dir) / METADATA
    if not path.is_file():
        raise MergeError(f"{path} is missing: the checkpoint does not say which LoRA it holds (rank, alpha, targets). "
                         f"Checkpoints written by `gemma_tpu_helpers train` have it.")
    meta = json.loads(path.read_text())
    missing = [k for k in ("targets", "rank", "alpha") if k not in meta]
    if missing:
        raise MergeError(f"{path} lacks {missing}.")
    return meta


def _flatten(tree, prefix=()) -> dict[str, object]:
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flatten(v, (*prefix, str(k))))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_flatten(v, (*prefix, str(i))))
    else:
        out["/".join(prefix)] = tree
    return out


def _strip_value(path: str) -> str:
    return path[: -len("/value")] if path.endswith("/value") else path


def restore_lora(checkpoint_dir: str | Path, step: int | None = None) -> tuple[int, dict[str, np.ndarray]]:
    """``(step, {"layers/0/attn/q_einsum/w_lora_a": array, ...})``: the LoRA params as host numpy arrays.

    Reads only ``<step>/model_params`` (not the optimizer state), with every leaf restored as ``np.ndarray``: no
    device, no mesh, no sharding. A checkpoint written by several processes (multi-host training) restores the same
    way: Orbax reassembles each global array from the pieces the processes wrote.
    """
    import orbax.checkpoint as ocp

    step, item = resolve_step(checkpoint_dir, step)
    ckptr = ocp.PyTreeCheckpointer()
    try:
        meta = ckptr.metadata(item)
        tree_meta = getattr(meta, "item_metadata", None) or getattr(meta, "tree", None) or meta
        restore_args = _map_leaves(tree_meta, lambda _: ocp.RestoreArgs(restore_type=np.ndarray))
        tree = ckptr.restore(item, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    except MergeError:
        raise
    except Exception as e:  # truncated / corrupt directories fail in many ways inside Orbax and TensorStore
        raise MergeError(f"Could not restore the LoRA params from {item}: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}. The checkpoint is incomplete or damaged; "
                         f"pick another step (steps: {list_steps(checkpoint_dir)}) or retrain.") from e
    flat = {_strip_value(k): np.asarray(v) for k, v in _flatten(_to_plain(tree)).items()}
    if not flat:
        raise MergeError(f"{item} holds no arrays.")
    return step, flat


def _to_plain(tree):
    """nnx.State / mappings / sequences -> plain nested dicts (orbax may hand back State-like mappings)."""
    if hasattr(tree, "to_pure_dict"):
        tree = tree.to_pure_dict()
    if isinstance(tree, dict) or (hasattr(tree, "items") and not isinstance(tree, np.ndarray)):
        return {k: _to_plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_to_plain(v) for v in tree]
    return tree


def _map_leaves(tree, fn):
    if isinstance(tree, dict) or (hasattr(tree, "items") and not hasattr(tree, "shape")):
        return {k: _map_leaves(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_leaves(v, fn) for v in tree)
    return fn(tree)


# ---------------------------------------------------------------------------------------------------------------
# The mapping: tunix LoRA modules -> HF tensors

_MODULE_RE = re.compile(r"^layers/(\d+)/(attn/(?:q_einsum|kv_einsum|k_einsum|attn_vec_einsum)|"
                        r"mlp/(?:gate_proj|up_proj|down_proj))/(\w+)_lora_([ab])$")
_HF_OF = {"attn/q_einsum": ("q_proj",), "attn/kv_einsum": ("k_proj", "v_proj"), "attn/k_einsum": ("k_proj",),
          "attn/attn_vec_einsum": ("o_proj",), "mlp/gate_proj": ("gate_proj",), "mlp/up_proj": ("up_proj",),
          "mlp/down_proj": ("down_proj",)}


def hf_name(layer: int, target: str) -> str:
    part = "mlp" if target.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"
    return f"{KEY_PREFIX}layers.{layer}.{part}.{target}.weight"


@dataclasses.dataclass
class Delta:
    """One HF tensor's LoRA update: ΔW = scale · (A2 · B2)ᵀ, with A2 (in, r) and B2 (r, out)."""

    hf: str  # full HF tensor name
    module: str  # tunix module path, e.g. layers/3/attn/kv_einsum
    target: str  # HF target name (q_proj ...)
    a: np.ndarray  # (in, r)
    b: np.ndarray  # (r, out)
    scale: float
    note: str = ""

    @property
    def shape(self) -> tuple[int, int]:  # HF [out, in]
        return (self.b.shape[1], self.a.shape[0])

    def delta(self) -> np.ndarray:
        """ΔW in fp32, HF layout [out, in]."""
        return (np.float32(self.scale) * (self.a.astype(np.float32) @ self.b.astype(np.float32))).T


def group_modules(arrays: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """``{"layers/0/attn/q_einsum": {"a": A, "b": B}}``; raises MergeError on paths that are not tunix LoRA params."""
    modules: dict[str, dict] = {}
    for path, arr in arrays.items():
        m = _MODULE_RE.match(path)
        if not m:
            raise MergeError(f"Unexpected LoRA param {path!r} in the checkpoint (not a tunix Gemma 4 attention/MLP "
                             f"module). Was it trained by this course?")
        key = f"layers/{m.group(1)}/{m.group(2)}"
        if m.group(4) in modules.setdefault(key, {}):
            raise MergeError(f"{key} has two LoRA {m.group(4).upper()} params.")
        modules[key][m.group(4)] = arr
    for key, ab in modules.items():
        if set(ab) != {"a", "b"}:
            raise MergeError(f"{key} has LoRA {sorted(ab)} but needs both a and b.")
    return modules


def plan(arrays: dict[str, np.ndarray], meta: dict, text_config: dict) -> list[Delta]:
    """Every HF tensor update the checkpoint implies, checked against the LoRA config and the base config.

    Raises MergeError when a module is missing or extra (wrong number of layers), or a shape does not fit (another
    base model: other heads or widths), or the rank is not the recorded one.
    """
    from .gemma4 import kv_shared_layers, layer_kinds
    from .lora import _shapes, tunix_module, validate_targets

    rank, alpha = int(meta["rank"]), float(meta["alpha"])
    scale = alpha / rank
    targets = validate_targets(meta["targets"])
    kinds = layer_kinds(text_config)
    shared = kv_shared_layers(text_config)
    k_eq_v = bool(text_config.get("attention_k_eq_v"))
    n_layers = text_config["num_hidden_layers"]
    if meta.get("num_layers") not in (None, n_layers):
        raise MergeError(f"The LoRA was trained on a {meta['num_layers']}-layer base, but this base has {n_layers} "
                         f"layers: wrong base model (lora_config.json base_model={meta.get('base_model')!r}).")
    modules = group_modules(arrays)
    expected = {}
    for i, kind in enumerate(kinds):
        for t in targets:
            mod = tunix_module(t, kind, k_eq_v, kv_shared=i in shared)
            if mod:
                expected.setdefault(f"layers/{i}/{mod}", (i, kind, t))
    extra = sorted(set(modules) - set(expected), key=_natural)
    missing = sorted(set(expected) - set(modules), key=_natural)
    if extra:
        raise MergeError(f"The checkpoint has LoRA for {len(extra)} module(s) this base/config does not have or that "
                         f"lora_config.json does not target, e.g. {extra[:3]} (base has {n_layers} layers; targets "
                         f"{list(targets)}): wrong base model?")
    if missing:
        raise MergeError(f"The checkpoint lacks LoRA for {len(missing)} targeted module(s), e.g. {missing[:3]}: "
                         f"the checkpoint and its lora_config.json disagree, or the base is another model.")
    deltas = []
    for key in sorted(modules, key=_natural):
        i, kind, t = expected[key]
        a, b = modules[key]["a"], modules[key]["b"]
        _, _, a_shape, b_shape = _shapes(text_config, t, kind, rank, layer=i)
        if tuple(a.shape) != tuple(a_shape) or tuple(b.shape) != tuple(b_shape):
            raise MergeError(f"{key}: LoRA A {tuple(a.shape)} / B {tuple(b.shape)} do not fit this base, which needs "
                             f"A {tuple(a_shape)} / B {tuple(b_shape)} (rank {rank}): the base is another model "
                             f"(other heads/widths) than the one trained on.")
        a2 = a.reshape(-1, rank)
        mod = key.split("/", 2)[2]
        if mod == "attn/kv_einsum":
            deltas.append(Delta(hf_name(i, "k_proj"), key, "k_proj", a2, b[:, 0].reshape(rank, -1), scale,
                                "k = B[:, 0] (shares A with v)"))
            deltas.append(Delta(hf_name(i, "v_proj"), key, "v_proj", a2, b[:, 1].reshape(rank, -1), scale,
                                "v = B[:, 1] (shares A with k)"))
        else:
            (target,) = _HF_OF[mod]
            note = "global k=v layer: K is also V, no v_proj" if mod == "attn/k_einsum" else ""
            deltas.append(Delta(hf_name(i, target), key, target, a2, b.reshape(rank, -1), scale, note))
    return deltas


def _natural(s: str):
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", s)]


def mapping_table(deltas: list[Delta], arrays: dict[str, np.ndarray] | None = None):
    """tunix module -> HF tensor, with the LoRA and HF shapes (pandas)."""
    import pandas as pd

    rows = []
    for d in deltas:
        row = {"tunix module": d.module, "HF tensor": d.hf.removeprefix(KEY_PREFIX), "HF shape [out, in]": d.shape,
               "A2 (in, r)": d.a.shape, "B2 (r, out)": d.b.shape, "scale": d.scale, "note": d.note}
        if arrays is not None:
            for ab in ("a", "b"):
                k = next(k for k in arrays if k.startswith(d.module + "/") and k.endswith(f"_lora_{ab}"))
                row[f"LoRA {ab.upper()} (tunix)"] = tuple(arrays[k].shape)
        rows.append(row)
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------------------------
# The safetensors side: headers, streaming

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _np_dtype(name: str):
    if name == "BF16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if name not in _DTYPES:
        raise MergeError(f"safetensors dtype {name} is not supported by the merge.")
    return np.dtype(_DTYPES[name])


def read_header(path: str | Path) -> tuple[dict, int]:
    """``(header, data_start)`` of a safetensors file (the format: u64 header length, JSON header, raw data)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise MergeError(f"{path} is not a safetensors file (shorter than 8 bytes).")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise MergeError(f"{path} is not a safetensors file (header length {n}).")
        header = json.loads(f.read(n))
    size = Path(path).stat().st_size
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise MergeError(f"{path} is truncated: its header describes {8 + n + end} bytes, the file has {size}.")
    return header, 8 + n


def base_layout(base_dir: str | Path) -> tuple[dict, dict[str, list[str]], dict[str, dict]]:
    """``(index, {shard: [tensor names]}, {tensor: header entry})`` of a base checkpoint. Raises MergeError."""
    from .gemma4 import CheckpointError, read_text_config

    base_dir = Path(base_dir)
    try:
        read_text_config(base_dir)
    except CheckpointError as e:
        raise MergeError(str(e)) from e
    index_path = base_dir / INDEX
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    elif (base_dir / "model.safetensors").is_file():  # a single-file checkpoint: same code, one shard
        index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in read_header(base_dir / "model.safetensors")[0]
                                                if k != "__metadata__"}}
    else:
        raise MergeError(f"{base_dir} has no {INDEX} (nor a single model.safetensors): cannot tell which shard holds "
                         f"which tensor. Re-download the checkpoint with its index.")
    shards: dict[str, list[str]] = {}
    for name, shard in index["weight_map"].items():
        shards.setdefault(shard, []).append(name)
    entries = {}
    for shard, names in shards.items():
        path = base_dir / shard
        if not path.is_file():
            raise MergeError(f"{INDEX} names shard {shard}, which is missing from {base_dir}.")
        header, _ = read_header(path)
        for name in names:
            if name not in header:
                raise MergeError(f"{INDEX} puts {name} in {shard}, but that shard does not hold it.")
            entries[name] = header[name]
    return index, shards, entries


def _copy_range(src, dst, offset: int, length: int) -> None:
    """Copy ``length`` bytes at ``offset`` of ``src`` to the end of ``dst`` (a kernel copy when possible)."""
    done = 0
    if length and hasattr(os, "copy_file_range"):
        dst.flush()
        try:
            while done < length:
                n = os.copy_file_range(src.fileno(), dst.fileno(), min(length - done, 1 << 30), offset + done)
                if n == 0:
                    break
                done += n
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
        dst.seek(0, os.SEEK_END)
    src.seek(offset + done)
    while done < length:
        chunk = src.read(min(COPY_CHUNK, length - done))
        if not chunk:
            raise MergeError(f"{src.name} ended early.")
        dst.write(chunk)
        done += len(chunk)


class _Writer:
    """Writes and kernel copies into ``dst``, in order, on one background thread, so that disk writes overlap the
    ΔW math (file writes release the GIL). At most ``depth`` items wait in the queue (bounded memory). An error in the
    thread (e.g. ENOSPC) is raised in the caller at its next call or at ``close``."""

    def __init__(self, src_path: Path, dst, depth: int = 2):
        import queue
        import threading

        self.src = open(src_path, "rb")  # its own handle: the caller reads with another
        self.dst, self.error = dst, None
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while (item := self.q.get()) is not None:
            if self.error is None:
                try:
                    if isinstance(item, tuple):
                        _copy_range(self.src, self.dst, *item)
                    else:
                        self.dst.write(item)
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    self.error = e

    def _check(self):
        if self.error is not None:
            raise self.error

    def write(self, data: bytes):
        self._check()
        self.q.put(data)

    def copy(self, offset: int, length: int):
        self._check()
        if length:
            self.q.put((offset, length))

    def close(self):
        self.q.put(None)
        self.thread.join()
        self.src.close()
        self._check()


def write_merged_shard(src_path: Path, dst_path: Path, deltas: dict[str, Delta], kernel: str = "xla") -> dict[str, float]:
    """Write ``dst_path`` = ``src_path`` with ``deltas`` added; returns {tensor: max |ΔW| applied}.

    The header is copied unchanged (same dtypes and shapes, so the same offsets). The data is written in file order:
    the byte ranges between merged tensors by a kernel copy (bit for bit, no Python buffers), each merged tensor read
    alone, in row blocks, ``W + ΔW`` computed in fp32 and rounded once to the base dtype (``kernel``: see
    :func:`_write_merged_tensor`). Peak memory: a few blocks of ~4 MB. Writing runs on a background thread,
    overlapping the math.
    """
    header, start = read_header(src_path)
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    todo = sorted((k for k in header if k in deltas), key=lambda k: header[k]["data_offsets"][0])
    applied = {}
    with open(src_path, "rb") as src, open(dst_path, "wb") as dst:
        out = _Writer(src_path, dst)
        try:
            out.copy(0, start)  # length + header, verbatim
            cursor = 0  # data bytes written so far
            for name in todo:
                entry, d = header[name], deltas[name]
                b0, b1 = entry["data_offsets"]
                if tuple(entry["shape"]) != d.shape:
                    raise MergeError(f"{name}: base shape {tuple(entry['shape'])} but the LoRA gives {d.shape}: the "
                                     f"base is another model than the one trained on.")
                out.copy(start + cursor, b0 - cursor)
                applied[name] = _write_merged_tensor(src, out, start + b0, entry, d, kernel)
                cursor = b1
            out.copy(start + cursor, end - cursor)
        finally:
            out.close()
    return applied


def _block_rows(in_dim: int) -> int:
    """Rows per merge block: a power of two near ``MERGE_BLOCK_ELEMENTS / in_dim``. The out dims of the 31B and
    of the bench model are multiples of it, so each input width compiles one XLA block kernel."""
    limit = max(1, MERGE_BLOCK_ELEMENTS // in_dim)
    return 1 << (limit.bit_length() - 1)


def merge_block_numpy(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: np.float32) -> tuple[np.ndarray, float]:
    """The reference merge of one row block: ``w + scale·(a·b)ᵀ`` in fp32 (numpy/BLAS), rounded once to ``w``'s
    dtype; ``a`` (in, r) and ``b`` (r, rows) fp32. Returns (merged block, max |ΔW|)."""
    dw = (a @ b).T  # rows of (A2·B2)ᵀ
    dw *= scale
    merged = np.add(w, dw, dtype=np.float32)
    return merged.astype(w.dtype), float(np.abs(dw).max())


_BITS = {"bfloat16": np.uint16, "float32": np.uint32}  # the dtypes of the XLA kernel (the course's checkpoints)


@functools.cache
def _xla_block_kernel(dtype_name: str, fuse_scale: bool):
    """The jitted merge of one row block on the host CPU, for a bf16 or fp32 base: ``(w_bits, bᵀ, aᵀ, scale) ->
    (merged_bits, max |ΔW|, exact)``, the same arithmetic as :func:`merge_block_numpy`: ΔW = fl(scale·(bᵀ·aᵀ)) in
    fp32, one fp32 add, one round-to-nearest-even (done on the bits; NaN becomes the quiet NaN ml_dtypes gives).
    Only the dot's summation order may differ from numpy's BLAS.

    XLA:CPU contracts ``w + scale·d`` into one fused multiply-add (one rounding instead of two). That is exact only
    for a power-of-two scale (``fuse_scale``: one XLA call per block); any other scale gets ΔW from a first call and
    the add in a second, so the product is rounded first, as in numpy.

    XLA:CPU flushes subnormal floats to zero (FTZ/DAZ). ``exact`` is False for a block where that could change the
    result (a subnormal base element, or a nonzero base element whose fp32 sum came out zero); the caller then
    merges that block with numpy. Left uncovered: ΔW elements that are themselves subnormal (|ΔW| < 1.2e-38).
    """
    import jax
    import jax.numpy as jnp
    from jax import lax

    bf16 = dtype_name == "bfloat16"

    def scaled_delta(bt, at, scale):
        return scale * jnp.dot(bt, at, precision=lax.Precision.HIGHEST)

    def add_and_round(w_bits, dw):
        if bf16:
            w = lax.bitcast_convert_type(w_bits.astype(jnp.uint32) << 16, jnp.float32)
            mag, exp_bits = w_bits & 0x7FFF, w_bits & 0x7F80
        else:
            w = lax.bitcast_convert_type(w_bits, jnp.float32)
            mag, exp_bits = w_bits & 0x7FFFFFFF, w_bits & 0x7F800000
        m = w + dw
        u = lax.bitcast_convert_type(m, jnp.uint32)
        if bf16:
            rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            out = jnp.where(jnp.isnan(m), ((u >> 16) & 0x8000) | 0x7FC0, rounded).astype(jnp.uint16)
        else:
            out = u
        flushed = ((exp_bits == 0) & (mag != 0)) | (((u & 0x7FFFFFFF) == 0) & (mag != 0))
        return out, jnp.max(jnp.abs(dw)), ~jnp.any(flushed)

    if fuse_scale:
        return jax.jit(lambda w_bits, bt, at, scale: add_and_round(w_bits, scaled_delta(bt, at, scale)))
    delta_fn, add_fn = jax.jit(scaled_delta), jax.jit(add_and_round)
    return lambda w_bits, bt, at, scale: add_fn(w_bits, delta_fn(bt, at, scale))


def _read_block(src, nbytes: int, align: int = 64) -> np.ndarray:
    """The next ``nbytes`` of ``src`` in a new ``align``-byte-aligned uint8 array (XLA can use it without a copy)."""
    buf = np.empty(nbytes + align, np.uint8)
    start = (-buf.ctypes.data) % align
    block = buf[start:start + nbytes]
    if src.readinto(memoryview(block)) != nbytes:
        raise MergeError(f"{src.name} ended early.")
    return block


def _write_merged_tensor(src, out: _Writer, offset: int, entry: dict, d: Delta, kernel: str = "xla") -> float:
    """Read one base tensor, add its ΔW in fp32, write it in the base dtype, in row blocks of about
    ``MERGE_BLOCK_ELEMENTS`` elements, so the temporaries stay small whatever the tensor's size. Returns max |ΔW|.

    ``kernel="xla"`` (bf16/fp32 bases): each block is one jitted XLA computation on the host CPU (both cores, the
    casts fused with the add); block ``i + 1`` is read while block ``i`` computes. ``"numpy"``: today's reference
    arithmetic (:func:`merge_block_numpy`), also used for other dtypes and for blocks the XLA kernel flags.
    """
    if kernel not in MERGE_KERNELS:
        raise ValueError(f"kernel must be one of {MERGE_KERNELS}, got {kernel!r}")
    dtype = _np_dtype(entry["dtype"])
    out_dim, in_dim = entry["shape"]
    rows = _block_rows(in_dim)
    a = d.a.astype(np.float32)  # (in, r)
    b = d.b.astype(np.float32)  # (r, out)
    scale = np.float32(d.scale)
    fast = kernel == "xla" and dtype.name in _BITS
    if fast:
        import jax

        cpu = jax.devices("cpu")[0]
        fn = _xla_block_kernel(dtype.name, fuse_scale=bool(np.frexp(scale)[0] == 0.5))  # a power of two
        at = jax.device_put(np.ascontiguousarray(a.T), cpu)
        bt = np.ascontiguousarray(b.T)  # (out, r): its row blocks are contiguous
        scale_dev = jax.device_put(scale, cpu)
    biggest = 0.0
    pending: list = []  # (w, r0, r1, kernel outputs) of the block in flight

    def finish(w, r0, r1, res):
        nonlocal biggest
        bits, dmax, exact = res
        if bool(exact):
            out.write(np.asarray(bits))
            biggest = max(biggest, float(dmax))
        else:
            merged, dmax = merge_block_numpy(w, a, b[:, r0:r1], scale)
            out.write(merged)
            biggest = max(biggest, dmax)

    src.seek(offset)
    for r0 in range(0, out_dim, rows):
        r1 = min(out_dim, r0 + rows)
        w = _read_block(src, (r1 - r0) * in_dim * dtype.itemsize).view(dtype).reshape(r1 - r0, in_dim)
        if not fast:
            merged, dmax = merge_block_numpy(w, a, b[:, r0:r1], scale)
            out.write(merged)
            biggest = max(biggest, dmax)
            continue
        # a fresh aligned buffer per block: XLA reads it in place (may_alias), no copy
        res = fn(jax.device_put(w.view(_BITS[dtype.name]), cpu, may_alias=True), jax.device_put(bt[r0:r1], cpu), at,
                 scale_dev)
        if pending:
            finish(*pending.pop())
        pending.append((w, r0, r1, res))
    if pending:
        finish(*pending.pop())
    return biggest


def ulp_distance(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Elementwise distance in units in the last place between two float arrays of one dtype (bf16, fp16, fp32):
    how many representable values lie between them (0 where the bits are equal; +0 and -0 are 0 apart)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        raise ValueError(f"ulp_distance needs equal dtypes and shapes, got {x.dtype}{x.shape} and {y.dtype}{y.shape}")
    bits = {2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
    sign = np.int64(1) << (8 * x.dtype.itemsize - 1)

    def ordered(v):
        u = np.ascontiguousarray(v).view(bits).astype(np.int64)
        return np.where(u & sign, -(u & (sign - 1)), u)

    return np.abs(ordered(x) - ordered(y))


def _return_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim; a no-op elsewhere), so that buffers freed by the
    restore and by finished blocks do not count towards the process's peak RSS."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _copy_extras(base_dir: Path, dst: Path, shard_names) -> list[str]:
    """Copy everything that is not a weight (config, generation config, tokenizer, chat template ...)."""
    copied = []
    for p in sorted(base_dir.iterdir()):
        if p.name in shard_names or p.name == INDEX or p.name.endswith(".safetensors") or p.name.startswith(".") \
                or p.name in SKIP_FILES or p.name == MERGE_INFO:
            continue
        if p.is_dir():
            shutil.copytree(p, dst / p.name)
        else:
            shutil.copy2(p, dst / p.name)
        copied.append(p.name)
    return copied


def _prepare_out(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputExistsError(f"{out_dir} exists and is not a directory.")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise OutputExistsError(f"{out_dir} is not empty; pass --overwrite (overwrite=True) to replace it.")


def _install(tmp: Path, out_dir: Path) -> None:
    """Put the finished ``tmp`` at ``out_dir`` by renames (the old one, if any, is removed afterwards)."""
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.rename(out_dir, old / "x")
    os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _lora_digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for k in sorted(arrays):
        h.update(k.encode())
        h.update(np.ascontiguousarray(arrays[k]).tobytes())
    return h.hexdigest()[:16]


def _config_hash(text_config: dict) -> str:
    return hashlib.sha256(json.dumps(text_config, sort_keys=True).encode()).hexdigest()[:16]


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


def merge_lora(base_dir: str | Path, checkpoint_dir: str | Path, out_dir: str | Path, step: int | None = None,
               overwrite: bool = False, progress: bool = True, kernel: str = "xla") -> MergeResult:
    """Merge the LoRA of ``checkpoint_dir`` (latest step, or ``step``) into ``base_dir``; write ``out_dir``.

    ``kernel``: ``"xla"`` computes each targeted tensor with XLA on the host CPU (the default), ``"numpy"`` with the
    numpy reference arithmetic (see :func:`_write_merged_tensor`).

    Raises :class:`MergeError` (bad checkpoint, base, or a LoRA that does not fit the base) before anything is
    written, :class:`OutputExistsError` for a non-empty ``out_dir`` without ``overwrite``. On any failure while
    writing (e.g. ``OSError`` ENOSPC) the temp dir is removed and ``out_dir`` is left as it was.
    """
    from tqdm.auto import tqdm

    from .gemma4 import read_text_config
    from .multihost import is_main

    if not is_main():  # a host-side step: every process would write the same out_dir
        raise MergeError("merge_lora runs on one host only: call it from process 0 (launch runs 'merge' on worker 0), "
                         "after training; it reads the multi-process checkpoint by itself.")
    if kernel not in MERGE_KERNELS:
        raise MergeError(f"kernel must be one of {MERGE_KERNELS}, got {kernel!r}.")
    started = time.perf_counter()
    base_dir, checkpoint_dir, out_dir = Path(base_dir), Path(checkpoint_dir), Path(out_dir)
    _prepare_out(out_dir, overwrite)
    index, shards, entries = base_layout(base_dir)
    text = read_text_config(base_dir)
    meta = read_lora_config(checkpoint_dir)
    step, arrays = restore_lora(checkpoint_dir, step)
    _return_freed_memory()  # TensorStore's read buffers: the peak RSS is then the LoRA + a few blocks
    deltas = plan(arrays, meta, text)
    by_name: dict[str, Delta] = {}
    for d in deltas:
        if d.hf in by_name:
            raise MergeError(f"{d.hf} would get two LoRA updates ({by_name[d.hf].module} and {d.module}).")
        if d.hf not in entries:
            raise MergeError(f"{d.hf} (LoRA of {d.module}) is not in the base checkpoint: wrong base model.")
        if tuple(entries[d.hf]["shape"]) != d.shape:
            raise MergeError(f"{d.hf}: base shape {tuple(entries[d.hf]['shape'])}, LoRA gives {d.shape}: the base is "
                             f"another model (other heads/widths) than the one trained on.")
        by_name[d.hf] = d
    cfg_hash = _config_hash(text)
    if meta.get("base_config_sha256") and meta["base_config_sha256"] != cfg_hash:
        warnings.warn(f"{base_dir}/config.json differs from the config the LoRA was trained on (hash "
                      f"{cfg_hash} vs {meta['base_config_sha256']}); every shape fits, so merging anyway.")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    applied: dict[str, float] = {}
    total = 0
    try:
        bar = tqdm(sorted(shards), desc="merging shards", unit="shard", disable=not progress)
        for shard in bar:
            bar.set_postfix_str(shard)
            todo = {n: by_name[n] for n in shards[shard] if n in by_name}
            got = write_merged_shard(base_dir / shard, tmp / shard, todo, kernel)
            twice = set(got) & set(applied)
            if twice or set(got) != set(todo):
                raise MergeError(f"{shard}: applied {sorted(got)} but expected {sorted(todo)}"
                                 + (f"; {sorted(twice)} twice" if twice else ""))
            applied.update(got)
            _return_freed_memory()
            header, _ = read_header(tmp / shard)
            total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
        if set(applied) != set(by_name):
            raise MergeError(f"LoRA updates never applied: {sorted(set(by_name) - set(applied))[:5]}")
        out_index = {"metadata": {**index.get("metadata", {}), "total_size": total}, "weight_map": index["weight_map"]}
        if (base_dir / INDEX).is_file():
            (tmp / INDEX).write_text(json.dumps(out_index, indent=2) + "\n")
        copied = _copy_extras(base_dir, tmp, set(shards))
        info = {"base_dir": str(base_dir.resolve()), "checkpoint_dir": str(checkpoint_dir.resolve()), "step": step,
                "lora": {k: meta.get(k) for k in ("targets", "rank", "alpha", "base_model", "base_config_sha256")},
                "scale": float(meta["alpha"]) / int(meta["rank"]), "lora_sha256": _lora_digest(arrays),
                "base_config_sha256": cfg_hash, "merged_tensors": len(applied),
                "copied_tensors": len(entries) - len(applied), "shards": sorted(shards), "total_size": total,
                "copied_files": copied, "max_abs_delta": max(applied.values(), default=0.0), "kernel": kernel,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (tmp / MERGE_INFO).write_text(json.dumps(info, indent=1) + "\n")
        _install(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return MergeResult(out_dir, step, len(shards), len(applied), len(entries) - len(applied), total,
                       time.perf_counter() - started, info)


def read_merge_info(merged_dir: str | Path) -> dict | None:
    p = Path(merged_dir) / MERGE_INFO
    return json.loads(p.read_text()) if p.is_file() else None


def ensure_merged(profile, run_dir: str | Path | None = None, progress: bool = True) -> Path:
    """``runs/<profile>/merged``, merged from the run's trained LoRA (``train.ensure_trained``) when missing or stale.

    Cached: rebuilt when the latest checkpoint step, the checkpoint directory, or the LoRA arrays' recorded source
    changed. How notebooks 08 (serving) and 09 (evaluation) stay standalone.
    """
    from . import gemma4, train

    run_dir = Path(run_dir or profile.run_dir())
    ckpt = train.ensure_trained(profile, run_dir, progress=progress)
    base = gemma4.ensure_base(profile, run_dir)
    out = run_dir / "merged"
    info = read_merge_info(out)
    step = train.latest_step(ckpt)
    if info and info.get("step") == step and Path(info.get("checkpoint_dir", "")) == ckpt.resolve() \
            and Path(info.get("base_dir", "")) == base.resolve():
        return out
    merge_lora(base, ckpt, out, overwrite=True, progress=progress)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Writing LoRA checkpoints (tests, benchmarks): the same layout tunix's PeftTrainer writes

def write_lora_checkpoint(checkpoint_dir: str | Path, arrays: dict[str, np.ndarray], meta: dict, step: int = 1) -> Path:
    """Save ``arrays`` (flat tunix paths) as ``<checkpoint_dir>/<step>/model_params`` + ``lora_config.json``, in the
    nested layout tunix's ``PeftTrainer`` saves (``layers -> 0 -> attn -> q_einsum -> w_lora_a``)."""
    import orbax.checkpoint as ocp

    checkpoint_dir = Path(checkpoint_dir)
    tree: dict = {}
    for path, arr in arrays.items():
        node = tree
        parts = path.split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = np.asarray(arr)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    (checkpoint_dir / METADATA).write_text(json.dumps(meta, indent=1))
    ckptr = ocp.PyTreeCheckpointer()
    ckptr.save((checkpoint_dir / str(step) / PARAMS_ITEM).resolve(), tree, force=True)
    return checkpoint_dir


def perturbed_lora(arrays: dict[str, np.ndarray], seed: int = 0, b_std: float = 0.05) -> dict[str, np.ndarray]:
    """The same LoRA with random B (trained B starts at zero and stays small in a 2-step run): a strong signal for
    layout tests, where a wrong transpose or a k/v swap moves the logits by O(1)."""
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal(v.shape).astype(v.dtype) * b_std if k.endswith("_lora_b") else v)
            for k, v in arrays.items()}


def synthetic_lora(text_config: dict, targets, rank: int, seed: int = 0, std: float = 0.02,
                   dtype=np.float32) -> dict[str, np.ndarray]:
    """Random LoRA arrays with tunix's paths and shapes for ``text_config`` (benchmarks: no training needed)."""
    from .gemma4 import kv_shared_layers, layer_kinds
    from .lora import _shapes, tunix_module, validate_targets

    rng = np.random.default_rng(seed)
    shared = kv_shared_layers(text_config)
    out = {}
    k_eq_v = bool(text_config.get("attention_k_eq_v"))
    for i, kind in enumerate(layer_kinds(text_config)):
        for t in validate_targets(targets):
            mod = tunix_module(t, kind, k_eq_v, kv_shared=i in shared)
            key = f"layers/{i}/{mod}" if mod else None
            if not key or f"{key}/w_lora_a" in out or f"{key}/kernel_lora_a" in out:
                continue
            param = "kernel" if mod.startswith("mlp/") else "w"
            _, _, a, b = _shapes(text_config, t, kind, rank, layer=i)
            out[f"{key}/{param}_lora_a"] = (rng.standard_normal(a) * std).astype(dtype)
            out[f"{key}/{param}_lora_b"] = (rng.standard_normal(b) * std).astype(dtype)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Verification: transformers and tunix, on the same tokens

def lora_model(base_dir, checkpoint_dir, mesh, step: int | None = None, arrays=None):
    """The tunix base + the checkpoint's LoRA (fp32), the reference a merge must reproduce."""
    import jax
    from flax import nnx

    from . import gemma4, lora

    meta = read_lora_config(checkpoint_dir)
    if arrays is None:
        _, arrays = restore_lora(checkpoint_dir, step)
    model = gemma4.load_model(base_dir, mesh, dtype="float32")
    model, _ = lora.apply_lora(model, meta["targets"], int(meta["rank"]), float(meta["alpha"]), 0.0)
    state = nnx.state(model, nnx.LoRAParam)
    flat = nnx.to_flat_state(state)
    seen = set()
    for path, var in flat:
        key = "/".join(map(str, path))
        if key not in arrays:
            raise MergeError(f"The LoRA model has {key}, which the checkpoint lacks.")
        cur = var.value
        if tuple(cur.shape) != tuple(arrays[key].shape):
            raise MergeError(f"{key}: model {tuple(cur.shape)} vs checkpoint {tuple(arrays[key].shape)}.")
        var.value = jax.device_put(np.asarray(arrays[key], dtype=cur.dtype), cur.sharding)
        seen.add(key)
    if set(arrays) - seen:
        raise MergeError(f"Checkpoint params not in the LoRA model: {sorted(set(arrays) - seen)[:3]}")
    nnx.update(model, nnx.from_flat_state(flat))
    return model


def _stats(ours: np.ndarray, ref: np.ndarray) -> dict:
    diff = float(np.abs(ours - ref).max())
    scale = float(np.abs(ref).max())
    return {"max_abs": diff, "scale": scale, "rel": diff / max(scale, 1e-30)}


def verify(base_dir, checkpoint_dir, merged_dir, step: int | None = None, mesh=None, seq_len: int = 40, seed: int = 0,
           bound: float | None = None) -> dict:
    """Check a merged checkpoint; returns a dict with a row per comparison and ``ok``.

    (a) transformers (torch CPU fp32) on the merged files vs tunix base + LoRA restored from the checkpoint;
    (b) the merged files loaded into tunix vs the same tunix base + LoRA;
    plus, for scale, how far the LoRA moves the logits at all (tunix base vs base + LoRA): a check is only as strong
    as that effect is large compared with the bound. Relative = max |Δlogit| / max |logit of the reference|. tunix
    forwards are jitted (``parity.tunix_logits``). An fp32 base is needed for the 1e-4 bound (a bf16 merge rounds W+ΔW
    to bf16); the TPU profiles verify on the tiny model, like the parity check.
    """
    from . import gemma4, parity
    from . import mesh as mesh_lib
    from .profiles import get_profile

    bound = parity.DEFAULT_REL_BOUND if bound is None else bound
    mesh = mesh if mesh is not None else mesh_lib.make_mesh(get_profile("smoke"))
    step, arrays = restore_lora(checkpoint_dir, step)
    info = read_merge_info(merged_dir)
    text = gemma4.read_text_config(merged_dir)
    tokens = parity.sample_tokens(text["vocab_size"], seq_len, seed)
    ref_model = lora_model(base_dir, checkpoint_dir, mesh, step, arrays=arrays)
    ref = parity.tunix_logits(ref_model, tokens, mesh)
    del ref_model
    base_logits = parity.tunix_logits(gemma4.load_model(base_dir, mesh, dtype="float32"), tokens, mesh)
    hf = parity.load_hf(merged_dir)
    hf_logits, _ = parity.hf_logits_and_hidden(hf, tokens)
    del hf
    merged_tunix = parity.tunix_logits(gemma4.load_model(merged_dir, mesh, dtype="float32"), tokens, mesh)
    rows = [
        {"comparison": "(a) transformers(merged) vs tunix(base + LoRA)", **_stats(hf_logits, ref), "bound": bound},
        {"comparison": "(b) tunix(merged) vs tunix(base + LoRA)", **_stats(merged_tunix, ref), "bound": bound},
        {"comparison": "LoRA effect: tunix(base) vs tunix(base + LoRA)", **_stats(base_logits, ref), "bound": None},
    ]
    ok = all(r["rel"] <= bound for r in rows[:2])
    return {"ok": ok, "step": step, "bound": bound, "seq_len": seq_len, "rows": rows,
            "merge_step": info.get("step") if info else None,
            # does merge_info.json say this very LoRA was merged (None: not merged by merge_lora)?
            "same_lora_as_merge": (info.get("lora_sha256") == _lora_digest(arrays)) if info else None,
            "max_rel": max(r["rel"] for r in rows[:2]), "lora_effect_rel": rows[2]["rel"]}


def verify_table(result: dict):
    import pandas as pd

    return pd.DataFrame(result["rows"]).rename(columns={"max_abs": "max |Δlogit|", "scale": "logit scale",
                                                        "rel": "relative"})


# ---------------------------------------------------------------------------------------------------------------
# Unmerged: a PEFT adapter

PEFT_PREFIX = "base_model.model."


def export_peft_adapter(checkpoint_dir, out_dir, base_dir, step: int | None = None, overwrite: bool = False) -> Path:
    """Write the checkpoint's LoRA as a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

    Keys are ``base_model.model.model.language_model.layers.N.{self_attn,mlp}.<target>.lora_{A,B}.weight``, with
    ``lora_A`` = A2ᵀ (r, in) and ``lora_B`` = B2ᵀ (out, r), and ``lora_alpha``/``r`` from ``lora_config.json``, so
    PEFT's ΔW = (alpha/r)·B·A equals the merge's. This is the naming vLLM 0.32 accepted for Gemma 4 (see
    ``serve.make_test_adapter``); the multimodal-layout base loads it with ``PeftModel.from_pretrained``.

    Caveat (vLLM): on a global k=v layer, a ``k_proj`` LoRA is applied by vLLM 0.32 to the K slice of its fused
    ``qkv_proj`` only, while the model (tunix, transformers + PEFT, and the merged weights) uses that projection for V
    too. So an unmerged adapter with global ``k_proj`` LoRA is served as a slightly different model; serve the merged
    weights (they have no such gap), or train without global k (``serve.targets_without_global_k``).
    """
    from peft import LoraConfig
    from safetensors.numpy import save_file

    from .gemma4 import read_text_config
    from .lora import peft_target_modules

    out_dir = Path(out_dir)
    _prepare_out(out_dir, overwrite)
    meta = read_lora_config(checkpoint_dir)
    step, arrays = restore_lora(checkpoint_dir, step)
    deltas = plan(arrays, meta, read_text_config(base_dir))
    tensors = {}
    for d in deltas:
        key = PEFT_PREFIX + d.hf.removesuffix(".weight")
        tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(d.a.T.astype(np.float32))
        tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(d.b.T.astype(np.float32))
    targets = sorted({d.target for d in deltas}, key=lambda t: ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj").index(t))
    cfg = LoraConfig(r=int(meta["rank"]), lora_alpha=float(meta["alpha"]), lora_dropout=0.0,
                     target_modules=peft_target_modules(targets),  # the language model's, not the vision tower's
                     base_model_name_or_path=str(meta.get("base_model") if meta.get("base_model") not in (None, "tiny")
                                                 else Path(base_dir).resolve()))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        cfg.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_source.json").write_text(json.dumps(
            {"checkpoint_dir": str(Path(checkpoint_dir).resolve()), "step": step, "lora_sha256": _lora_digest(arrays),
             "tensors": len(tensors)}, indent=1) + "\n")
        _install(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def peft_logits(base_dir, adapter_dir, tokens: np.ndarray) -> np.ndarray:
    """transformers + PEFT (fp32, unmerged adapter) logits."""
    import torch
    from peft import PeftModel

    from .parity import load_hf

    model = PeftModel.from_pretrained(load_hf(base_dir), str(adapter_dir)).eval()
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.double().numpy()


# ---------------------------------------------------------------------------------------------------------------
# The CLI (wired in __main__.py)

def add_merge_arguments(p) -> None:
    p.add_argument("--base", required=True, help="base HF checkpoint directory (config, shards, index, tokenizer)")
    p.add_argument("--checkpoint", required=True, help="the run's Orbax `checkpoints` directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")


def add_verify_arguments(p) -> None:
    p.add_argument("--base", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--merged", required=True)
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=40)
    p.add_argument("--profile", default=None, help="JAX devices/mesh profile (default: smoke)")


def add_export_arguments(p) -> None:
    p.add_argument("--base", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true")


def main_merge(args) -> int:
    import sys

    try:
        r = merge_lora(args.base, args.checkpoint, args.out, step=args.step, overwrite=args.overwrite)
    except MergeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"merged step {r.step}: {r.merged_tensors} tensors with LoRA, {r.copied_tensors} copied, {r.shards} shards, "
          f"{r.bytes / 1e9:.3f} GB in {r.seconds:.1f} s -> {r.out_dir}")
    return 0


def main_verify(args) -> int:
    import sys

    from . import profiles

    prof = profiles.configure_jax(args.profile or "smoke")
    from . import mesh as mesh_lib

    try:
        res = verify(args.base, args.checkpoint, args.merged, step=args.step, mesh=mesh_lib.make_mesh(prof),
                     seq_len=args.seq_len)
    except MergeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in res["rows"]:
        b = f"(bound {r['bound']:.0e})" if r["bound"] else ""
        print(f"{r['comparison']:50s} max |dlogit| {r['max_abs']:.3e}  scale {r['scale']:.3f}  "
              f"relative {r['rel']:.3e} {b}")
    if res["same_lora_as_merge"] is False:
        print(f"note: {args.merged}/{MERGE_INFO} records another LoRA than step {res['step']} of {args.checkpoint}")
    print("verify: OK" if res["ok"] else "verify: FAILED")
    return 0 if res["ok"] else 1


def main_export_adapter(args) -> int:
    import sys

    try:
        out = export_peft_adapter(args.checkpoint, args.out, args.base, step=args.step, overwrite=args.overwrite)
    except MergeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote PEFT adapter {out}")
    return 0
