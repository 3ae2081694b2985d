"""Streaming safetensors shards: headers, a checkpoint's shard layout, and a shard rewritten with ΔW added.

:func:`write_merged_shard` keeps the header (merged tensors keep dtype and shape, so every offset stays valid),
kernel-copies untouched bytes and merges each targeted tensor in row blocks, ``W + ΔW`` in fp32 rounded once: peak
memory is a few blocks, not a shard. A ΔW: ``a`` (in, r), ``b`` (r, out), ``scale``, ``shape``, ``fold`` (s·(W + ΔW)).
"""

from __future__ import annotations

import errno
import functools
import math
import os
from pathlib import Path

import numpy as np

from ..core.errors import GemmaTpuError
from ..model.hf_checkpoint import CheckpointError, checkpoint_layout, read_shard_header, read_text_config

COPY_CHUNK = 64 << 20
# Elements per row block of a merged tensor (~4 MB of fp32 ΔW): big enough to amortise one XLA call, small enough
# to stay in the caches and keep the memory bounded whatever the tensor's size.
MERGE_BLOCK_ELEMENTS = 1 << 20
MERGE_KERNELS = ("xla", "numpy")  # how targeted tensors are merged: XLA on the host CPU, or the numpy reference


class SafetensorsError(GemmaTpuError, ValueError):
    """A base checkpoint whose safetensors files, index or config cannot be streamed (the message says why)."""


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def np_dtype(name: str):
    """The numpy dtype of a safetensors dtype name (ml_dtypes' bfloat16 for BF16)."""
    if name == "BF16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if name not in _DTYPES:
        raise SafetensorsError(f"safetensors dtype {name} is not supported by the merge.")
    return np.dtype(_DTYPES[name])


def read_header(path: str | Path) -> tuple[dict, int]:
    """``(header, data_start)`` of a safetensors file: ``hf_checkpoint.read_shard_header``, as SafetensorsError."""
    try:
        return read_shard_header(path)
    except CheckpointError as e:
        raise SafetensorsError(str(e)) from e


def base_layout(base_dir: str | Path) -> tuple[dict, dict[str, list[str]], dict[str, dict]]:
    """``hf_checkpoint.checkpoint_layout`` of a base checkpoint, after its config; raises SafetensorsError."""
    try:
        read_text_config(base_dir)
        return checkpoint_layout(base_dir)
    except CheckpointError as e:
        raise SafetensorsError(str(e)) from e


def read_tensor(model_dir: str | Path, index: dict, name: str) -> np.ndarray:
    """One whole tensor of a checkpoint (``index``: its weight map), for small ones such as per_expert_scale."""
    header, start = read_header(path := Path(model_dir) / index["weight_map"][name])
    e = header[name]
    return np.fromfile(path, np_dtype(e["dtype"]), math.prod(e["shape"]), offset=start + e["data_offsets"][0]) \
        .reshape(e["shape"])


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
            raise SafetensorsError(f"{src.name} ended early.")
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


def write_merged_shard(src_path: Path, dst_path: Path, deltas: dict, kernel: str = "xla", ones=()) -> dict[str, float]:
    """Write ``dst_path`` = ``src_path`` with ``deltas`` added and the tensors in ``ones`` set to 1, in file order,
    writes overlapping the math on a thread; returns {tensor: max |ΔW| applied}. ``kernel``: see below."""
    header, start = read_header(src_path)
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    todo = sorted((k for k in header if k in deltas or k in ones), key=lambda k: header[k]["data_offsets"][0])
    applied = {}
    with open(src_path, "rb") as src, open(dst_path, "wb") as dst:
        out = _Writer(src_path, dst)
        try:
            out.copy(0, start)  # length + header, verbatim
            cursor = 0  # data bytes written so far
            for name in todo:
                entry, d = header[name], deltas.get(name)
                b0, b1 = entry["data_offsets"]
                if d is not None and tuple(entry["shape"]) != d.shape:
                    raise SafetensorsError(f"{name}: base shape {tuple(entry['shape'])} but the LoRA gives {d.shape}: "
                                     f"the base is another model than the one trained on.")
                out.copy(start + cursor, b0 - cursor)
                if d is None:  # a per_expert_scale folded into experts.down_proj
                    out.write(np.ones(entry["shape"], np_dtype(entry["dtype"])).tobytes())
                else:
                    applied[name] = _write_merged_tensor(src, out, start + b0, entry, d, kernel)
                cursor = b1
            out.copy(start + cursor, end - cursor)
        finally:
            out.close()
    return applied


def block_rows(in_dim: int) -> int:
    """Rows per merge block: a power of two near ``MERGE_BLOCK_ELEMENTS / in_dim``. The out dims of the 31B and
    of the bench model are multiples of it, so each input width compiles one XLA block kernel."""
    limit = max(1, MERGE_BLOCK_ELEMENTS // in_dim)
    return 1 << (limit.bit_length() - 1)


def merge_block_numpy(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale, fold=None) -> tuple[np.ndarray, float]:
    """The reference merge of one row block: ``w + scale·(a·b)ᵀ`` in fp32 (numpy/BLAS), times ``fold`` if given,
    rounded once to ``w``'s dtype; ``a`` (in, r) and ``b`` (r, rows) fp32. Returns (merged block, max |ΔW|)."""
    dw = (a @ b).T  # rows of (A2·B2)ᵀ
    dw *= scale
    merged = np.add(w, dw, dtype=np.float32)
    if fold is not None:
        merged *= fold
    return merged.astype(w.dtype), float(np.abs(dw).max())


_BITS = {"bfloat16": np.uint16, "float32": np.uint32}  # the dtypes of the XLA kernel (the course's checkpoints)


@functools.cache
def _xla_block_kernel(dtype_name: str, fuse_scale: bool, fold: bool = False):
    """The jitted merge of one row block on the host CPU, for a bf16 or fp32 base: ``(w_bits, bᵀ, aᵀ, scale, s) ->
    (merged_bits, max |ΔW| or NaN)``, :func:`merge_block_numpy` (s: its fold, if ``fold``) but for the dot's order.

    XLA:CPU fuses ``w + scale·d`` into one FMA, exact only for a power-of-two scale (``fuse_scale``); any other
    scale takes two calls, so the product is rounded first. XLA:CPU also flushes subnormals to zero: the max is NaN
    where that could change the block (or ΔW has a NaN), and the caller merges it with numpy instead (subnormal ΔW
    elements themselves are not covered).
    """
    import jax
    import jax.numpy as jnp
    from jax import lax

    bf16 = dtype_name == "bfloat16"

    def scaled_delta(bt, at, scale):
        return scale * jnp.dot(bt, at, precision=lax.Precision.HIGHEST)

    def add_and_round(w_bits, dw, s):
        if bf16:
            w = lax.bitcast_convert_type(w_bits.astype(jnp.uint32) << 16, jnp.float32)
            mag, exp_bits = w_bits & 0x7FFF, w_bits & 0x7F80
        else:
            w = lax.bitcast_convert_type(w_bits, jnp.float32)
            mag, exp_bits = w_bits & 0x7FFFFFFF, w_bits & 0x7F800000
        m = (w + dw) * s if fold else w + dw
        u = lax.bitcast_convert_type(m, jnp.uint32)
        if bf16:
            rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            out = jnp.where(jnp.isnan(m), ((u >> 16) & 0x8000) | 0x7FC0, rounded).astype(jnp.uint16)
        else:
            out = u
        flushed = ((exp_bits == 0) & (mag != 0)) | (((u & 0x7FFFFFFF) == 0) & (mag != 0))
        # one reduction gives both max |ΔW| and the NaN flag (two reductions cost two more passes over the block)
        return out, jnp.max(jnp.where(flushed, jnp.float32(jnp.nan), jnp.abs(dw)))

    if fuse_scale:
        return jax.jit(lambda w_bits, bt, at, scale, s: add_and_round(w_bits, scaled_delta(bt, at, scale), s))
    delta_fn, add_fn = jax.jit(scaled_delta), jax.jit(add_and_round)
    return lambda w_bits, bt, at, scale, s: add_fn(w_bits, delta_fn(bt, at, scale), s)


def _read_block(src, nbytes: int, align: int = 64) -> np.ndarray:
    """The next ``nbytes`` of ``src`` in a new ``align``-byte-aligned uint8 array (XLA can use it without a copy)."""
    buf = np.empty(nbytes + align, np.uint8)
    start = (-buf.ctypes.data) % align
    block = buf[start:start + nbytes]
    if src.readinto(memoryview(block)) != nbytes:
        raise SafetensorsError(f"{src.name} ended early.")
    return block


def expert_slabs(entry: dict, d) -> list[tuple[int, dict, object]]:
    """The MoE's experts in a 3-D tensor: E matrices [out, in], one after the other, each its own ΔW.
    ``[(byte offset from the tensor's start, the matrix's entry, its part of ΔW d)]``."""
    matrix = {**entry, "shape": entry["shape"][1:]}
    size = math.prod(matrix["shape"]) * np_dtype(entry["dtype"]).itemsize
    return [(e * size, matrix, part) for e, part in enumerate(d.parts())]


def _write_merged_tensor(src, out: _Writer, offset: int, entry: dict, d, kernel: str = "xla") -> float:
    """Read one base tensor, add its ΔW in fp32, write it in the base dtype, in row blocks of about
    ``MERGE_BLOCK_ELEMENTS`` elements; return max |ΔW|. ``kernel``: "xla" (bf16/fp32 bases; block ``i + 1`` is read
    while block ``i`` computes) or "numpy" (:func:`merge_block_numpy`, also for other dtypes and flagged blocks)."""
    if kernel not in MERGE_KERNELS:
        raise ValueError(f"kernel must be one of {MERGE_KERNELS}, got {kernel!r}")
    dtype = np_dtype(entry["dtype"])
    if len(entry["shape"]) == 3:
        return max(_write_merged_tensor(src, out, offset + at, matrix, part, kernel)
                   for at, matrix, part in expert_slabs(entry, d))
    out_dim, in_dim = entry["shape"]
    rows = block_rows(in_dim)
    a = d.a.astype(np.float32)  # (in, r)
    b = d.b.astype(np.float32)  # (r, out)
    scale = np.float32(d.scale)
    fold = None if d.fold is None else np.float32(d.fold)
    fast = kernel == "xla" and dtype.name in _BITS
    if fast:
        import jax

        cpu = jax.devices("cpu")[0]
        fn = _xla_block_kernel(dtype.name, bool(np.frexp(scale)[0] == 0.5), fold is not None)  # a power of two
        at = jax.device_put(np.ascontiguousarray(a.T), cpu)
        bt = np.ascontiguousarray(b.T)  # (out, r): its row blocks are contiguous
        scale_dev, fold_dev = jax.device_put(scale, cpu), jax.device_put(np.float32(1 if fold is None else fold), cpu)
    biggest = 0.0
    pending: list = []  # (w, r0, r1, kernel outputs) of the block in flight

    def finish(w, r0, r1, res=None):
        nonlocal biggest
        if res is not None and not np.isnan(res[1]):
            out.write(np.asarray(res[0]))
            biggest = max(biggest, float(res[1]))
        else:  # the numpy reference: kernel "numpy", another dtype, or a block that XLA would flush
            merged, dmax = merge_block_numpy(w, a, b[:, r0:r1], scale, fold)
            out.write(merged)
            biggest = max(biggest, dmax)

    src.seek(offset)
    for r0 in range(0, out_dim, rows):
        r1 = min(out_dim, r0 + rows)
        w = _read_block(src, (r1 - r0) * in_dim * dtype.itemsize).view(dtype).reshape(r1 - r0, in_dim)
        if not fast:
            finish(w, r0, r1)
            continue
        # a fresh aligned buffer per block: XLA reads it in place (may_alias), no copy
        res = fn(jax.device_put(w.view(_BITS[dtype.name]), cpu, may_alias=True), jax.device_put(bt[r0:r1], cpu), at,
                 scale_dev, fold_dev)
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
    bits, sign = {2: np.uint16, 4: np.uint32}[x.dtype.itemsize], np.int64(1) << (8 * x.dtype.itemsize - 1)
    u, v = (np.ascontiguousarray(t).view(bits).astype(np.int64) for t in (x, y))
    return np.abs(np.where(u & sign, -(u & (sign - 1)), u) - np.where(v & sign, -(v & (sign - 1)), v))
