"""Check a merged checkpoint: transformers and tunix on the merged files against tunix base + the checkpoint's LoRA
(:func:`verify_merge`, a :class:`MergeCheck`; a table is ``pandas.DataFrame(check.rows)``). :func:`perturbed_lora`
gives a LoRA strong enough for the check to see a wrong layout.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ..core.errors import GemmaTpuError
from ..core.file_io import absolute_path
from ..model import gemma4, hf_checkpoint, parity
from ..model import mesh as mesh_lib
from ..train import lora
from ..train.lora_checkpoint import lora_digest, read_lora_config, restore_lora
from . import weight_check
from .merge import merge_lora, read_merge_info


@dataclasses.dataclass
class Comparison:
    """Two models' logits on the same tokens: max |Δlogit|, the reference's largest |logit| and their ratio
    ``rel``; ``bound``: what ``rel`` must stay within (None: a row for scale, not checked)."""
    comparison: str
    max_abs: float
    scale: float
    rel: float
    bound: float | None


@dataclasses.dataclass
class MergeCheck:
    """What :func:`verify_merge` found: ``ok`` when every bounded row is within ``bound`` and ``weights`` is ok;
    ``stored_dtype`` the merge's (a narrow one is checked through its fp32 twin, ``storage_rel`` what it moves);
    ``same_lora_as_merge``: merge_info.json names this LoRA (None: no record)."""
    ok: bool
    step: int
    bound: float
    bound_rule: str
    port_rel: float
    seq_len: int
    stored_dtype: str
    storage_rel: float
    rows: list[Comparison]
    weights: weight_check.WeightCheck
    notes: list[str]
    merge_step: int | None
    same_lora_as_merge: bool | None
    max_rel: float
    lora_effect_rel: float

    @property
    def problems(self) -> list[str]:
        return self.weights.problems


class VerifyError(GemmaTpuError, ValueError):
    """A checkpoint's LoRA that does not fit the LoRA model built from its lora_config.json."""


def perturbed_lora(arrays: dict[str, np.ndarray], seed: int = 0, b_std: float = 0.05) -> dict[str, np.ndarray]:
    """The same LoRA with random B (trained B starts at zero and stays small in a 2-step run): a strong signal for
    layout tests, where a wrong transpose or a k/v swap moves the logits by O(1)."""
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal(v.shape).astype(v.dtype) * b_std if k.endswith("_lora_b") else v)
            for k, v in arrays.items()}


def lora_model(base_dir, checkpoint_dir, mesh, step: int | None = None, arrays=None):
    """The tunix base + the checkpoint's LoRA (fp32), the reference a merge must reproduce."""
    import jax
    from flax import nnx

    meta = read_lora_config(checkpoint_dir)
    if arrays is None:
        _, arrays = restore_lora(checkpoint_dir, step)
    model = gemma4.load_model(base_dir, mesh, dtype="float32")
    model, _ = lora.apply_lora(model, meta["targets"], int(meta["rank"]), float(meta["alpha"]), 0.0,
                               expert_rank=meta.get("expert_rank"))
    state = nnx.state(model, nnx.LoRAParam)
    flat = nnx.to_flat_state(state)
    seen = set()
    for path, var in flat:
        key = "/".join(map(str, path))
        if key not in arrays:
            raise VerifyError(f"The LoRA model has {key}, which the checkpoint lacks.")
        cur = var.value
        if tuple(cur.shape) != tuple(arrays[key].shape):
            raise VerifyError(f"{key}: model {tuple(cur.shape)} vs checkpoint {tuple(arrays[key].shape)}.")
        var.value = jax.device_put(np.asarray(arrays[key], dtype=cur.dtype), cur.sharding)
        seen.add(key)
    if set(arrays) - seen:
        raise VerifyError(f"Checkpoint params not in the LoRA model: {sorted(set(arrays) - seen)[:3]}")
    nnx.update(model, nnx.from_flat_state(flat))
    return model


NARROW = ("BF16", "F16")  # stored dtypes whose rounding of W + ΔW moves the logits far more than the port's residual


def fp32_merge(base_dir, checkpoint_dir, step: int, out_dir, fold_expert_scale: bool = True) -> Path:
    """The same merge with nothing rounded, for small models: the base widened to fp32 in ``out_dir``/base, merged
    into ``out_dir``/merged (``fold_expert_scale`` as the merge's). A bf16 merge is this rounded to bf16, within 1 ulp
    (the weight check)."""
    from safetensors.numpy import load_file, save_file

    base = Path(out_dir) / "base"
    shutil.copytree(base_dir, base, ignore=shutil.ignore_patterns(".*"))
    for shard in base.glob("*.safetensors"):
        tensors = {k: (v.astype(np.float32) if v.dtype.name in ("bfloat16", "float16") else v)
                   for k, v in load_file(shard).items()}
        save_file(tensors, shard, metadata={"format": "pt"})
    return merge_lora(base, checkpoint_dir, Path(out_dir) / "merged", step=step, progress=False,
                      fold_expert_scale=fold_expert_scale).out_dir


def _compare(what: str, ours: np.ndarray, ref: np.ndarray, bound: float | None) -> Comparison:
    diff = float(np.abs(ours - ref).max())
    scale = float(np.abs(ref).max())
    return Comparison(what, diff, scale, diff / max(scale, 1e-30), bound)


# The logits bound is PORT_FACTOR x the port's own fp32 residual (transformers vs tunix on the base, same tokens): a
# correct merge measured under 2x of it, a wrong one moves the logits by the LoRA's effect, orders of magnitude more.
# BOUND_FLOOR keeps a bound when both implementations agree exactly.
PORT_FACTOR = 4.0
LOST_SHARE = 0.5  # bf16 storage moving the logits by over half the LoRA's effect: say that the merge lost much of it
BOUND_FLOOR = 1e-6


def _merged_logits(base_dir, checkpoint_dir, merged_dir, step: int, fold: bool, narrow: list, tokens,
                   mesh) -> dict:
    """transformers' and tunix's logits of the merge: of its unrounded fp32 twin for a bf16 merge, and then of the
    stored files too ("stored hf", "stored tunix")."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="verify-fp32-") as tmp:
        exact_dir = fp32_merge(base_dir, checkpoint_dir, step, tmp, fold) if narrow else merged_dir
        out["hf"], _ = parity.hf_logits_and_hidden(parity.load_hf(exact_dir), tokens)
        out["tunix"] = parity.tunix_logits(gemma4.load_model(exact_dir, mesh, dtype="float32"), tokens, mesh)
    if narrow:
        out["stored tunix"] = parity.tunix_logits(gemma4.load_model(merged_dir, mesh, dtype="float32"), tokens, mesh)
        out["stored hf"], _ = parity.hf_logits_and_hidden(parity.load_hf(merged_dir), tokens)
    return out


def _rows(logits: dict, ref, base_logits, port: Comparison, narrow: str | None, bound: float) -> list[Comparison]:
    """verify_merge's comparisons: (a), (b) and for a bf16 merge (c) within ``bound``; the LoRA's effect, the port's
    residual and what bf16 storage moves, for scale."""
    what = "merged in fp32" if narrow else "merged"
    rows = [_compare(f"(a) transformers({what}) vs tunix(base + LoRA)", logits["hf"], ref, bound),
            _compare(f"(b) tunix({what}) vs tunix(base + LoRA)", logits["tunix"], ref, bound)]
    if narrow:
        rows.append(_compare(f"(c) transformers(merged {narrow}) vs tunix(merged {narrow})", logits["stored hf"],
                             logits["stored tunix"], bound))
    rows += [_compare("LoRA effect: tunix(base) vs tunix(base + LoRA)", base_logits, ref, None), port]
    if narrow:
        rows.append(_compare(f"{narrow} storage: tunix(merged {narrow}) vs tunix(merged in fp32)",
                             logits["stored tunix"], logits["tunix"], None))
    return rows


def verify_merge(base_dir, checkpoint_dir, merged_dir, step: int | None = None, mesh=None, seq_len: int = 40,
           seed: int = 0, bound: float | None = None) -> MergeCheck:
    """Check a merged checkpoint in fp32 (small models; the 31B gets the weight check alone); return ``ok``, a row
    per comparison and the weight check's problems.

    The streamed weight check names a wrong tensor, file or step. Then, on the same tokens, relative max |Δlogit|:
    (a) transformers and (b) tunix on the merged files vs tunix base + the checkpoint's LoRA, within ``bound``
    (default ``PORT_FACTOR`` x the port's residual), beside the LoRA's own effect. bf16 rounding of W + ΔW moves the
    logits unpredictably, so a bf16 merge is checked through :func:`fp32_merge`, (c) checks that both read the bf16
    files alike, and a last row says what bf16 storage moves. ``mesh``: default, every device on fsdp.
    """
    import jax

    base_dir = absolute_path(base_dir, "base directory")
    checkpoint_dir = absolute_path(checkpoint_dir, "checkpoint directory", remote=True)
    merged_dir = absolute_path(merged_dir, "merged directory")
    # both checkpoints' files, before minutes of loading (a damaged shard: one line)
    gemma4.check_checkpoint(base_dir)
    gemma4.check_checkpoint(merged_dir)
    mesh = mesh if mesh is not None else mesh_lib.make_mesh((jax.device_count(), 1), ("fsdp", "tp"))
    step, arrays = restore_lora(checkpoint_dir, step)
    weights = weight_check.verify_weights(base_dir, checkpoint_dir, merged_dir, step=step, progress=False,
                                          arrays=arrays)
    info = read_merge_info(merged_dir)
    text = hf_checkpoint.read_text_config(merged_dir)
    tokens = parity.sample_tokens(text["vocab_size"], seq_len, seed)
    ref_model = lora_model(base_dir, checkpoint_dir, mesh, step, arrays=arrays)
    ref = parity.tunix_logits(ref_model, tokens, mesh)
    del ref_model
    base_logits = parity.tunix_logits(gemma4.load_model(base_dir, mesh, dtype="float32"), tokens, mesh)
    hf_base, _ = parity.hf_logits_and_hidden(parity.load_hf(base_dir), tokens)
    port = _compare("port: transformers(base) vs tunix(base)", hf_base, base_logits, None)
    if bound is None:
        bound, rule = max(PORT_FACTOR * port.rel, BOUND_FLOOR), f"{PORT_FACTOR:g} x the port's residual"
    else:
        rule = "fixed"
    narrow = sorted({r.dtype for r in weights.tensors if r.kind == "merged" and r.dtype in NARROW})
    fold = bool(info and info.get("fold_expert_scale"))  # merged as the files were: folded or not
    logits = _merged_logits(base_dir, checkpoint_dir, merged_dir, step, fold, narrow, tokens, mesh)
    rows = _rows(logits, ref, base_logits, port, narrow[0] if narrow else None, bound)
    notes = []
    effect = next(r.rel for r in rows if r.comparison.startswith("LoRA effect"))
    if narrow and rows[-1].rel > LOST_SHARE * effect:
        notes.append(f"{narrow[0]} storage moves the logits by {rows[-1].rel:.1e}, {rows[-1].rel / effect:.0%} "
                     f"of the LoRA's own effect ({effect:.1e}): much of ΔW is below {narrow[0]}'s rounding, so the "
                     f"merged model is partly the base. Serve the LoRA unmerged (the PEFT adapter) to keep all of it.")
    checked = [r for r in rows if r.bound is not None]
    return MergeCheck(
        ok=all(r.rel <= bound for r in checked) and weights.ok, step=step, bound=bound, bound_rule=rule,
        port_rel=port.rel, seq_len=seq_len, stored_dtype=narrow[0] if narrow else "F32",
        storage_rel=rows[-1].rel if narrow else 0.0, rows=rows, weights=weights, notes=notes,
        merge_step=info.get("step") if info else None,
        same_lora_as_merge=(info.get("lora_sha256") == lora_digest(arrays)) if info else None,
        max_rel=max(r.rel for r in checked), lora_effect_rel=effect)
