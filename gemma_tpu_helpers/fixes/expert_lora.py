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
"""

from __future__ import annotations

import dataclasses
import functools
import math

from . import layout

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
            return qarray.dequantize(flax_util.unbox(self.array))

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
            res = jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision,
                                     preferred_element_type=preferred_element_type, group_offset=group_offset,
                                     **kwargs)
            rule, _ = self._get_current_rule_and_op_id(OP)
            if not isinstance(rule, qwix_lora.LoraRule) or rhs.ndim != 3:
                return res
            module = flax_util.get_current_module()
            name = _weight_name(module, rhs)
            if name is None:
                return res
            e, k, n = rhs.shape
            same_layout = tuple(getattr(module, name).shape) == (e, k, n)
            lora_a, lora_b = qwix_lora._get_or_create_lora_params(  # the dense LoRA's own: names, sharding
                name=name, rule=rule, a_shape=(e, k, rule.rank), b_shape=(e, rule.rank, n),
                a_sharding_transpose=(0, 1, None) if same_layout else (0, None, None),
                b_sharding_transpose=(0, None, 2) if same_layout else (0, None, None))
            if rule.dropout > 0:
                lhs = nnx.Dropout(rule.dropout, deterministic=False)(lhs, rngs=flax_util.make_rng("dropout"))
            low = jax.lax.ragged_dot(lhs, lora_a.astype(lhs.dtype), group_sizes, precision=precision,
                                     group_offset=group_offset)
            delta = jax.lax.ragged_dot(low, lora_b.astype(lhs.dtype), group_sizes, precision=precision,
                                       group_offset=group_offset)
            return res + (delta * (rule.alpha / rule.rank)).astype(res.dtype)

    return ExpertLoraProvider
