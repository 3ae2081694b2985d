"""Check a merged checkpoint in weight space, streamed, on any size of model (the logits check needs whole models).

:func:`verify_weights` reads base and merged one tensor at a time, on the host: copied tensors and files must be
byte-identical to the base's, targeted tensors ``round(base + scale·ΔW)`` within :func:`allowed_error`, and
``merge_info.json`` must name this step, LoRA and base config. Where it records ``fold_expert_scale``, each MoE
``experts.down_proj`` must be ``round(s_e·(base + ΔW))`` and ``per_expert_scale`` exactly 1. Each problem is a row
of ``problems``, naming the tensor or file; ``ok`` is True when there is none. The result is a :class:`WeightCheck`
with a :class:`TensorCheck` per tensor; a table is ``pandas.DataFrame(result.tensors)``.
"""

from __future__ import annotations

import dataclasses
import filecmp
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits
from tqdm.auto import tqdm

from ..core.errors import GemmaTpuError
from ..core.file_io import absolute_path, config_hash, path_id
from ..model import gemma4, hf_checkpoint
from ..model.hf_checkpoint import MERGE_INFO
from ..train import lora_checkpoint
from . import merge_plan, safetensors_io

IGNORED = {MERGE_INFO, "tiny_model.json"}  # written by the merge / the replica builder, not copied
CHUNK = 16 << 20
# Elements per row block (1 MB of fp32): small enough that the block's passes stay in a core's L2 cache.
CHECK_BLOCK_ELEMENTS = 1 << 18
KEPT_SHARE = 0.5  # under this share of targeted elements changed by the merge, a note says ΔW was mostly rounded away
MAX_ULPS = 1  # the merge's XLA kernel and numpy may sum the rank-r dot in another order: one rounding apart
# A folded per_expert_scale s: both sides compute fl(s·fl(W + ΔW)). |s|·ulp(W + ΔW) ≤ 2 fp32 ulps of the product,
# plus its own rounding on each side (1): 3 fp32 ulps of the value beyond what allowed_error gives for W + ΔW.
FOLD_ULPS = 3


@dataclasses.dataclass
class TensorCheck:
    """One tensor of the merge: ``kind`` merged (base + ΔW), folded (a MoE down_proj scaled without a LoRA), ones (a
    folded per_expert_scale) or copied (byte for byte); ``max_ulps`` from the allowed value (None: not comparable),
    ``excess`` the worst error over what rounding allows (> 1 fails) at ``worst_at``, ``changed`` elements not the
    base's bits, ``delta_rms`` ΔW's size."""
    tensor: str
    kind: str
    dtype: str
    shape: tuple
    max_ulps: int | None
    excess: float
    error_there: float
    delta_rms: float
    changed: int
    ok: bool
    worst_at: tuple | None = None


@dataclasses.dataclass
class WeightCheck:
    """What :func:`verify_weights` found: ``ok`` when ``problems`` is empty; ``params``: the arguments the problems
    name; the counts by kind, the worst ``max_ulps`` and ``max_excess`` of the checked tensors, the share of their
    elements the merge changed, and the bytes read in ``seconds``."""
    ok: bool
    step: int
    problems: list[str]
    params: list[str]
    notes: list[str]
    tensors: list[TensorCheck]
    changed_share: float
    fold_expert_scale: bool
    merged_tensors: int
    copied_tensors: int
    folded_tensors: int
    ones_tensors: int
    max_ulps: int
    max_excess: float
    bytes: int
    seconds: float


class WeightCheckError(GemmaTpuError, ValueError):
    """A weight check that cannot start (no merge_info.json, a damaged base)."""


def _same_bytes(fa, fb, offset_a: int, offset_b: int, length: int) -> bool:
    fa.seek(offset_a)
    fb.seek(offset_b)
    while length > 0:
        n = min(CHUNK, length)
        if fa.read(n) != fb.read(n):
            return False
        length -= n
    return True


def _ordered(x: np.ndarray) -> np.ndarray:
    """A float array's bits as integers in the floats' order, so that two values' distance in ulps is the
    difference of theirs (+0 and -0 come out 1 apart); one pass, faster than ``safetensors_io.ulp_distance``."""
    bits = x.view(f"i{x.dtype.itemsize}")
    shift = 8 * x.dtype.itemsize - 1
    return (bits ^ ((bits >> shift) & ((1 << shift) - 1))).astype(np.int32 if x.dtype.itemsize == 2 else np.int64)


def _to_float32(x: np.ndarray) -> np.ndarray:
    """fp32 values of a block (exact): bf16 by moving its bits up (ten times faster than ml_dtypes' cast)."""
    if x.dtype.name == "bfloat16":
        out = x.view(np.uint16).astype(np.uint32)
        out <<= 16
        return out.view(np.float32)
    return x.astype(np.float32)


ULP_SCALE = {"bfloat16": 2.0 ** 16, "float16": 2.0 ** 13, "float32": 1.0}  # one ulp of the dtype / one fp32 ulp


def check_tensor(base_path: Path, merged_path: Path, b_off: int, m_off: int, entry: dict, d: merge_plan.Delta,
                 max_ulps: int = MAX_ULPS) -> dict:
    """One targeted tensor, in row blocks, against round(base + ΔW) (ΔW in fp32 with numpy), within
    :func:`allowed_error`; a NaN against a number fails. Returns the most ulps, the worst ``excess`` (error /
    allowed; over 1 fails), ``delta_rms`` and how many elements the merge changed. Thread-safe (own file handles)."""
    with open(base_path, "rb") as fb, open(merged_path, "rb") as fm:
        return _check_blocks(fb, fm, b_off, m_off, entry, d, max_ulps)


def allowed_error(value, dot, rank: int, dtype_name: str, max_ulps: int = MAX_ULPS, fold=None) -> np.ndarray:
    """How far two merges of one element may lie apart, whatever order BLAS or XLA sums the dot in: ``max_ulps`` of
    ``value`` in its stored dtype, plus twice (r+1)·2⁻²⁴·``dot`` (``dot`` = |scale|·Σ|aᵢ·bᵢ| for that element).
    Near zero, where W and ΔW cancel, that is many ulps of a tiny value. ``fold`` (a per_expert_scale s, the merged
    value s·(W + ΔW)): the dot's term times |s|, plus :data:`FOLD_ULPS` fp32 ulps of ``value``."""
    spacing = np.abs(np.spacing(np.asarray(value, np.float32)))
    extra = 0.0 if fold is None else FOLD_ULPS * spacing
    return max_ulps * spacing * ULP_SCALE.get(dtype_name, 1.0) + extra \
        + 2 * (rank + 1) * 2.0 ** -24 * np.asarray(dot) * (1.0 if fold is None else abs(float(fold)))


def _delta_rms(at: np.ndarray, bt: np.ndarray, scale: float) -> float:
    """RMS of ΔW = scale·bt·at from the factors, in O(r²·(out + in)) instead of a pass over ΔW:
    ‖bt·at‖_F² = trace(atᵀ·btᵀ·bt·at) = Σ (at·atᵀ) ∘ (btᵀ·bt), both r×r (fp64: no cancellation to speak of)."""
    a64, b64 = at.astype(np.float64), bt.astype(np.float64)
    sq = float(np.sum((a64 @ a64.T) * (b64.T @ b64)))
    return abs(float(scale)) * np.sqrt(max(sq, 0.0) / (bt.shape[0] * at.shape[1]))


def _readinto(f, offset: int, buf: np.ndarray) -> np.ndarray:
    f.seek(offset)
    if f.readinto(memoryview(buf).cast("B")) != buf.nbytes:
        raise WeightCheckError(f"{f.name} ended early (at byte {offset:,} + {buf.nbytes:,}).")
    return buf


def _check_blocks(fb, fm, b_off: int, m_off: int, entry: dict, d: merge_plan.Delta, max_ulps: int) -> dict:
    dtype = safetensors_io.np_dtype(entry["dtype"])
    if len(entry["shape"]) == 3:  # the MoE's experts: E matrices [out, in], one after the other, each its own ΔW
        return _check_experts(fb, fm, b_off, m_off, entry, d, max_ulps)
    out_dim, in_dim = entry["shape"]
    rows = 1 << (max(1, CHECK_BLOCK_ELEMENTS // in_dim).bit_length() - 1)
    at = np.ascontiguousarray(d.a.astype(np.float32).T)  # (r, in)
    bt = np.ascontiguousarray(d.b.astype(np.float32).T)  # (out, r): row blocks are contiguous
    scale = np.float32(d.scale)
    # A power-of-two scale folded into bᵀ once is exact (scaling by 2^k commutes with every rounding of the dot):
    # one pass less per block. Any other scale multiplies ΔW after the dot, as the merge rounds it.
    folded = bool(np.frexp(scale)[0] == 0.5)
    bts = bt * scale if folded else bt
    bits = np.dtype(f"u{dtype.itemsize}")
    bf16 = dtype.name == "bfloat16"
    fold = None if d.fold is None else np.float32(d.fold)
    worst, worst_at, err, excess, changed = 0, None, 0.0, 0.0, 0
    # one set of buffers per tensor, reused by every block (no allocation, no page faults per block)
    n_max = min(rows, out_dim) * in_dim
    wbuf, mbuf = np.empty(n_max, bits), np.empty(n_max, bits)
    xbuf, ubuf = np.empty(n_max, np.float32), np.empty(n_max, np.uint32)
    for r0 in range(0, out_dim, rows):
        r1 = min(out_dim, r0 + rows)
        n = (r1 - r0) * in_dim
        w = _readinto(fb, b_off + r0 * in_dim * dtype.itemsize, wbuf[:n])  # the bits
        m = _readinto(fm, m_off + r0 * in_dim * dtype.itemsize, mbuf[:n])
        x = np.matmul(bts[r0:r1], at, out=xbuf[:n].reshape(r1 - r0, in_dim)).reshape(-1)  # ΔW rows r0:r1
        if not folded:
            x *= scale
        if bf16:
            np.add(x, np.left_shift(w, 16, out=ubuf[:n], dtype=np.uint32).view(np.float32), out=x)  # W + ΔW, fp32
        else:
            np.add(_to_float32(w.view(dtype)), x, out=x)
        if fold is not None:
            x *= fold  # s_e·(W + ΔW), as the merge rounds it
        off, want = _rounding_misses(x, m, ubuf[:n], dtype, bits)
        if off.size:  # usually none: ulps only where the bits differ
            ulps, x_err, e = _errors_at(off, m, want, bt[r0:r1], at, in_dim, scale, dtype, max_ulps, fold)
            j = int(x_err.argmax())
            if x_err[j] > excess:
                i = int(off[j])
                excess, worst_at, err = float(x_err[j]), (r0 + i // in_dim, i % in_dim), float(e[j])
            worst = max(worst, int(ulps.max()))
        if fold is not None:  # what the merge changed beyond the fold: against round(s_e·W)
            w = (_to_float32(w.view(dtype)) * fold).astype(dtype).view(bits)
        changed += int(np.count_nonzero(m != w))
    return {"max_ulps": worst, "excess": excess, "worst_at": worst_at, "error_there": err,
            "delta_rms": _delta_rms(at, bt, scale), "changed": changed}


def _rounding_misses(x: np.ndarray, m: np.ndarray, ubuf: np.ndarray, dtype, bits) -> tuple[np.ndarray, np.ndarray]:
    """Where the merged bits ``m`` are not ``x`` (fp32 W + ΔW) rounded to ``dtype``: their indices, and the rounded
    values there."""
    if dtype.name == "bfloat16":
        # round(x) to bf16 is m where x lies less than half a bf16 ulp from m: on the bits (the floats' order
        # for one sign) |x_bits - m_bits·2¹⁶| < 2¹⁵, three in-place passes instead of rounding every element
        # (ml_dtypes' cast: about twice the cost). Ties (rounded to even), a sign change and a NaN against a
        # number land outside and go, with every real difference, through the exact cast below.
        u = np.left_shift(m, 16, out=ubuf, dtype=np.uint32)
        np.subtract(x.view(np.uint32), u, out=u)
        u += 0x7FFF
        off = np.flatnonzero(u > 0xFFFE)
        want = x[off].astype(dtype)  # ml_dtypes' round-to-nearest-even, as the merge rounds
        keep = m[off] != want.view(bits)
        return off[keep], want[keep]
    want = x.astype(dtype)
    off = np.flatnonzero(m != want.view(bits))
    return off, want[off]


def _errors_at(off, m, want, bt_rows, at, in_dim: int, scale, dtype, max_ulps: int, fold):
    """At the elements ``off`` of a block (merged bits ``m``, expected values ``want``): the ulps between merged
    and expected, the error over what rounding allows (inf for a NaN against a number), and the error itself."""
    mv, wv = m[off].view(dtype), want
    ulps = np.abs(_ordered(mv) - _ordered(wv))
    m32, w32 = _to_float32(mv), _to_float32(wv)
    e = np.abs(m32 - w32)
    rr, cc = off // in_dim, off % in_dim
    dot = abs(float(scale)) * np.einsum("ir,ir->i", np.abs(bt_rows[rr]), np.abs(at[:, cc].T))
    allowed = allowed_error(w32, dot, at.shape[0], dtype.name, max_ulps, fold)
    x_err = e / np.maximum(allowed, np.finfo(np.float32).tiny)
    nan_m, nan_w = np.isnan(m32), np.isnan(w32)
    x_err[nan_m != nan_w] = np.inf  # a NaN where base + ΔW is a number, or the reverse: fails
    x_err[nan_m & nan_w] = 0.0  # NaN both (a NaN in the base): another payload is no error
    x_err[np.isnan(x_err)] = np.inf  # inf against inf of the other sign
    return ulps, x_err, e


def _check_experts(fb, fm, b_off: int, m_off: int, entry: dict, d: merge_plan.Delta, max_ulps: int) -> dict:
    """:func:`_check_blocks` for each expert's matrix of a 3-D tensor, combined: the worst expert's figures (its
    index first in ``worst_at``), ΔW's RMS over all of them, the changed elements summed."""
    parts = [_check_blocks(fb, fm, b_off + at, m_off + at, matrix, part, max_ulps)
             for at, matrix, part in safetensors_io.expert_slabs(entry, d)]
    e = max(range(len(parts)), key=lambda i: parts[i]["excess"])
    worst = parts[e]
    return {"max_ulps": max(p["max_ulps"] for p in parts), "excess": worst["excess"],
            "worst_at": (e, *worst["worst_at"]) if worst["worst_at"] else None, "error_there": worst["error_there"],
            "delta_rms": float(np.sqrt(np.mean([p["delta_rms"] ** 2 for p in parts]))),
            "changed": sum(p["changed"] for p in parts)}


def verify_weights(base_dir, checkpoint_dir, merged_dir, step: int | None = None, max_ulps: int = MAX_ULPS,
                   progress: bool = True, arrays: dict | None = None) -> WeightCheck:
    """Check ``merged_dir`` against ``base_dir`` + the LoRA of ``checkpoint_dir`` (``step``, default its latest),
    streamed, a :class:`TensorCheck` per tensor. ``arrays``: that LoRA if already restored. Raises WeightCheckError
    or CheckpointError when the check cannot start."""
    started = time.perf_counter()
    base_dir = absolute_path(base_dir, "base directory")
    checkpoint_dir = absolute_path(checkpoint_dir, "checkpoint directory", remote=True)
    merged_dir = absolute_path(merged_dir, "merged directory")
    for d, what in ((base_dir, "base"), (merged_dir, "merged")):
        if not d.exists():
            raise WeightCheckError(f"The {what} directory {d} does not exist.")
        if not d.is_dir():
            raise WeightCheckError(f"The {what} directory {d} is a file, not a directory.")
    text, (index, shards, entries) = gemma4.checked_layout(base_dir)  # every base shard header, read once
    info = json.loads((merged_dir / MERGE_INFO).read_text()) if (merged_dir / MERGE_INFO).is_file() else None
    if info is None:
        raise WeightCheckError(f"{merged_dir} has no {MERGE_INFO}: it was not written by "
                               f"merge.merge_lora, so there is no record of what was merged.")
    meta = lora_checkpoint.read_lora_config(checkpoint_dir)
    if arrays is None or step is None:
        step, arrays = lora_checkpoint.restore_lora(checkpoint_dir, step)
    deltas = {d.hf: d for d in merge_plan.plan_merge(arrays, meta, text)}
    lora_names, ones = set(deltas), []
    if info.get("fold_expert_scale"):  # the merge folded per_expert_scale into experts.down_proj (merge_plan)
        deltas, ones = merge_plan.fold_expert_scales(deltas, entries,
                                                     lambda n: safetensors_io.read_tensor(base_dir, index, n))
    found = _Found()
    _check_merge_record(found, info, step, arrays, text, base_dir, checkpoint_dir)
    m_index, m_shards = _check_files(found, base_dir, merged_dir, index, shards)
    kinds = {n: "merged" if n in lora_names else "folded" if n in deltas else "ones" if n in ones else "copied"
             for names in shards.values() for n in names}
    rows = []
    total = sum((base_dir / s).stat().st_size for s in shards)
    bar = tqdm(total=total, desc="checking weights", unit="B", unit_scale=True, disable=not progress)
    # BLAS on one thread while the pool runs a tensor per core: else cores² BLAS threads wait on each other
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool, threadpool_limits(1, user_api="blas"):
        for shard in sorted(shards):
            if shard not in m_shards:
                bar.update((base_dir / shard).stat().st_size)
                continue
            rows += _check_shard(found, (base_dir / shard, merged_dir / shard, m_index), shards[shard], kinds, deltas,
                                 max_ulps, step, pool, bar)
    bar.close()
    return _summary(found, rows, entries, ones, step, total, started)


@dataclasses.dataclass
class _Found:
    """What :func:`verify_weights` found so far: problems, notes, and the parameter names the problems mention."""
    problems: list = dataclasses.field(default_factory=list)
    notes: list = dataclasses.field(default_factory=list)
    params: list = dataclasses.field(default_factory=list)

    def problem(self, text: str, param: str | None = None) -> None:
        self.problems.append(text)
        if param is not None and param not in self.params:
            self.params.append(param)


def _check_merge_record(found: _Found, info: dict, step: int, arrays: dict, text: dict, base_dir, checkpoint_dir):
    """What merge_info.json says was merged, against the checkpoint's step, its LoRA and the base's config."""
    if info.get("step") != step:
        found.problem(f"{MERGE_INFO} records step {info.get('step')}, not step {step} of {checkpoint_dir}: the "
                      f"merge is of another step (check that one with step={info.get('step')}, or merge again)",
                      "step")
    if info.get("lora_sha256") not in (None, lora_checkpoint.lora_digest(arrays)):
        found.problem(f"{MERGE_INFO} records another LoRA (sha256 {info['lora_sha256'][:12]}...) than step {step} "
                      f"of {checkpoint_dir}: merged from another run or checkpoint")
    if info.get("base_config_sha256") not in (None, config_hash(text)):
        found.problem(f"{MERGE_INFO} records another base config ({info['base_config_sha256']}) than "
                      f"{base_dir}/config.json ({config_hash(text)}): merged onto another base")
    if info.get("checkpoint_dir") not in (None, path_id(checkpoint_dir)):
        found.notes.append(f"merged from {info['checkpoint_dir']} (a copy of this checkpoint, by its LoRA digest)")


def _check_files(found: _Found, base_dir: Path, merged_dir: Path, index: dict, shards: dict):
    """The merged checkpoint's index and shards, and every other file of the base copied byte for byte; returns the
    merged index and shards (None, {} when they cannot be read)."""
    try:
        m_index, m_shards, _ = hf_checkpoint.checkpoint_layout(merged_dir)
    except hf_checkpoint.CheckpointError as e:
        found.problem(str(e))
        m_index, m_shards = None, {}
    if m_index is not None and m_index["weight_map"] != index["weight_map"]:
        moved = sorted(k for k in set(index["weight_map"]) | set(m_index["weight_map"])
                       if index["weight_map"].get(k) != m_index["weight_map"].get(k))
        found.problem(f"the merged index differs from the base's for {len(moved)} tensor(s), e.g. {moved[:3]}")
    for p in sorted(base_dir.iterdir()):
        if p.name in shards or p.name in (hf_checkpoint.INDEX, *IGNORED) or p.name.startswith(".") or p.is_dir():
            continue
        q = merged_dir / p.name
        if not q.is_file():
            found.problem(f"{q} is missing (the base has {p.name})")
        elif not filecmp.cmp(p, q, shallow=False):
            found.problem(f"{q} differs from the base's {p.name} (it must be a byte-identical copy)")
    return m_index, m_shards


def _check_shard(found: _Found, shard: tuple, names, kinds: dict, deltas: dict, max_ulps: int, step: int,
                 pool, bar) -> list[dict]:
    """A row per tensor of one shard (``(base file, merged file, merged index)``): copied ones compared byte for
    byte here, the scales folded to ones read, the targeted ones checked on ``pool``."""
    base, merged, merged_index = shard
    bh, b_start = hf_checkpoint.read_shard_header(base)
    mh, m_start = hf_checkpoint.read_shard_header(merged)
    rows, pending = [], []
    with open(base, "rb") as fb, open(merged, "rb") as fm:
        for name in sorted(names, key=lambda k: bh[k]["data_offsets"][0]):
            e, me = bh[name], mh.get(name)
            b0, b1 = e["data_offsets"]
            row = {"tensor": name, "kind": kinds[name], "dtype": e["dtype"], "shape": tuple(e["shape"]),
                   "max_ulps": 0, "excess": 0.0, "error_there": 0.0, "delta_rms": 0.0, "changed": 0, "ok": True}
            rows.append(row)
            if me is None or me["dtype"] != e["dtype"] or me["shape"] != e["shape"]:
                row.update(ok=False, max_ulps=None)
                found.problem(f"{name} in {merged}: " + ("missing" if me is None else
                                                              f"{me['dtype']}{me['shape']}, the base has "
                                                              f"{e['dtype']}{e['shape']}"))
            elif row["kind"] == "ones":
                got = safetensors_io.read_tensor(merged.parent, merged_index, name)
                if not np.all(got == 1):
                    row.update(ok=False, max_ulps=None)
                    found.problem(f"{name} in {merged} is {np.round(got[:4], 4).tolist()}..., not 1: "
                                  f"{MERGE_INFO} records fold_expert_scale, but the scale was not folded into "
                                  f"experts.down_proj (merge again with fold_expert_scale)", "fold_expert_scale")
            elif row["kind"] == "copied":
                if not _same_bytes(fb, fm, b_start + b0, m_start + me["data_offsets"][0], b1 - b0):
                    row.update(ok=False, max_ulps=None)
                    found.problem(f"{name} in {merged} differs from the base's, but the LoRA does not target "
                                  f"it (it must be a byte-identical copy)")
            else:
                pending.append((row, pool.submit(check_tensor, base, merged, b_start + b0,
                                                 m_start + me["data_offsets"][0], e, deltas[name], max_ulps)))
                continue
            bar.update(b1 - b0)
    for row, future in pending:
        row.update(future.result())
        bar.update(int(np.prod(row["shape"])) * safetensors_io.np_dtype(row["dtype"]).itemsize)
        _judge(found, row, merged, deltas[row["tensor"]], step, max_ulps)
    return rows


def _judge(found: _Found, row: dict, merged_shard: Path, delta, step: int, max_ulps: int) -> None:
    """A checked tensor's verdict: fails on a NaN or inf against a number, or an error over what is allowed."""
    if row["excess"] > 1 and not np.isfinite(row["error_there"]):  # NaN or inf against a number
        row["ok"] = False
        found.problem(f"{row['tensor']} in {merged_shard}: a NaN or inf at {row['worst_at']} where base + ΔW of "
                      f"step {step} is a number (or the reverse)")
    elif row["excess"] > 1:
        row["ok"] = False
        what = "per_expert_scale x (base + ΔW)" if delta.fold is not None else "base + ΔW"
        found.problem(f"{row['tensor']} in {merged_shard}: {row['max_ulps']:,} ulps from {what} of step {step}, "
                      f"|error| {row['error_there']:.3g} at {row['worst_at']}, {row['excess']:.3g}x what "
                      f"{max_ulps} ulp and the dot's rounding allow")


def _summary(found: _Found, rows: list[dict], entries: dict, ones: list, step: int, total: int,
             started: float) -> WeightCheck:
    """verify_weights' result: the rows, the verdict and what the stored dtype kept of ΔW."""
    merged_rows = [r for r in rows if r["kind"] == "merged"]
    checked = [r for r in rows if r["kind"] in ("merged", "folded")]
    unchanged = [r["tensor"] for r in merged_rows if r["ok"] and r["changed"] == 0]
    if unchanged:
        found.notes.append(f"{len(unchanged)} targeted tensor(s) came out bit-equal to the base: their ΔW is below "
                           f"the rounding of {entries[unchanged[0]]['dtype']} (e.g. {unchanged[0]})")
    # how much of ΔW the stored dtype kept: an element whose ΔW is under half an ulp of W comes out as the base's
    elements = sum(int(np.prod(r["shape"])) for r in merged_rows if r["ok"])
    share = sum(r["changed"] for r in merged_rows if r["ok"]) / elements if elements else 1.0
    if share < KEPT_SHARE:
        found.notes.append(f"the merge changed {share:.0%} of the targeted elements: for the rest ΔW is under the "
                           f"rounding of {merged_rows[0]['dtype']}, so the merged model is partly the base (the "
                           f"unmerged LoRA, e.g. the PEFT adapter, keeps all of it)")
    return WeightCheck(
        ok=not found.problems, step=step, problems=found.problems, params=found.params, notes=found.notes,
        tensors=[TensorCheck(**r) for r in rows], changed_share=share, fold_expert_scale=bool(ones),
        merged_tensors=len(merged_rows), copied_tensors=sum(r["kind"] == "copied" for r in rows),
        folded_tensors=sum(r["kind"] == "folded" for r in rows), ones_tensors=len(ones),
        max_ulps=max((r["max_ulps"] or 0 for r in checked), default=0),
        max_excess=max((r["excess"] for r in checked), default=0.0), bytes=total,
        seconds=time.perf_counter() - started)


def worst_tensors(result: WeightCheck, n: int = 8) -> list[TensorCheck]:
    """The tensors of ``result`` farthest from base + ΔW, worst first, then any tensor that failed (at most ``n``)."""
    rows = sorted(result.tensors, key=lambda r: (r.ok, -r.excess, -(r.max_ulps or 0)))
    return [r for r in rows if r.kind in ("merged", "folded") or not r.ok][:n]
