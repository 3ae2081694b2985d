"""Audit and fix the sharding annotations of a (LoRA) tunix model: problems that raise only at compile, or never.

:func:`audit` lists every parameter with its spec and bytes per device, and flags a spec the mesh cannot divide
(fewer global KV heads than ``tp``), a LoRA spec whose rank differs from its array, and an annotation not applied
(tunix creates variables unsharded; QLoRA places arrays its own way). :func:`fix_shardings` drops only the offending
axes, reports each change and places the arrays. Abstract models and meshes work too, for plans of the 31B. A
table is ``pandas.DataFrame(audit(model, mesh))``.
"""

from __future__ import annotations

import dataclasses
import math

from ..core.errors import GemmaTpuError
from . import gemma4
from .partition_specs import annotated_spec, bytes_per_device, divisible_spec, dtype_bits, indivisible_dims


@dataclasses.dataclass
class ParamAudit:
    """One parameter: its annotation (``spec``) and where the array lives (``placed``: ``-`` when abstract);
    ``rank_ok``, ``divides`` (by the mesh), ``follows_base`` (a LoRA param's spec; None for others) and ``applied``
    (None when abstract); bytes per device as annotated (indivisible dims rounded up) and as placed; ``flag``: what
    is wrong, empty when nothing is."""
    path: str
    kind: str
    shape: tuple
    dtype: str
    spec: str
    placed: str
    rank_ok: bool
    divides: bool
    follows_base: bool | None
    applied: bool | None
    bytes_per_device: int
    bytes_per_device_placed: int
    flag: str


@dataclasses.dataclass
class ShardingChange:
    """One parameter :func:`fix_shardings` changed: its spec and placement before, its spec after, bytes per device
    before (as placed) and after (as annotated), and why."""
    path: str
    kind: str
    shape: tuple
    spec_before: str
    spec_after: str
    placed_before: str
    bytes_per_device_before: int
    bytes_per_device_after: int
    why: str


class ShardingError(GemmaTpuError, ValueError):
    """Annotations that cannot be applied on this mesh."""


def _mesh_sizes(mesh) -> dict[str, int]:
    return dict(mesh.shape)


def _fmt(spec) -> str:
    if spec is None:
        return "-"
    return "(" + ", ".join(repr(s) if s is not None else "None" for s in spec) + ("," if len(spec) == 1 else "") + ")"


def _params(model):
    """(path, variable) for every parameter (frozen and LoRA; quantized weights per component)."""
    from flax import nnx

    for path, v in nnx.iter_graph(model):
        if isinstance(v, nnx.Param):
            yield tuple(path), v


def _named(mesh, spec, ndim):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    spec = tuple(spec or ())
    return NamedSharding(mesh, P(*(spec + (None,) * (ndim - len(spec)))))


def _placed(value, ndim):
    """The spec the array actually has: a tuple, () when on one device / fully replicated, None when abstract."""
    import jax

    sharding = getattr(value, "sharding", None)
    if not isinstance(value, jax.Array) or sharding is None:
        return None
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return ()
    spec = tuple(spec)
    return spec + (None,) * (ndim - len(spec))


def audit(model, mesh) -> list[ParamAudit]:
    """Every parameter of ``model`` on ``mesh``, in the model's order (see :class:`ParamAudit`)."""
    import jax
    from flax import nnx

    sizes = _mesh_sizes(mesh)
    concrete_mesh = isinstance(mesh, jax.sharding.Mesh)
    rows = []
    for path, v in _params(model):
        value = v.value
        shape, dtype = tuple(value.shape), value.dtype
        ndim = len(shape)
        spec, _ = annotated_spec(v)
        is_lora = isinstance(v, nnx.LoRAParam)
        flags = []
        rank_ok = spec is None or len(spec) <= ndim and not (is_lora and spec and len(spec) != ndim)
        if not rank_ok:
            flags.append(f"spec rank {len(spec)} != array rank {ndim}"
                         + (" (base weight's spec copied onto a LoRA param?)" if is_lora else ""))
        bad = indivisible_dims(shape, spec, sizes) if rank_ok else []
        flags += [f"cannot divide {b}" for b in bad]
        follows = None
        if is_lora and rank_ok:
            expected = _expected_lora_spec(model, path, shape, sizes)
            if expected is not None:
                follows = tuple(spec or ()) + (None,) * (ndim - len(spec or ())) == expected
                if not follows:
                    flags.append(f"LoRA spec does not follow the base weight's layout (expected {_fmt(expected)})")
        placed = _placed(value, ndim)
        applied = None
        if placed is not None and concrete_mesh and rank_ok and not bad:
            want = _named(mesh, spec, ndim)
            applied = (bool(value.sharding.is_equivalent_to(want, ndim))
                       if value.sharding.device_set == want.device_set else False)
            if not applied:
                flags.append(f"annotation not applied (placed as {_fmt(placed)})")
        elif placed is not None and concrete_mesh:
            applied = False  # an annotation that cannot be applied is not in effect (already flagged above)
        per_dev = bytes_per_device(shape, dtype, spec if rank_ok else None, sizes)
        if placed is not None:
            placed_bytes = math.prod(value.sharding.shard_shape(shape)) * dtype_bits(dtype) // 8
        else:
            placed_bytes = per_dev
        rows.append(ParamAudit("/".join(map(str, path)), type(v).__name__, shape, str(dtype), _fmt(spec),
                               _fmt(placed), rank_ok, not bad, follows, applied, per_dev, placed_bytes,
                               "; ".join(flags)))
    return rows


def flagged(rows: list[ParamAudit]) -> list[ParamAudit]:
    """The audited parameters with a flag."""
    return [r for r in rows if r.flag]


def module_at(model, path):
    """The submodule of ``model`` at ``path`` (attribute names and list indices, as nnx.iter_graph gives them)."""
    obj = model
    for p in path:
        obj = obj[p] if isinstance(p, int) else getattr(obj, p)
    return obj


def _lora_spec_from_base(model, path, ndim) -> tuple | None:
    """The spec a LoRA A/B should have: the base weight's axis on each non-rank dim (by einsum letters)."""
    name = path[-1]
    if not (name.endswith("_lora_a") or name.endswith("_lora_b")):
        return None
    base_name, which = name[: -len("_lora_a")], name[-1]
    module = module_at(model, path[:-1])
    base = getattr(module, base_name, None)
    if base is None:
        return None
    from flax import nnx

    # a qwix-quantized weight (WithAux around a QArray) carries the annotation on its qvalue
    base_var = base if isinstance(base, nnx.Variable) else getattr(getattr(base, "array", None), "qvalue", None)
    if not isinstance(base_var, nnx.Variable):
        return None
    base_spec, _ = annotated_spec(base_var)
    if base_spec is None:
        return (None,) * ndim
    lora_str = getattr(module, base_name + "_lora_einsum_str", None)
    einsum_str = getattr(module, "einsum_str", None)
    if lora_str and einsum_str:
        rhs = einsum_str.split("->")[0].split(",")[1]
        letter_axis = dict(zip(rhs, base_spec))
        operand = lora_str.split("->")[0].split(",")[1 if which == "a" else 2]
        if len(operand) == ndim:
            return tuple(letter_axis.get(c) for c in operand)
        return (None,) * ndim
    if len(base_spec) == 2 and ndim == 2:  # a dense kernel (in, out): A (in, r), B (r, out)
        return (base_spec[0], None) if which == "a" else (None, base_spec[1])
    return (None,) * ndim


def _expected_lora_spec(model, path, shape, sizes) -> tuple | None:
    """The base-derived LoRA spec (size-1 dims unsharded, as qwix does; divisibility is checked separately)."""
    derived = _lora_spec_from_base(model, path, len(shape))
    if derived is None:
        return None
    return tuple(None if n == 1 else e for n, e in zip(shape, derived))


def fix_shardings(model, mesh, apply: bool = True) -> list[ShardingChange]:
    """Correct what :func:`audit` flags, in place; return every change.

    An indivisible spec loses only the offending axis; a LoRA spec that does not follow its base weight gets the
    base's axis on each non-rank dim. With ``apply`` (and a concrete mesh and arrays) every parameter is then
    placed as annotated, so a re-audit shows no flag.
    """
    import jax
    from flax import nnx

    sizes = _mesh_sizes(mesh)
    concrete = isinstance(mesh, jax.sharding.Mesh)
    before = {r.path: r for r in audit(model, mesh)}
    changes = []
    for path, v in _params(model):
        key = "/".join(map(str, path))
        row = before[key]
        value = v.value
        shape, ndim = tuple(value.shape), len(value.shape)
        spec, meta_key = annotated_spec(v)
        new = spec
        reasons = []
        derived = _expected_lora_spec(model, path, shape, sizes) if isinstance(v, nnx.LoRAParam) else None
        if not row.rank_ok:
            new = derived if derived is not None else tuple(spec[:ndim]) + (None,) * max(0, ndim - len(spec))
            reasons.append(f"spec rank {len(spec)} -> {ndim}, derived from the base weight"
                           if derived is not None else f"spec cut to rank {ndim}")
        elif row.follows_base is False and derived is not None:
            new = derived
            reasons.append("LoRA spec derived from the base weight's layout")
        if new is not None:
            full = tuple(new) + (None,) * (ndim - len(new))
            fitted = divisible_spec(shape, full, sizes)
            if fitted != full:
                reasons.append("dropped the axis that cannot divide: "
                               + ", ".join(indivisible_dims(shape, full, sizes)))
                new = fitted
        placed_wrong = row.applied is False
        if new != spec:
            if meta_key is None:
                meta_key = "out_sharding"
            v.set_metadata(meta_key, tuple(new))
        moved = False
        if apply and concrete and isinstance(value, jax.Array):
            want = _named(mesh, new, ndim)
            if not (value.sharding.device_set == want.device_set and value.sharding.is_equivalent_to(want, ndim)):
                v.value = jax.device_put(value, want)
                moved = True
                if placed_wrong and new == spec:
                    reasons.append("placed the array as annotated")
        if new != spec or moved:
            after_bytes = bytes_per_device(shape, value.dtype, new, sizes)
            changes.append(ShardingChange(key, type(v).__name__, shape, _fmt(spec), _fmt(new), row.placed,
                                          row.bytes_per_device_placed, after_bytes,
                                          "; ".join(reasons) or "placed the array as annotated"))
    return changes


def apply_annotations(model, mesh) -> None:
    """Place every parameter as its annotation says: ``jax.device_put``, or for an array that spans processes (a
    multi-host run) a jitted identity with that output sharding, which reshards across hosts. Raises
    :class:`ShardingError`, naming the parameter and changing nothing, when an annotation cannot be applied."""
    import jax

    placements = []
    for path, v in _params(model):  # check everything first, so a failure changes nothing
        value = v.value
        spec, _ = annotated_spec(v)
        try:
            want = _named(mesh, spec, value.ndim)
            want.shard_shape(tuple(value.shape))  # raises when a dim does not divide
        except (ValueError, TypeError) as e:
            raise ShardingError(
                f"{'/'.join(map(str, path))} {tuple(value.shape)} cannot be placed as {_fmt(spec)} on mesh "
                f"{_mesh_sizes(mesh)}: {str(e).splitlines()[0]} Run sharding.audit(model, mesh) to see every such "
                f"parameter, and sharding.fix_shardings(model, mesh) to drop only the axes that cannot divide "
                f"(or pick a tp from gemma4.valid_tp_sizes(config))."
            ) from None
        placements.append((v, want))
    for v, want in placements:
        value = v.value
        if getattr(value, "is_fully_addressable", True):
            v.value = jax.device_put(value, want)
        elif not value.sharding.is_equivalent_to(want, value.ndim):
            v.value = jax.jit(lambda x: x, out_shardings=want)(value)


def model_from_config(text_config: dict, dtype: str = "float32", seed: int = 0, layer_types=None, abstract=False):
    """A random tunix Gemma 4 built as tunix builds one: every variable unsharded, on one device, no mesh check.
    ``layer_types`` (e.g. ``["sliding_attention", "full_attention"]``) cuts it to those layers."""
    from flax import nnx
    from tunix.models.gemma4 import model as gm

    c = dict(text_config)
    if layer_types is not None:
        c.update(layer_types=list(layer_types), num_hidden_layers=len(layer_types))
    cfg = gemma4.to_tunix_config(c, dtype=dtype)
    make = lambda: gm.Gemma4(cfg, rngs=nnx.Rngs(seed))  # noqa: E731
    return nnx.eval_shape(make) if abstract else make()
