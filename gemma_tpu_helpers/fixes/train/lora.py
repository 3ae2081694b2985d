"""LoRA on tunix's Gemma 4 by Hugging Face / PEFT target names, with a coverage report that cannot be silent.

qwix selects modules by a regex over *tunix* paths, and says nothing when it matches none (HF names) or misses some
(``k_einsum``, only on Gemma 4's global k=v layers). :func:`apply_lora` takes HF names, maps them through
:mod:`layout`, and raises if a target got no LoRA; :func:`coverage_of_regex` reports on a raw qwix regex. The MoE's
routed experts (26B-A4B), which qwix does not reach, take LoRA through :mod:`expert_lora` when targeted by PEFT's
names (:data:`EXPERT_TARGETS`).
"""

from __future__ import annotations

import dataclasses
import math

from ..core import compat
from ..core.errors import GemmaTpuError
from ..model import layout
from ..model.partition_specs import annotated_spec
from . import expert_lora


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float
    # Hugging Face / PEFT names; lora.py maps them to tunix module paths.
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    # QLoRA: the frozen targeted weights quantized to this qwix type ("nf4"), None for plain LoRA (lora.apply_lora)
    qlora: str | None = None
    # the rank of each routed expert's LoRA (EXPERT_TARGETS), None for ``rank``: PEFT's docs suggest a smaller one
    expert_rank: int | None = None

HF_TARGETS = layout.TARGETS  # the canonical order
# tunix module names that users sometimes pass as targets, and the HF name to use instead.
_TUNIX_TO_HF = {"q_einsum": "q_proj", "kv_einsum": "k_proj, v_proj", "k_einsum": "k_proj",
                "attn_vec_einsum": "o_proj"}


# The MoE's (26B-A4B) own weights: HF name -> tunix param under a decoder layer. qwix 0.1.8 gives the experts no LoRA
# (ragged_dot, which it does not intercept): a rule naming the MoE adapts only the router's einsum.
MOE_WEIGHTS = {"experts.gate_up_proj": "moe/gating_einsum", "experts.down_proj": "moe/linear",
               "router.proj": "moe/router_logits"}
# The routed experts as PEFT's ``target_parameters`` names them: one A and B per expert (expert_lora.py)
EXPERT_TARGETS = layout.EXPERT_TARGETS
EXPERTS_WHY = ("3-D expert tensors run through jax.lax.ragged_dot, which qwix's LoraProvider does not intercept: "
               "no LoRA reaches them unless targeted (experts.gate_up_proj, experts.down_proj)")
_EXPERT_NAMES = {*MOE_WEIGHTS, "experts", "gate_up_proj", "router", "gating_einsum", "moe"} - set(EXPERT_TARGETS)


class LoraConfigError(GemmaTpuError, ValueError):
    """Bad LoRA arguments (target names, rank, QLoRA tile size)."""


class LoraCoverageError(GemmaTpuError, RuntimeError):
    """A requested LoRA target matched no module in any layer."""


def tunix_module(target: str, kind: str, k_eq_v: bool, kv_shared: bool = False) -> str | None:
    """The tunix module (under a decoder layer) that a HF target lives in, or None when the layer has none.

    ``kind``: "local" or "global"; ``k_eq_v``: global layers share K and V (31B); ``kv_shared``: the layer reads an
    earlier layer's K/V (E2B/E4B), so its k/v projection never runs and gets no LoRA.
    """
    if target not in HF_TARGETS:
        raise LoraConfigError(_unknown_message([target]))
    layer = layout.Layer(-1, kind, kv_shared, kind == "global" and bool(k_eq_v), 0, 0, 0, 0, 0)
    row = layout.row_for(target, layer)
    return row.module if row else None


def _unknown_message(unknown) -> str:
    experts = [u for u in unknown if u in _EXPERT_NAMES or u.startswith(("experts.", "moe/"))]
    if experts:
        return (f"LoRA target(s) {', '.join(map(repr, experts))} name the MoE's router or its experts by another "
                f"name (26B-A4B). The routed experts take LoRA as {' and '.join(EXPERT_TARGETS)} (PEFT's "
                f"target_parameters names); the router takes none. Attention and the dense MLP "
                f"({', '.join(HF_TARGETS)}) are in every MoE layer too.")
    hints = [f"{u!r} is a tunix module name; use {_TUNIX_TO_HF[u]}" for u in unknown if u in _TUNIX_TO_HF]
    return (f"Unknown LoRA target(s) {', '.join(map(repr, unknown))}. Valid targets are the Hugging Face / PEFT "
            f"names: {', '.join(HF_TARGETS)}." + (" " + "; ".join(hints) + "." if hints else "")
            + " They are mapped to tunix modules for you (layout.ROWS).")


def validate_targets(targets) -> tuple[str, ...]:
    """The targets as a tuple of HF names, in canonical order (the dense ones, then the experts); raises
    LoraConfigError on unknown names."""
    if isinstance(targets, str):
        targets = [targets]
    targets = list(targets)
    if not targets:
        raise LoraConfigError(f"No LoRA targets given. Pick from: {', '.join(HF_TARGETS + EXPERT_TARGETS)}.")
    unknown = [t for t in targets if t not in HF_TARGETS + EXPERT_TARGETS]
    if unknown:
        raise LoraConfigError(_unknown_message(unknown))
    return tuple(t for t in HF_TARGETS + EXPERT_TARGETS if t in targets)


def dense_targets(targets) -> tuple[str, ...]:
    """The targets that qwix's own LoRA reaches (attention and the dense MLP)."""
    return tuple(t for t in validate_targets(targets) if t in HF_TARGETS)


def expert_targets(targets) -> tuple[str, ...]:
    """The routed experts' targets (:data:`EXPERT_TARGETS`) among ``targets``."""
    return tuple(t for t in validate_targets(targets) if t in EXPERT_TARGETS)


def regex_for(targets) -> str:
    """The qwix ``module_path`` regex (fullmatch over ``layers/<i>/attn/q_einsum``-style paths) for HF targets
    (the dense ones: the experts have a rule of their own, :func:`expert_lora.expert_rule`)."""
    return layout.qwix_regex(dense_targets(targets))


# The tunix module that holds a layer's routed experts, for the experts' rule
EXPERT_MODULE_REGEX = r".*/moe"


def peft_target_modules(targets=HF_TARGETS, k_layers=None) -> str:
    """PEFT's ``target_modules`` as one regex over the language model only: plain names would also match the
    vision tower's modules, which PEFT cannot wrap. ``k_layers`` limits ``k_proj`` to those layers (None: all)."""
    targets = dense_targets(targets)  # the experts are PEFT target_parameters, not modules
    parent = {r.target: r.hf_module.split(".")[0] for r in layout.ROWS}  # self_attn or mlp
    attn = [t for t in targets if parent[t] == "self_attn" and (t != "k_proj" or k_layers is None)]
    mlp = [t for t in targets if parent[t] == "mlp"]
    parts = []
    if attn:
        parts.append(rf"\d+\.self_attn\.({'|'.join(attn)})")
    if mlp:
        parts.append(rf"\d+\.mlp\.({'|'.join(mlp)})")
    if "k_proj" in targets and k_layers is not None and len(k_layers):
        parts.append(rf"({'|'.join(str(i) for i in k_layers)})\.self_attn\.k_proj")
    return rf".*language_model\.layers\.({'|'.join(parts)})"


def _path_str(path) -> str:
    return "/".join(map(str, path))


def _lora_sizes(model) -> dict[str, int]:
    """LoRA parameter count per module path (``layers/0/attn/q_einsum``)."""
    from flax import nnx

    sizes: dict[str, int] = {}
    for path, v in nnx.iter_graph(model):
        if isinstance(v, nnx.LoRAParam):
            key = _path_str(path[:-1])
            sizes[key] = sizes.get(key, 0) + int(v.value.size)
    return sizes


def base_param_count(model) -> int:
    """Frozen parameters of a (possibly LoRA / QLoRA) model: quantized weights counted once, scales not."""
    from flax import nnx

    total = 0
    for path, v in nnx.iter_graph(model):
        if isinstance(v, nnx.Param) and not isinstance(v, nnx.LoRAParam):
            if len(path) >= 2 and path[-2] == "array" and path[-1] != "qvalue":
                continue  # a quantized weight's scale / zero point
            total += int(v.value.size)
    return total


def _layer_info(model) -> list[tuple[str, bool, int | None]]:
    """(kind, has k_einsum, the layer whose K/V it reads or None) per decoder layer of a tunix Gemma 4 model."""
    out = []
    sharing = getattr(model, "kv_cache_sharing_patterns", None) or list(range(len(model.layers)))
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        kind = "global" if "GLOBAL" in str(getattr(attn, "attn_type", "")) else "local"
        out.append((kind, hasattr(attn, "k_einsum"), sharing[i] if sharing[i] != i else None))
    return out


def coverage(lora_model, targets=HF_TARGETS, base_params: int | None = None):
    """Each layer x each HF target: the tunix module, whether it has LoRA, its LoRA parameter count (pandas).
    A shared ``kv_einsum`` is counted on the k_proj row only, so the column sums to the model's count."""
    import pandas as pd

    targets = dense_targets(targets)  # the MoE's rows are listed whatever the targets
    sizes = _lora_sizes(lora_model)
    moe_layers = [i for i, layer in enumerate(lora_model.layers) if hasattr(layer, "moe")]
    moe_lora = _moe_lora_sizes(lora_model)
    base = base_params if base_params is not None else base_param_count(lora_model)
    rows, counted = [], set()
    for i, (kind, has_k, shared_from) in enumerate(_layer_info(lora_model)):
        for t in targets:
            rel = tunix_module(t, kind, has_k, kv_shared=shared_from is not None)
            path = f"layers/{i}/{rel}" if rel else None
            n = sizes.get(path, 0) if path else 0
            note, n_row = "", n
            if rel is None and shared_from is not None:
                note = f"KV-shared layer: reads layer {shared_from}'s K/V (no k/v projection runs here)"
            elif rel is None:
                note = "no v_proj on this k=v layer (V is K)"
            elif n and path in counted:
                note, n_row = "shares kv_einsum's LoRA with k_proj (counted there)", 0
            if n:
                counted.add(path)
            rows.append({"layer": i, "kind": kind, "target": t, "module": rel or "(none)",
                         "has LoRA": bool(n), "LoRA params": n_row,
                         "trainable %": 100.0 * n_row / base if base else 0.0, "note": note})
        if i in moe_layers:  # listed whatever the targets: where most of an MoE's parameters are
            counted.add(f"layers/{i}/moe")
            for name, rel in MOE_WEIGHTS.items():
                n = moe_lora.get(f"layers/{i}/{rel}", 0)
                note = EXPERTS_WHY if name.startswith("experts") and not n else (
                    "the router's einsum: a rule naming the MoE gives LoRA here, not to the experts" if n else "")
                rows.append({"layer": i, "kind": kind, "target": name, "module": rel, "has LoRA": bool(n),
                             "LoRA params": n, "trainable %": 100.0 * n / base if base else 0.0, "note": note})
    df = pd.DataFrame(rows)
    df.attrs.update(lora_params=int(sum(sizes.values())), base_params=int(base),
                    unmatched=[p for p in sizes if p not in counted], experts=expert_line(lora_model))
    return df


def _moe_lora_sizes(model) -> dict[str, int]:
    """LoRA parameter count per MoE weight (``layers/0/moe/router_logits``): qwix names an MoE's LoRA params after
    the weight (``router_logits_lora_a``) under the one ``moe`` module."""
    from flax import nnx

    out: dict[str, int] = {}
    for path, v in nnx.iter_graph(model):
        if isinstance(v, nnx.LoRAParam) and len(path) >= 2 and path[-2] == "moe":
            key = _path_str(path[:-1]) + "/" + str(path[-1]).rsplit("_lora_", 1)[0]
            out[key] = out.get(key, 0) + int(v.value.size)
    return out


def expert_line(model) -> str:
    """One sentence on an MoE model's experts and LoRA ("" for a dense model): how many of the parameters they
    hold, and that no LoRA reaches them (or how many LoRA parameters do, should a provider ever reach them)."""
    experts = [layer.moe for layer in model.layers if hasattr(layer, "moe")]
    if not experts:
        return ""
    n_exp = sum(math.prod(getattr(m, w.split("/")[1]).shape) for m in experts
                for name, w in MOE_WEIGHTS.items() if name.startswith("experts"))
    base = base_param_count(model)
    moe_lora = _moe_lora_sizes(model)
    on_router = sum(v for p, v in moe_lora.items() if p.endswith("router_logits"))
    on_experts = sum(moe_lora.values()) - on_router
    router = f"; the router's einsum got {on_router:,} LoRA parameters" if on_router else ""
    shape = tuple(experts[0].gating_einsum.shape)  # .shape: also of quantized experts
    head = (f"experts: {len(experts)} layers x {shape[0]} experts hold {n_exp:,} of the {base:,} frozen parameters "
            f"({100 * n_exp / base:.0f}%)")
    if on_experts:
        return f"{head}; {on_experts:,} LoRA parameters reach them{router}."
    return f"{head}; no LoRA reaches them ({EXPERTS_WHY.split(': ')[0]}){router}."


def _has_experts(model) -> bool:
    return any(hasattr(layer, "moe") for layer in model.layers)


def _check_tile(model, targets, tile_size: int | None) -> int:
    """A QLoRA tile size that divides every contracted dim of the targeted modules, and of the routed experts of
    a MoE, which QLoRA quantizes whether targeted or not (largest <= 256 if None)."""
    cfg = model.config
    dims = {cfg.embed_dim}
    if "o_proj" in targets:
        dims |= {cfg.head_dim, cfg.global_key_size}
    if "down_proj" in targets:
        dims.add(cfg.hidden_dim)
    if _has_experts(model):
        dims.add(cfg.expert_dim)
    valid = [t for t in (256, 128, 64, 32, 16, 8) if all(d % t == 0 for d in dims)]
    if tile_size is None:
        if not valid:
            raise LoraConfigError(f"No QLoRA tile size in 8..256 divides the contracted dims {sorted(dims)}.")
        return valid[0]
    if tile_size <= 0 or any(d % tile_size for d in dims):
        raise LoraConfigError(f"QLoRA tile_size={tile_size} must divide every contracted dim of the targeted "
                              f"modules {sorted(dims)}. Valid choices: {valid}.")
    return tile_size


def _check_rank(rank, what: str = "LoRA rank") -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise LoraConfigError(f"{what} must be a positive integer, got {rank!r} (the paper uses 64; smoke 8).")


def make_provider(targets=HF_TARGETS, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
                  qlora: str | None = None, tile_size: int | None = None, regex: str | None = None,
                  expert_rank: int | None = None):
    """The qwix ``LoraProvider`` for HF targets (or a raw ``regex``), with arguments checked: one rule for
    attention and the dense MLP, and one for the routed experts when targeted (rank ``expert_rank``, default
    ``rank``; scale ``alpha / expert_rank``). qwix's QLoRA quantizes the dense targets only: :func:`apply_lora`
    quantizes the experts (``expert_lora.quantize_experts``)."""
    import qwix

    _check_rank(rank)
    if expert_rank is not None:
        _check_rank(expert_rank, "The experts' LoRA rank")
    if not 0.0 <= dropout < 1.0:
        raise LoraConfigError(f"LoRA dropout must be in [0, 1), got {dropout!r}.")
    quant = dict(weight_qtype=qlora, tile_size=tile_size) if qlora is not None else {}
    if regex is not None:
        return qwix.LoraProvider(module_path=regex, rank=rank, alpha=float(alpha), dropout=float(dropout), **quant)
    from qwix._src.providers.lora import LoraRule

    rules = [LoraRule(module_path=regex_for(targets), rank=rank, alpha=float(alpha), dropout=float(dropout),
                      **quant)] if dense_targets(targets) else []
    if expert_targets(targets):
        rules.append(expert_lora.expert_rule(EXPERT_MODULE_REGEX, expert_rank or rank, alpha, dropout))
        return expert_lora.make_provider(rules)
    return qwix.LoraProvider(rules)


def _run_qwix(model, provider, seed: int, abstract: bool):
    import qwix
    from flax import nnx

    def go(m):
        return qwix.apply_lora_to_model(m, provider, rngs=nnx.Rngs(seed), **m.get_model_input())

    if abstract:
        return nnx.eval_shape(go, model)
    # qwix creates the LoRA params by running the model once. Jitted, not eager: an eager forward dispatches each op
    # to every device on its own, and on a CPU with fewer cores than virtual devices those small collectives can
    # deadlock in XLA's rendezvous (a CI run hung 1200 s in verify's forward, then aborted); eager, qwix also cannot
    # place a param on an array that spans processes. The values are the same; jit leaves the new params replicated,
    # so they are then placed as annotated (qwix's annotation: the base weight's axes), as eager qwix places them.
    return _place_lora(nnx.jit(go)(model))


def _place_lora(model):
    """Every LoRA param of ``model`` placed as its annotation says, on the mesh its base weights are on (one jitted
    identity, which reshards across processes too). A model on one device is returned as it is."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = next((x.sharding.mesh for x in jax.tree.leaves(nnx.state(model))
                 if isinstance(getattr(x, "sharding", None), NamedSharding)), None)
    variables = [v for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))]
    if mesh is None or not variables:
        return model

    def wanted(v):
        return NamedSharding(mesh, P(*(annotated_spec(v)[0] or ())))

    placed = jax.jit(lambda xs: xs, out_shardings=[wanted(v) for v in variables])([v.value for v in variables])
    for v, x in zip(variables, placed):
        v.value = x
    return model


def apply_lora(model, targets=HF_TARGETS, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               qlora: str | None = None, tile_size: int | None = None, seed: int = 0, abstract: bool = False,
               expert_rank: int | None = None):
    """Apply (Q)LoRA to a tunix Gemma 4 by HF target names; return ``(lora_model, coverage report)``, the report's
    ``attrs`` holding ``lora_params``, ``base_params`` and ``regex``. The input model is not changed.

    ``qlora="nf4"`` quantizes the frozen base: the targeted dense weights (qwix; with the compat shim tunix needs)
    and the routed experts of a MoE, targeted or not; ``tile_size`` must divide the contracted dims (default: the
    largest that does). ``abstract``: shapes only (``nnx.eval_shape``); otherwise qwix runs under ``nnx.jit`` and the
    new LoRA params are placed as annotated, on the base weights' mesh (as eager qwix places them).
    :data:`EXPERT_TARGETS` give each routed expert of an MoE its own LoRA, of rank ``expert_rank`` (default ``rank``).
    Raises :class:`LoraConfigError` for bad arguments, :class:`LoraCoverageError` when a target got LoRA nowhere.
    """
    targets = validate_targets(targets)
    if qlora is not None:
        tile_size = _check_tile(model, dense_targets(targets), tile_size)
    regex = regex_for(targets)
    provider = make_provider(targets, rank, alpha, dropout, qlora, tile_size, expert_rank=expert_rank)
    base = base_param_count(model)
    if qlora is not None:
        compat.patch_gemma4_qlora_einsum()
    lora_model = _run_qwix(model, provider, seed, abstract)
    if qlora is not None and _has_experts(lora_model):  # qwix's quantizer never meets them (ragged_dot)
        lora_model = expert_lora.quantize_experts(lora_model, qlora, tile_size, abstract=abstract)
    unused = provider.get_unused_rules()
    report = coverage(lora_model, targets, base_params=base)
    present = report[report["module"] != "(none)"]
    missing = [t for t in targets if not present.loc[present["target"] == t, "has LoRA"].any()]
    if expert_targets(targets) and not _has_experts(lora_model):
        raise LoraCoverageError(f"{', '.join(expert_targets(targets))}: this model has no routed experts (a "
                                f"mixture of experts such as Gemma 4 26B-A4B has); drop those targets.")
    if unused or missing:
        raise LoraCoverageError(
            f"LoRA target(s) {', '.join(missing) or ', '.join(targets)} matched no module in any layer "
            f"(qwix regex {regex!r}; unused rules: {len(unused)}). This model's layers have "
            f"{sorted({m for m in report['module'] if m != '(none)'})}. Drop those targets, or check that the "
            f"model is a tunix Gemma 4 (e.g. v_proj alone has nothing to adapt when every layer is a global k=v layer)."
        )
    report.attrs.update(regex=regex, unused_rules=[], rank=rank, alpha=alpha, qlora=qlora,
                        tile_size=tile_size, expert_rank=(expert_rank or rank) if expert_targets(targets) else None)
    return lora_model, report


def coverage_of_regex(model, regex: str, rank: int = 8, alpha: float = 16.0, seed: int = 0, abstract: bool = True):
    """Run raw qwix with ``regex`` (no checks) and report what got LoRA, per layer x HF target; shapes only by
    default. ``attrs["unused_rules"]`` is qwix's own check, which sees a regex matching nothing, not a partial miss.
    """
    provider = make_provider(rank=rank, alpha=alpha, regex=regex)
    base = base_param_count(model)
    lora_model = _run_qwix(model, provider, seed, abstract)
    report = coverage(lora_model, HF_TARGETS, base_params=base)
    report.attrs.update(regex=regex, unused_rules=[r.module_path for r in provider.get_unused_rules()])
    return report
