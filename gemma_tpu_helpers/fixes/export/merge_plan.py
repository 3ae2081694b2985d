"""The merge's plan: which HF tensor gets which ΔW, from a LoRA checkpoint's arrays and the base's config.

Read from :mod:`layout`'s table (tunix module -> HF tensor(s), shapes, the ΔW reshape): a module's LoRA is checked
against the table's shapes for this base, and each row on it gives one :class:`Delta` (a ``kv_einsum`` gives two:
k is ``B[:, 0]``, v is ``B[:, 1]``, with one shared A). The MoE's routed experts (``layout.EXPERT_ROWS``) give one
3-D :class:`Delta` per tensor: one A and B per expert (:func:`fold_expert_scales`: their per_expert_scale).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from ..core.errors import GemmaTpuError
from ..model import hf_checkpoint, layout


class LoraMismatchError(GemmaTpuError, ValueError):
    """LoRA arrays that do not fit the base or their lora_config.json (another model, missing or extra modules)."""


@dataclasses.dataclass
class Delta:
    """One HF tensor's LoRA update: ΔW = scale · (A2 · B2)ᵀ, with A2 (in, r) and B2 (r, out); for a 3-D expert
    tensor (E, out, in), A2 (E, in, r) and B2 (E, r, out): one such update per expert."""

    hf: str  # full HF tensor name
    module: str  # tunix module path, e.g. layers/3/attn/kv_einsum (layers/3/moe/linear for an expert tensor)
    target: str  # HF target name (q_proj ...)
    a: np.ndarray  # (in, r), or (E, in, r)
    b: np.ndarray  # (r, out), or (E, r, out)
    scale: float
    note: str = ""
    fold: np.ndarray | None = None  # (E,) per_expert_scale: the merged tensor is fold_e·(W_e + ΔW_e)

    @property
    def shape(self) -> tuple[int, ...]:  # HF [out, in], or [E, out, in]
        return (*self.a.shape[:-2], self.b.shape[-1], self.a.shape[-2])

    def parts(self) -> list[Delta]:
        """The 2-D updates, in the tensor's storage order: itself, or one per expert (its contiguous [out, in])."""
        if self.a.ndim == 2:
            return [self]
        folds = [None] * len(self.a) if self.fold is None else self.fold
        return [dataclasses.replace(self, a=a, b=b, fold=f) for a, b, f in zip(self.a, self.b, folds, strict=True)]

    def delta(self) -> np.ndarray:
        """ΔW in fp32, HF layout [out, in] (or [E, out, in])."""
        if self.a.ndim == 3:
            return np.stack([p.delta() for p in self.parts()])
        return (np.float32(self.scale) * (self.a.astype(np.float32) @ self.b.astype(np.float32))).T


_EXPERT_PATH = re.compile(r"^layers/(\d+)/moe/(" + "|".join(r.param for r in layout.EXPERT_ROWS) + r")_lora_([ab])$")


def group_modules(arrays: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """``{"layers/0/attn/q_einsum": {"a": A, "b": B}}`` (``"layers/0/moe/linear"`` for an expert tensor); raises
    LoraMismatchError on paths that are not tunix LoRA params of a module in the layout table."""
    modules: dict[str, dict] = {}
    for path, arr in arrays.items():
        parsed, expert = layout.parse_lora_path(path), _EXPERT_PATH.match(path)
        if expert:
            key, ab = f"layers/{expert.group(1)}/moe/{expert.group(2)}", expert.group(3)
        elif not parsed or parsed[2] != layout.rows_of_module(parsed[1])[0].param:
            raise LoraMismatchError(f"Unexpected LoRA param {path!r} in the checkpoint (not a tunix Gemma 4 "
                                    f"attention/MLP module or routed expert): plan_merge reads the LoRA params "
                                    f"of tunix's Gemma 4 as qwix names them (layers/<i>/attn/q_einsum/w_lora_a).")
        else:
            layer, module, _, ab = parsed
            key = f"layers/{layer}/{module}"
        if ab in modules.setdefault(key, {}):
            raise LoraMismatchError(f"{key} has two LoRA {ab.upper()} params.")
        modules[key][ab] = arr
    for key, ab in modules.items():
        if set(ab) != {"a", "b"}:
            raise LoraMismatchError(f"{key} has LoRA {sorted(ab)} but needs both a and b.")
    return modules


def plan_merge(arrays: dict[str, np.ndarray], meta: dict, text_config: dict) -> list[Delta]:
    """Every HF tensor update the checkpoint implies, checked against the LoRA config and the base config.

    Raises LoraMismatchError when a module is missing or extra (wrong number of layers), or a shape does not fit
    (another base model: other heads or widths), or the rank is not the recorded one.
    """
    rank, alpha = int(meta["rank"]), float(meta["alpha"])
    scale = alpha / rank
    experts = [t for t in meta["targets"] if t in layout.EXPERT_TARGETS]
    targets = layout.check_targets([t for t in meta["targets"] if t not in layout.EXPERT_TARGETS])
    n_layers = text_config["num_hidden_layers"]
    if meta.get("num_layers") not in (None, n_layers):
        raise LoraMismatchError(f"The LoRA was trained on a {meta['num_layers']}-layer base, but this base has "
                                f"{n_layers} layers: wrong base model (lora_config.json "
                                f"base_model={meta.get('base_model')!r}).")
    modules = group_modules(arrays)
    expert_rank = int(meta.get("expert_rank") or rank)
    expected_experts = _expert_modules(text_config, experts, expert_rank)
    expected = {**layout.modules(text_config, targets), **expected_experts}
    extra = sorted(set(modules) - set(expected), key=_natural)
    missing = sorted(set(expected) - set(modules), key=_natural)
    if extra:
        raise LoraMismatchError(f"The checkpoint has LoRA for {len(extra)} module(s) this base/config does not have "
                                f"or that lora_config.json does not target, e.g. {extra[:3]} (base has {n_layers} "
                                f"layers; targets {list(targets)}): wrong base model?")
    if missing:
        raise LoraMismatchError(f"The checkpoint lacks LoRA for {len(missing)} targeted module(s), e.g. "
                                f"{missing[:3]}: the checkpoint and its lora_config.json disagree, or the base is "
                                f"another model.")
    deltas = []
    for key in sorted(modules, key=_natural):
        if key in expected_experts:
            deltas.append(_expert_delta(key, modules[key], expected_experts[key], alpha / expert_rank))
            continue
        layer, rows = expected[key]
        a, b = modules[key]["a"], modules[key]["b"]
        a_shape, b_shape = rows[0].a(layer, rank), rows[0].b(layer, rank)
        if tuple(a.shape) != tuple(a_shape) or tuple(b.shape) != tuple(b_shape):
            raise LoraMismatchError(f"{key}: LoRA A {tuple(a.shape)} / B {tuple(b.shape)} do not fit this base, "
                                    f"which needs A {tuple(a_shape)} / B {tuple(b_shape)} (rank {rank}): the base is "
                                    f"another model (other heads/widths) than the one trained on.")
        for row in rows:
            a2, b2 = layout.delta_factors(row, a, b, rank)
            deltas.append(Delta(layout.hf_key(layer.index, row), key, row.target, a2, b2, scale, row.note))
    return deltas


def _expert_modules(text_config: dict, targets, rank: int) -> dict[str, tuple[int, layout.ExpertRow, dict]]:
    """``{"layers/<i>/moe/<param>": (layer, row, {"a": shape, "b": shape})}`` of the targeted expert tensors."""
    shapes = layout.expert_lora_shapes(text_config, rank, targets)
    rows = {r.param: r for r in layout.EXPERT_ROWS}
    out = {}
    for path, shape in shapes.items():
        key, ab = path.rsplit("_lora_", 1)
        layer, param = int(key.split("/")[1]), key.rsplit("/", 1)[1]
        out.setdefault(key, (layer, rows[param], {}))[2][ab] = shape
    return out


def _expert_delta(key: str, ab: dict, expected, scale: float) -> Delta:
    layer, row, shapes = expected
    if tuple(ab["a"].shape) != shapes["a"] or tuple(ab["b"].shape) != shapes["b"]:
        raise LoraMismatchError(f"{key}: LoRA A {tuple(ab['a'].shape)} / B {tuple(ab['b'].shape)} do not fit this "
                                f"base's experts, which need A {shapes['a']} / B {shapes['b']} (expert rank "
                                f"{shapes['a'][-1]}): another base model, or another expert rank.")
    return Delta(f"{hf_checkpoint.KEY_PREFIX}layers.{layer}.{row.target}", key, row.target, ab["a"], ab["b"], scale,
                 f"one ΔW per expert; HF {row.hf_layout}")


def fold_expert_scales(deltas: dict[str, Delta], entries: dict, read) -> tuple[dict[str, Delta], list[str]]:
    """``deltas`` with each MoE layer's ``per_expert_scale`` s (``read(name)``) folded into its ``experts.down_proj``:
    expert e's output s_e·down_e(h) is linear in down_e, so down_e becomes s_e·(W_e + ΔW_e) (a rank-0 Delta if no
    LoRA) and s ones (tpu-inference never applies s); and the names of the s."""
    out, ones = dict(deltas), []
    for name in sorted(n for n in entries if n.endswith(".router.per_expert_scale")):
        down, s = name.removesuffix("router.per_expert_scale") + "experts.down_proj", np.asarray(read(name), np.float32)
        shape = tuple(entries.get(down, {}).get("shape", ()))
        if len(shape) != 3 or s.shape != shape[:1]:
            raise LoraMismatchError(f"{name} {s.shape} has no [E, out, in] {down} with E = {s.size} beside it "
                                    f"({shape or 'missing'}): not a Gemma 4 MoE checkpoint to fold.")
        d = out.get(down) or Delta(down, "per_expert_scale", "experts.down_proj", np.zeros((shape[0], shape[2], 0),
                                   np.float32), np.zeros((shape[0], 0, shape[1]), np.float32), 1.0, "no LoRA")
        out[down] = dataclasses.replace(d, fold=s, note=f"{d.note}; per_expert_scale folded in")
        ones.append(name)
    return out, ones


def _natural(s: str):
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", s)]

