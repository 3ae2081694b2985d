"""Positions and causal masks for a Gemma 4 forward, for plain rows and for packed rows (examples told apart by
segment ids): one builder for every forward."""

from __future__ import annotations

import numpy as np

BATCH_DTYPES = {"tokens": np.int32, "loss_mask": np.int8, "segment_ids": np.int32, "positions": np.int32}


def attention_mask_from_segments(segment_ids):
    """Block-diagonal causal mask [B, T, T]: a token sees earlier tokens of its own example only.

    A numpy input gives a numpy mask (no JAX op: what the multi-process input path needs); anything else, a jax array.
    """
    if isinstance(segment_ids, np.ndarray):
        xp, seg = np, segment_ids
    else:
        import jax.numpy as xp

        seg = xp.asarray(segment_ids)
    t = seg.shape[-1]
    causal = xp.tril(xp.ones((t, t), bool))
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    return same & causal[None]


def causal_inputs(tokens):
    """``(tokens, positions, causal mask)`` as JAX arrays for unpacked rows (one example per row, no padding)."""
    import jax.numpy as jnp

    tokens = jnp.asarray(tokens)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    return tokens, positions, attention_mask_from_segments(jnp.ones((b, t), jnp.int32))
