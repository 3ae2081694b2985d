"""Shims for bugs of the pinned tunix (0.1.7) and qwix (0.1.8), one function pair each (patch, unpatch).

Nothing is patched at import: ``lora.apply_lora(qlora=...)`` and ``gemma4.to_tunix_config`` (MoE) call the patches.
The tests run the unpatched path as a strict xfail, so an upstream fix shows up as XPASS and the shim can go.
"""

from __future__ import annotations

import contextlib

_ORIGINALS: dict[str, object] = {}


def _einsum_cls():
    from tunix.models.gemma4 import model as gm

    return gm.Einsum


def patch_gemma4_qlora_einsum() -> bool:
    """Make tunix's Gemma 4 ``Einsum`` accept a qwix-quantized weight. Idempotent; True if it changed anything.

    tunix casts the weight with ``jnp.astype``, which rejects qwix's QLoRA ``WithAux`` at the first train step;
    the patch hands the quantized weight to ``jnp.einsum`` uncast, which qwix intercepts for the nf4 matmul.
    """
    if "gemma4_qlora_einsum" in _ORIGINALS:
        return False
    import jax.numpy as jnp
    from qwix._src.providers import ptq

    cls = _einsum_cls()
    original = cls.__call__

    def __call__(self, x):
        w = self.w.value
        if not isinstance(w, ptq.WithAux):
            return original(self, x)
        if self.w_scale is not None:  # only the per-layer-input projection (E2B/E4B) uses it
            raise NotImplementedError("QLoRA on a Gemma 4 Einsum with w_scale (per-layer inputs) is not supported.")
        x = jnp.astype(x, self.dtype)
        return jnp.einsum(self.einsum_str, x, w)  # qwix's einsum takes the quantized weight as it is

    __call__.__wrapped__ = original
    cls.__call__ = __call__
    _ORIGINALS["gemma4_qlora_einsum"] = original
    return True


def unpatch_gemma4_qlora_einsum() -> bool:
    """Restore tunix's own ``Einsum.__call__``. True if a patch was removed."""
    original = _ORIGINALS.pop("gemma4_qlora_einsum", None)
    if original is None:
        return False
    _einsum_cls().__call__ = original
    return True


def _moe_block(self, x, segment_pos, cache, attn_mask, per_layer_input=None, kv_shared_cache=None):
    """tunix's ``DecoderLayer.block`` for an MoE layer, with the router fed the residual (``attn``)."""
    if self.config.per_layer_input_dim:
        raise NotImplementedError("An MoE Gemma 4 with per-layer inputs does not exist; this shim does not add them.")
    cache, attn, kv = self.attn(self.pre_attention_norm(x), segment_pos, cache, attn_mask,
                                kv_shared_cache=kv_shared_cache)
    attn = self.post_attention_norm(attn) + x
    dense = self.dense_post_ffw_norm(self.mlp(self.pre_ffw_norm(attn)))
    experts = self.moe_post_ffw_norm(self.moe(self.moe_pre_ffw_norm(attn), router_input=attn))
    ffw = self.post_ffw_norm(dense + experts) + attn
    return cache, ffw * self.skip_scale.value, kv


def _moe_call(self, x, router_input=None):
    """tunix's ``MoERagged.__call__`` with the router's input apart from the experts' (exact top-k)."""
    import jax
    import jax.numpy as jnp

    r = x if router_input is None else router_input
    var = jnp.mean(jnp.square(r.astype(jnp.float32)), axis=-1, keepdims=True)
    r = r * jax.lax.rsqrt(var + 1e-06).astype(r.dtype)
    r = r * jax.lax.rsqrt(jnp.array(self.features, dtype=r.dtype)) * self.router_scale.value.astype(r.dtype)
    logits = jnp.einsum("gsd,de->gse", r, self.router_logits.value.astype(r.dtype)).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    _, choices = jax.lax.top_k(logits, self.num_experts_per_datapoint)
    picked = jnp.take_along_axis(probs, choices, axis=-1).sum(axis=-1, keepdims=True)
    return self._run_ffw_and_routing(x, choices, probs / picked)


def patch_gemma4_moe_router() -> bool:
    """Feed tunix's Gemma 4 MoE router the residual, as the released 26B-A4B expects. Idempotent; True if it
    changed anything.

    tunix 0.1.7 routes on the experts' normed input with approximate top-k, so the real checkpoint picks other
    experts; transformers and vLLM route on the residual (fixed on tunix main by e31e280).
    """
    if "gemma4_moe_router" in _ORIGINALS:
        return False
    from tunix.models.gemma4 import model as gm
    from tunix.models.gemma4 import moe

    original = (gm.DecoderLayer.block, moe.MoERagged.__call__)

    def block(self, *args, **kwargs):
        return (_moe_block if self.config.enable_moe else original[0])(self, *args, **kwargs)

    block.__wrapped__ = original[0]
    gm.DecoderLayer.block = block
    moe.MoERagged.__call__ = _moe_call
    _ORIGINALS["gemma4_moe_router"] = original
    return True


def unpatch_gemma4_moe_router() -> bool:
    """Restore tunix's own MoE layer. True if a patch was removed."""
    original = _ORIGINALS.pop("gemma4_moe_router", None)
    if original is None:
        return False
    from tunix.models.gemma4 import model as gm
    from tunix.models.gemma4 import moe

    gm.DecoderLayer.block, moe.MoERagged.__call__ = original
    return True


def applied() -> list[str]:
    """Names of the shims currently in effect."""
    return sorted(_ORIGINALS)


@contextlib.contextmanager
def unpatched():
    """Run a block with tunix as shipped (to check whether upstream still needs the shims)."""
    shims = {"gemma4_qlora_einsum": (patch_gemma4_qlora_einsum, unpatch_gemma4_qlora_einsum),
             "gemma4_moe_router": (patch_gemma4_moe_router, unpatch_gemma4_moe_router)}
    was = [name for name in shims if name in _ORIGINALS]
    for name in was:
        shims[name][1]()
    try:
        yield
    finally:
        for name in was:
            shims[name][0]()
