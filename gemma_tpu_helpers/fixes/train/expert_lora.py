"""LoRA on the routed experts of a mixture of experts (Gemma 4 26B-A4B), which qwix does not reach.

tunix runs the experts through ``jax.lax.ragged_dot(x, W, group_sizes)``: the rows of ``x`` sorted by expert, ``W``
one ``(in, out)`` matrix per expert. qwix's ``LoraProvider`` intercepts ``dot_general`` and ``einsum``, not
``ragged_dot``, so no LoRA reaches the experts. :func:`make_provider`'s provider also intercepts ``ragged_dot``: it
gives each expert its own A ``(E, in, r)`` and B ``(E, r, out)``, applied as two more ``ragged_dot`` with the same group
sizes: row ``i`` of expert ``e`` gets ``x_i · A_e · B_e · alpha/r``, exactly what adding ``A_e · B_e · alpha/r`` to
``W_e`` gives (PEFT's ``target_parameters`` on the 3-D expert tensors, one A and B per expert).

QLoRA: qwix quantizes the weights of the ops it intercepts when it first meets them, and tunix reads the experts'
``.value`` and transposes it before ``ragged_dot``, which qwix's quantized array refuses. :func:`quantize_experts`
stores them as nf4 codes instead (qwix's quantizer, one scale per expert, output channel and ``tile_size`` inputs)
in a :func:`quantized_class` box whose ``.value`` is the dequantized weight: tunix's forward runs unchanged, and the
experts, most of a MoE's weights, take 4 bits each.

Two things the TPU compile needs (docs/moe-experts.md has the trace). The LoRA's backward (:func:`lora_delta`, its own
VJP) ties each expert's A and B gradients to the gradient it passes down (an optimization barrier): without it XLA
schedules them at the end of the backward pass, keeping each layer's routed rows (0.59 GiB a layer on a v6e-4) alive
till then. And libtpu 0.0.52 expands ``ragged_dot`` on a v6e into a dense product with every expert (128 times the
routed work); on a TPU mesh the experts' matmuls run as megablox's grouped matmul (:func:`grouped`), the routed rows
split over ``fsdp`` and the contraction over ``tp``. Elsewhere they stay ``ragged_dot``, the same numbers as before.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from ..model import layout

OP = "ragged_dot"


def expert_rule(module_path: str, rank: int, alpha: float, dropout: float = 0.0):
    """The qwix rule for the experts of the modules ``module_path`` matches: ``ragged_dot`` only (the router's
    einsum in the same module keeps no LoRA). A's initializer treats the expert axis as a batch axis, so each
    expert's A has the fan-in of its own ``in`` (qwix's default would count the experts into the fan-in)."""
    import jax
    from qwix._src.providers.lora import LoraRule

    return LoraRule(module_path=module_path, op_names=(OP,), rank=rank, alpha=float(alpha), dropout=float(dropout),
                    lora_a_initializer=jax.nn.initializers.he_uniform(batch_axis=(0,)))


def _weight_name(module, rhs) -> str | None:
    """The module's expert weight that ``rhs`` is: qwix's own lookup (the same array), else its one 3-D or more
    ``Param`` with the same expert count and size (tunix passes ``gating_einsum`` (E, 2, I, D) transposed and
    reshaped to (E, D, 2I), which qwix finds only under jit)."""
    from flax import nnx
    from qwix._src.utils import flax_util

    name = flax_util.find_param(rhs)
    if name is not None:
        return name
    hits = [n for n, v in vars(module).items()
            if (type(v) is nnx.Param or isinstance(v, quantized_class())) and len(v.shape) >= 3
            and v.shape[0] == rhs.shape[0] and math.prod(v.shape) == math.prod(rhs.shape)]
    return hits[0] if len(hits) == 1 else None


@functools.cache
def quantized_class():
    """The box of a quantized expert weight: qwix's ``QArray`` (its arrays each a ``Param`` with the weight's
    sharding), read as the dequantized weight through ``.value`` as tunix reads a ``Param``."""
    import flax
    import jax.numpy as jnp
    from flax import nnx
    from qwix._src.core import qarray
    from qwix._src.utils import flax_util

    @flax.struct.dataclass
    class QuantizedExperts:
        array: qarray.QArray

        shape = property(lambda self: flax_util.unbox(self.array.qvalue).shape)
        ndim = property(lambda self: len(self.shape))
        dtype = property(lambda self: flax_util.unbox(self.array.scale).dtype)

        @property
        def value(self):
            q = flax_util.unbox(self.array)
            if q.qtype != "nf4" or q.zero_point is not None:
                return qarray.dequantize(q)
            return qarray.call_with_generic_broadcast(jnp.multiply, _nf4_values(q.qvalue, q.scale.dtype), q.scale)

    nnx.register_data_type(QuantizedExperts)
    return QuantizedExperts


def quantize_experts(model, qtype: str = "nf4", tile_size: int = 64, abstract: bool = False):
    """Store the routed experts of every MoE layer of a tunix Gemma 4 as ``qtype`` codes with one scale per expert,
    output channel and ``tile_size`` contracted inputs (qwix's quantizer, as its QLoRA quantizes dense weights);
    in place, also returned. LoRA params stay as they are. ``abstract``: shapes only, for a model from
    ``nnx.eval_shape``."""
    from flax import nnx
    from qwix._src.core import qarray
    from qwix._src.utils import flax_util

    box = quantized_class()

    def quantize(m):
        for layer in m.layers:
            moe = getattr(layer, "moe", None)
            for row in layout.EXPERT_ROWS if moe is not None else ():
                param = getattr(moe, row.param)
                if isinstance(param, box):
                    continue
                w = param[...]
                if w.shape[row.contracted] % tile_size:
                    raise ValueError(f"tile_size {tile_size} does not divide the experts' {row.param} axis "
                                     f"{row.contracted} ({w.shape[row.contracted]}).")
                how = qarray.HowToQuantize(qtype=qtype, channelwise_axes=[a for a in range(w.ndim)
                                                                          if a != row.contracted],
                                           tiled_axes={row.contracted: tile_size})
                q = qarray.quantize(w, how)
                # the scale has a tile's fraction of the contracted axis, which a mesh axis need not divide: that
                # axis of it is replicated (scales are 1/tile of the weight)
                keep = [a if a != row.contracted else None for a in range(w.ndim)]
                setattr(moe, row.param, box(dataclasses.replace(
                    q, qvalue=flax_util.update_boxed(param, value=q.qvalue),
                    scale=flax_util.update_boxed(param, value=q.scale, transpose=keep))))
        return m

    return nnx.eval_shape(quantize, model) if abstract else quantize(model)


def make_provider(rules):
    """An :func:`provider_class` for qwix ``rules``: rules made by :func:`expert_rule` adapt each expert; the
    others work as in qwix's ``LoraProvider``."""
    return provider_class()(rules)


@functools.cache
def provider_class():
    """qwix's ``LoraProvider`` plus ``jax.lax.ragged_dot`` (defined on first use: qwix imports JAX)."""
    import jax
    import qwix
    from flax import nnx
    from qwix._src.providers import lora as qwix_lora
    from qwix._src.utils import flax_util

    class ExpertLoraProvider(qwix.LoraProvider):
        def get_intercept_map(self):
            return super().get_intercept_map() | {"jax.lax.ragged_dot": self.ragged_dot}

        def ragged_dot(self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None,
                       **kwargs):
            rule, _ = self._get_current_rule_and_op_id(OP)
            module = flax_util.get_current_module()
            name = _weight_name(module, rhs) if isinstance(rule, qwix_lora.LoraRule) and rhs.ndim == 3 else None
            plain = name is not None and preferred_element_type is None and group_offset is None and not kwargs
            how = _kernel(precision) if plain else ("ragged",)
            if how[0] == "megablox":  # the frozen experts too: libtpu's ragged_dot multiplies by every expert
                res = _ops()[1](lhs, rhs, group_sizes, how)
            else:
                res = jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision,
                                         preferred_element_type=preferred_element_type, group_offset=group_offset,
                                         **kwargs)
            if not plain:
                return res
            e, k, n = rhs.shape
            same_layout = tuple(getattr(module, name).shape) == (e, k, n)
            lora_a, lora_b = qwix_lora._get_or_create_lora_params(  # the dense LoRA's own: names, sharding
                name=name, rule=rule, a_shape=(e, k, rule.rank), b_shape=(e, rule.rank, n),
                a_sharding_transpose=(0, 1, None) if same_layout else (0, None, None),
                b_sharding_transpose=(0, None, 2) if same_layout else (0, None, None))
            if rule.dropout > 0:
                lhs = nnx.Dropout(rule.dropout, deterministic=False)(lhs, rngs=flax_util.make_rng("dropout"))
            delta = _ops()[0](lhs, lora_a.astype(lhs.dtype), lora_b.astype(lhs.dtype), group_sizes,
                              rule.alpha / rule.rank, how)
            return res + delta.astype(res.dtype)

    return ExpertLoraProvider


def _nf4_values(codes, dtype):
    """qwix's nf4 levels of ``codes`` in ``dtype`` (its ``nf4_to_fp``, then the cast), as a tree of 15 selects on
    the code's bits: elementwise, so XLA fuses it into the scaling. qwix's table lookup is a gather that XLA:TPU
    lowers with a mask per level (GiBs of temporaries for a layer's experts on one chip)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from qwix._src.core import numerics

    with jax.ensure_compile_time_eval():  # the table is a constant, also while a step is traced
        table = np.asarray(numerics.get_nf4_buckets(), np.float32)
    c = codes.astype(jnp.uint8)
    levels = [jnp.asarray(v, dtype) for v in table]
    for bit in range(4):
        on = ((c >> bit) & 1).astype(bool)
        levels = [jnp.where(on, hi, lo) for lo, hi in zip(levels[::2], levels[1::2])]
    return levels[0]


# How each grouped matmul contracts, rows of the lhs sorted by group (ragged_dot_general's dimension numbers):
# "fwd" (M,K)·(E,K,N) -> (M,N); "bwd" (M,N)·(E,K,N)ᵀ -> (M,K); "wgrad" (M,K)ᵀ·(M,N) -> (E,K,N), each group's rows.
_DIMS = {"fwd": (([1], [1]), [0]), "bwd": (([1], [2]), [0]), "wgrad": (([0], [0]), [])}


def _kernel(precision=None) -> tuple:
    """:func:`grouped`'s kernel arguments where the step is traced: megablox on a TPU mesh (tunix's legacy ``with
    mesh:``, or ``jax.set_mesh``'s), else ``ragged_dot``."""
    import warnings

    import jax
    from jax.interpreters import pxla

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        mesh = pxla.thread_resources.env.physical_mesh
    mesh = jax.sharding.get_abstract_mesh() if mesh.empty else mesh
    device = None if mesh.empty else getattr(mesh, "abstract_device", None) or mesh.devices.flat[0]
    platform = device.platform if device is not None else jax.default_backend()
    return ("megablox" if platform == "tpu" else "ragged", None if mesh.empty else mesh, False, precision)


def grouped(kind: str, a, b, group_sizes, kernel: str = "ragged", mesh=None, interpret: bool = False,
            precision=None):
    """The grouped matmul ``kind`` of :data:`_DIMS`: ``jax.lax.ragged_dot_general``, or (``kernel="megablox"``, rows
    a multiple of 128) megablox's ``gmm`` / ``tgmm`` (Pallas; ``interpret`` off a TPU), on ``mesh`` under
    ``shard_map``: the rows split over ``fsdp`` (each shard's group sizes cut to its rows), K over ``tp`` where a
    shard keeps 128 or more, partial sums added by ``psum`` (weight gradients in fp32)."""
    import math

    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    if kernel == "ragged" or a.shape[0] % 128:
        contract, group = _DIMS[kind]
        dims = jax.lax.RaggedDotDimensionNumbers((contract, ([], [])), [0], group)
        return jax.lax.ragged_dot_general(a, b, group_sizes, dims, precision=precision)
    from jax.experimental.pallas.ops.tpu.megablox.ops import backend as mb

    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes)) if mesh is not None else {}
    fsdp, tp, k = sizes.get("fsdp", 1), sizes.get("tp", 1), a.shape[1] if kind == "wgrad" else b.shape[1]
    rows = "fsdp" if fsdp > 1 and a.shape[0] % (fsdp * 128) == 0 else None
    cut = "tp" if tp > 1 and k % tp == 0 and k // tp >= 128 else None
    t = lambda n: min(n, 128)  # noqa: E731 - megablox masks a last partial tile of k and n

    def body(a, b, gs):
        m = a.shape[0]
        if rows:  # this shard's rows [lo, lo + m): each group's share of them
            lo, ends = jax.lax.axis_index(rows) * m, jnp.cumsum(gs)
            gs = (jnp.clip(ends, lo, lo + m) - jnp.clip(ends - gs, lo, lo + m)).astype(jnp.int32)
        tm = math.gcd(m, 128)
        if kind != "wgrad":
            n = b.shape[2] if kind == "fwd" else b.shape[1]
            out = mb.gmm(a, b, gs, a.dtype, (tm, t(a.shape[1]), t(n)), transpose_rhs=kind == "bwd",
                         interpret=interpret)
            return jax.lax.psum(out, cut) if cut and kind == "fwd" else out
        lhs, rhs = (b, a) if b.shape[1] < a.shape[1] else (a, b)  # the wider of K, N minor: no padded lanes
        out = mb.tgmm(lhs.T, rhs, gs, jnp.float32, (tm, t(lhs.shape[1]), t(rhs.shape[1])), interpret=interpret)
        out = out.swapaxes(1, 2) if lhs is b else out
        return (jax.lax.psum(out, rows) if rows else out).astype(a.dtype)

    if not (rows or cut):
        return body(a, b, group_sizes)
    specs = {"fwd": ((P(rows, cut), P(None, cut, None)), P(rows, None)),
             "bwd": ((P(rows, None), P(None, cut, None)), P(rows, cut)),
             "wgrad": ((P(rows, cut), P(rows, None)), P(None, cut, None))}[kind]
    return jax.shard_map(body, mesh=mesh, in_specs=(*specs[0], P()), out_specs=specs[1],
                         check_vma=False)(a, b, group_sizes)


@functools.cache
def _ops():
    """``(lora, frozen)``: :func:`lora_delta`, and a frozen expert matmul, each with its own VJP over
    :func:`grouped` (``how``: its kernel arguments)."""
    import jax

    mm = lambda kind, a, b, gs, how: grouped(kind, a, b, gs, *how)  # noqa: E731

    def lora(x, a, b, gs, scale, how):
        return mm("fwd", mm("fwd", x, a, gs, how), b, gs, how) * scale

    def lora_fwd(x, a, b, gs, scale, how):
        low = mm("fwd", x, a, gs, how)
        return mm("fwd", low, b, gs, how) * scale, (x, a, b, gs, low)

    def lora_bwd(scale, how, res, g):  # autodiff's matmuls, in its order; then the barrier
        x, a, b, gs, low = res
        g = g * scale
        dlow, db = mm("bwd", g, b, gs, how), mm("wgrad", low, g, gs, how)
        dx, da = mm("bwd", dlow, a, gs, how), mm("wgrad", x, dlow, gs, how)
        return (*jax.lax.optimization_barrier((dx, da, db)), None)

    def frozen_bwd(how, res, g):
        x, w, gs = res
        return mm("bwd", g, w, gs, how), mm("wgrad", x, g, gs, how), None

    lora = jax.custom_vjp(lora, nondiff_argnums=(4, 5))
    lora.defvjp(lora_fwd, lora_bwd)
    frozen = jax.custom_vjp(lambda x, w, gs, how: mm("fwd", x, w, gs, how), nondiff_argnums=(3,))
    frozen.defvjp(lambda x, w, gs, how: (mm("fwd", x, w, gs, how), (x, w, gs)), frozen_bwd)
    return lora, frozen


def lora_delta(x, a, b, group_sizes, scale: float, kernel: str = "ragged", mesh=None, interpret: bool = False,
               precision=None):
    """``x_i · A_e · B_e · scale`` for each row ``i`` of group ``e`` (A ``(E, in, r)``, B ``(E, r, out)``), as two
    grouped matmuls (never ``A_e · B_e``). Its VJP is autodiff's with the A and B gradients tied to that of ``x`` by
    an optimization barrier: XLA computes them in the layer's backward, not at the end holding their inputs."""
    return _ops()[0](x, a, b, group_sizes, scale, (kernel, mesh, interpret, precision))
