"""The tunix <-> Hugging Face LoRA layout of Gemma 4 as one table, :data:`ROWS`, and the functions over it.

qwix names LoRA params after tunix modules (``layers/5/attn/k_einsum/w_lora_a``); Hugging Face, PEFT and vLLM after
the checkpoint's projections (``...layers.5.self_attn.k_proj.weight``). Every mapping between the two reads this table:
one :class:`Row` per (HF target, tunix module), with its shapes and the layers it applies to. A new model family is
new rows, and a new :class:`Layer` field if its layers differ in a way the rows must see.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

from ..core.errors import GemmaTpuError
from .hf_checkpoint import KEY_PREFIX, kv_shared_layers, layer_kinds


class LayoutError(GemmaTpuError, ValueError):
    """A target name, a LoRA param path or a shape that the layout table does not know."""


@dataclasses.dataclass(frozen=True)
class Layer:
    """What the rows need to know about one decoder layer of a text config."""

    index: int
    kind: str  # "local" (sliding) or "global" (full attention)
    kv_shared: bool  # reads an earlier layer's K/V (E2B/E4B): no k/v projection runs here
    k_eq_v: bool  # a global layer whose V is K (31B): only k_einsum, no v_proj
    d: int  # hidden
    n: int  # query heads
    k: int  # KV heads of this layer's kind
    h: int  # head dim of this layer's kind
    f: int  # MLP intermediate width of this layer


def layers(text_config: dict) -> list[Layer]:
    """One :class:`Layer` per decoder layer of a HF Gemma 4 text config."""
    c = text_config
    shared = kv_shared_layers(c)
    out = []
    for i, kind in enumerate(layer_kinds(c)):
        is_global = kind == "global"
        k = (c.get("num_global_key_value_heads") or c["num_key_value_heads"]) if is_global else c["num_key_value_heads"]
        f = c["intermediate_size"] * (2 if i in shared and c.get("use_double_wide_mlp") else 1)
        out.append(Layer(i, kind, i in shared, is_global and bool(c.get("attention_k_eq_v")), c["hidden_size"],
                         c["num_attention_heads"], k, c["global_head_dim"] if is_global else c["head_dim"], f))
    return out


Shape = Callable[[Layer, object], tuple]


@dataclasses.dataclass(frozen=True)
class Row:
    """One HF target on one tunix module, and the layers it applies to."""

    target: str  # HF / PEFT target name
    module: str  # tunix module under ``layers/<i>/`` (what qwix's module_path regex must match)
    param: str  # the tunix weight's name: LoRA params are ``<param>_lora_a`` / ``<param>_lora_b``
    hf_module: str  # under ``model.language_model.layers.<i>.``
    weight: Callable[[Layer], tuple]  # the tunix base weight's shape
    a: Shape  # LoRA A's shape (layer, rank)
    b: Shape  # LoRA B's shape (layer, rank)
    applies: Callable[[Layer], bool]
    b_part: int | None = None  # B[:, b_part] is this target's (k and v share kv_einsum's A)
    note: str = ""

    @property
    def lora_a(self) -> str:
        return f"{self.param}_lora_a"

    @property
    def lora_b(self) -> str:
        return f"{self.param}_lora_b"

    def hf_shape(self, layer: Layer) -> tuple[int, int]:
        """The HF weight ``[out, in]`` that ΔW of this row has."""
        a, b = self.a(layer, 1), self.b(layer, 1)
        out = math.prod(b[2:]) if self.b_part is not None else math.prod(b)
        return (out, math.prod(a))


def _kv(layer: Layer) -> bool:
    return not layer.kv_shared and not layer.k_eq_v


def _always(layer: Layer) -> bool:
    return True


ROWS: tuple[Row, ...] = (
    Row("q_proj", "attn/q_einsum", "w", "self_attn.q_proj", lambda L: (L.n, L.d, L.h),
        lambda L, r: (L.d, r), lambda L, r: (r, L.n, L.h), _always),
    Row("k_proj", "attn/kv_einsum", "w", "self_attn.k_proj", lambda L: (2, L.k, L.d, L.h),
        lambda L, r: (L.d, r), lambda L, r: (r, 2, L.k, L.h), _kv, b_part=0,
        note="k and v share this module: LoRA on either adapts both (one A, B[:, 0] is k, B[:, 1] is v)"),
    Row("k_proj", "attn/k_einsum", "w", "self_attn.k_proj", lambda L: (L.k, L.d, L.h),
        lambda L, r: (L.d, r), lambda L, r: (r, L.k, L.h), lambda L: L.k_eq_v and not L.kv_shared,
        note="global k=v layer: K only (it is also V); regexes without k_einsum miss it"),
    Row("v_proj", "attn/kv_einsum", "w", "self_attn.v_proj", lambda L: (2, L.k, L.d, L.h),
        lambda L, r: (L.d, r), lambda L, r: (r, 2, L.k, L.h), _kv, b_part=1,
        note="the k_proj row's module: v is B[:, 1], with k's A"),
    Row("o_proj", "attn/attn_vec_einsum", "w", "self_attn.o_proj", lambda L: (L.n, L.h, L.d),
        lambda L, r: (L.n, L.h, r), lambda L, r: (r, L.d), _always),
    Row("gate_proj", "mlp/gate_proj", "kernel", "mlp.gate_proj", lambda L: (L.d, L.f),
        lambda L, r: (L.d, r), lambda L, r: (r, L.f), _always),
    Row("up_proj", "mlp/up_proj", "kernel", "mlp.up_proj", lambda L: (L.d, L.f),
        lambda L, r: (L.d, r), lambda L, r: (r, L.f), _always),
    Row("down_proj", "mlp/down_proj", "kernel", "mlp.down_proj", lambda L: (L.f, L.d),
        lambda L, r: (L.f, r), lambda L, r: (r, L.d), _always),
)

TARGETS: tuple[str, ...] = tuple(dict.fromkeys(r.target for r in ROWS))  # the canonical target order
MODULES: tuple[str, ...] = tuple(dict.fromkeys(r.module for r in ROWS))


def check_targets(targets) -> tuple[str, ...]:
    """The targets in canonical order; raises :class:`LayoutError` on a name no row has."""
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise LayoutError(f"Unknown LoRA target(s) {unknown}; the table has {', '.join(TARGETS)}.")
    return tuple(t for t in TARGETS if t in targets)


def rows_for(layer: Layer, targets=TARGETS) -> list[Row]:
    """The rows that apply to ``layer`` for ``targets`` (at most one per target)."""
    targets = check_targets(targets)
    return [r for r in ROWS if r.target in targets and r.applies(layer)]


def row_for(target: str, layer: Layer) -> Row | None:
    """The row of ``target`` on ``layer``, or None when the layer has no such projection."""
    found = rows_for(layer, [target])
    return found[0] if found else None


def rows_of_module(module: str) -> tuple[Row, ...]:
    """The rows on a tunix module, by its path under the layer (``attn/kv_einsum``) or its last part (``kv_einsum``)."""
    return tuple(r for r in ROWS if module in (r.module, r.module.rsplit("/", 1)[-1]))


def qwix_regex(targets=TARGETS) -> str:
    """The qwix ``module_path`` regex (qwix full-matches it on ``layers/<i>/attn/q_einsum``-style paths)."""
    modules = dict.fromkeys(r.module for r in ROWS if r.target in check_targets(targets))
    return ".*/(" + "|".join(re.escape(m) for m in modules) + ")"


def modules(text_config: dict, targets=TARGETS) -> dict[str, tuple[Layer, tuple[Row, ...]]]:
    """``{"layers/<i>/<module>": (layer, rows on it)}``: every tunix module that gets LoRA for ``targets``, with all
    the rows it feeds (a ``kv_einsum`` targeted for v_proj alone still adapts k: one module, two rows)."""
    targets = check_targets(targets)
    out: dict[str, tuple[Layer, tuple[Row, ...]]] = {}
    for layer in layers(text_config):
        for m in dict.fromkeys(r.module for r in rows_for(layer, targets)):
            out[f"layers/{layer.index}/{m}"] = (layer, tuple(r for r in ROWS if r.module == m and r.applies(layer)))
    return out


def lora_shapes(text_config: dict, rank: int, targets=TARGETS) -> dict[str, tuple]:
    """``{"layers/<i>/<module>/<param>_lora_a": shape, ..._lora_b: shape}``: the LoRA params qwix creates."""
    out = {}
    for path, (layer, rows) in modules(text_config, targets).items():
        row = rows[0]
        out[f"{path}/{row.lora_a}"] = row.a(layer, rank)
        out[f"{path}/{row.lora_b}"] = row.b(layer, rank)
    return out


def lora_param_count(text_config: dict, rank: int, targets=TARGETS, expert_rank: int | None = None) -> int:
    """LoRA parameters for ``targets`` at ``rank`` (a shared kv_einsum counted once); the routed experts'
    (:data:`EXPERT_TARGETS`) at ``expert_rank`` (default ``rank``)."""
    targets = [targets] if isinstance(targets, str) else list(targets)
    dense = [t for t in targets if t not in EXPERT_TARGETS]
    experts = expert_lora_shapes(text_config, expert_rank or rank, [t for t in targets if t in EXPERT_TARGETS])
    return sum(math.prod(s) for s in [*lora_shapes(text_config, rank, dense).values(), *experts.values()])


_PATH_RE = re.compile(r"^layers/(\d+)/(" + "|".join(re.escape(m) for m in MODULES) + r")/(\w+)_lora_([ab])$")


def parse_lora_path(path: str) -> tuple[int, str, str, str] | None:
    """``"layers/3/attn/kv_einsum/w_lora_a"`` -> ``(3, "attn/kv_einsum", "w", "a")``; None for another path."""
    m = _PATH_RE.match(path)
    return (int(m.group(1)), m.group(2), m.group(3), m.group(4)) if m else None


def hf_key(layer: int, row: Row) -> str:
    """The HF tensor a row's ΔW is added to: ``model.language_model.layers.<i>.self_attn.q_proj.weight``."""
    return f"{KEY_PREFIX}layers.{layer}.{row.hf_module}.weight"


def targeted_weights(text_config: dict, targets=TARGETS) -> dict[str, tuple[int, int]]:
    """``{HF key: [out, in]}`` of every frozen weight a LoRA on ``targets`` adapts: what the merge rewrites and
    QLoRA quantizes (k and v of a kv_einsum count as two weights, a k=v layer's K as one)."""
    return {hf_key(layer.index, row): row.hf_shape(layer) for layer in layers(text_config)
            for row in rows_for(layer, targets)}


def delta_factors(row: Row, a, b, rank: int):
    """``(A2 (in, r), B2 (r, out))`` of one row from the tunix arrays: ``ΔW = scale · (A2 · B2)ᵀ``."""
    part = b[:, row.b_part] if row.b_part is not None else b
    return a.reshape(-1, rank), part.reshape(rank, -1)


# The MoE's routed experts (26B-A4B): 3-D tensors, one LoRA A and B per expert (expert_lora.py). Not in ROWS yet:
# the merge, the PEFT export and the plan read ROWS only, so check_targets refuses these names there.


@dataclasses.dataclass(frozen=True)
class ExpertRow:
    """One routed-expert tensor: its PEFT ``target_parameters`` name, the tunix param under ``layers/<i>/moe``,
    and the ``(in, out)`` of each expert's matrix as tunix's ``ragged_dot`` multiplies it."""

    target: str
    param: str
    in_out: Callable[[dict], tuple[int, int]]  # from the text config
    hf_layout: str  # the HF tensor's (E, out, in) layout, in words
    contracted: int  # the axis of tunix's param that the matmul sums over (``in``)


EXPERT_ROWS: tuple[ExpertRow, ...] = (
    ExpertRow("experts.gate_up_proj", "gating_einsum",
              lambda c: (c["hidden_size"], 2 * c["moe_intermediate_size"]),
              "(E, 2I, D): gate is the first I rows, up the second; tunix keeps (E, 2, I, D)", contracted=3),
    ExpertRow("experts.down_proj", "linear", lambda c: (c["moe_intermediate_size"], c["hidden_size"]),
              "(E, D, I); tunix keeps (E, I, D)", contracted=1),
)
EXPERT_TARGETS: tuple[str, ...] = tuple(r.target for r in EXPERT_ROWS)


def expert_lora_shapes(text_config: dict, rank: int, targets=EXPERT_TARGETS) -> dict[str, tuple]:
    """``{"layers/<i>/moe/<param>_lora_a": (E, in, r), ..._lora_b: (E, r, out)}`` for the targeted experts of
    every MoE layer (none for a dense config)."""
    c = text_config
    if not c.get("enable_moe_block"):
        return {}
    e, out = c["num_experts"], {}
    for i in range(c["num_hidden_layers"]):
        for row in EXPERT_ROWS:
            if row.target in targets:
                d_in, d_out = row.in_out(c)
                out[f"layers/{i}/moe/{row.param}_lora_a"] = (e, d_in, rank)
                out[f"layers/{i}/moe/{row.param}_lora_b"] = (e, rank, d_out)
    return out


def expert_peft_factors(a, b):
    """PEFT's ``(lora_A (r·E, in), lora_B (out, r·E))`` for a ``target_parameters`` expert tensor: PEFT takes
    expert ``e``'s A as rows ``e·r .. e·r+r-1`` and its B as columns ``e, E+e, 2E+e, ...``."""
    e, d_in, r = a.shape
    return a.transpose(0, 2, 1).reshape(e * r, d_in), b.transpose(2, 1, 0).reshape(b.shape[2], r * e)


def synthetic_lora(text_config: dict, targets, rank: int, seed: int = 0, std: float = 0.02,
                   dtype=None) -> dict:
    """Random LoRA arrays with tunix's paths and shapes for ``text_config`` (benchmarks, exercises: no training)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    dtype = dtype or np.float32
    return {path: (rng.standard_normal(shape) * std).astype(dtype)
            for path, shape in lora_shapes(text_config, rank, targets).items()}
