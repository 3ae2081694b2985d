"""Is the JAX port right? Compare tunix with transformers on the same checkpoint and tokens.

:func:`compare_logits` is the end-to-end check (max |Δlogit| relative to the logit scale).
:func:`compare_layers` localises a difference: the hidden state after every decoder layer, tunix vs
transformers, is how a user debugs a port (a wrong transpose shows up in the first layer it touches).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from .forward_inputs import causal_inputs
from .gemma4 import load_model
from .hf_checkpoint import layer_kinds, read_text_config

# fp32 rounding alone gives ~1e-5 relative on the tiny models; a port bug gives O(1).
DEFAULT_REL_BOUND = 1e-4


def sample_tokens(vocab_size: int, seq_len: int, seed: int = 0, batch: int = 1) -> np.ndarray:
    """Random token ids that avoid the special tokens (ids < 8)."""
    return np.random.RandomState(seed).randint(8, vocab_size, size=(batch, seq_len)).astype(np.int32)


def _jit(fn):
    # Jitted, never eager: eager ops on a multi-device CPU mesh each run their own collectives, and on a machine
    # with fewer cores than virtual devices those can deadlock in XLA's rendezvous.
    from flax import nnx

    return nnx.jit(fn)


@functools.cache
def _forward():
    return _jit(lambda model, tokens, positions, mask: model(tokens, positions, None, mask)[0])


@functools.cache
def _layer_step():
    return _jit(lambda layer, x, positions, mask: layer(x, positions, None, mask)[1])


@functools.cache
def _embed():
    return _jit(lambda embedder, tokens: embedder.encode(tokens))


def forward(model, tokens, positions, mask, mesh):
    """Logits of a tunix model, jitted, on ``mesh``."""
    import jax

    with jax.set_mesh(mesh):
        return _forward()(model, tokens, positions, mask)


def tunix_logits(model, tokens: np.ndarray, mesh) -> np.ndarray:
    toks, positions, mask = causal_inputs(tokens)
    return np.asarray(forward(model, toks, positions, mask, mesh), dtype=np.float64)


def tunix_hidden_states(model, tokens: np.ndarray, mesh) -> list[np.ndarray]:
    """[embeddings, after layer 0, ..., after layer L-1] from the tunix model, run layer by layer."""
    import jax

    toks, positions, mask = causal_inputs(tokens)
    out = []
    with jax.set_mesh(mesh):
        x = _embed()(model.embedder, toks)
        out.append(np.asarray(x, dtype=np.float64))
        for layer in model.layers:
            x = _layer_step()(layer, x, positions, mask)
            out.append(np.asarray(x, dtype=np.float64))
    return out


def load_hf(model_dir: str | Path, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()


def hf_logits_and_hidden(hf_model, tokens: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Logits and [embeddings, after layer 0, ..., after layer L-1], captured with forward hooks."""
    import torch

    lm = hf_model.model.language_model
    captured: list = []
    hooks = [lm.embed_tokens.register_forward_hook(lambda m, i, o: captured.append(o))]
    hooks += [layer.register_forward_hook(lambda m, i, o: captured.append(o[0] if isinstance(o, tuple) else o))
              for layer in lm.layers]
    try:
        with torch.no_grad():
            logits = hf_model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits
    finally:
        for h in hooks:
            h.remove()
    return logits.double().numpy(), [c.double().numpy() for c in captured]


def _stats(ours: np.ndarray, ref: np.ndarray) -> dict:
    diff = np.abs(ours - ref)
    scale = float(np.abs(ref).max())
    return {"max_abs": float(diff.max()), "scale": scale, "rel": float(diff.max()) / max(scale, 1e-30)}


def compare_logits(model_dir, mesh, seq_len: int = 40, seed: int = 0, model=None, hf_model=None) -> dict:
    """tunix vs transformers logits on ``seq_len`` random tokens, in fp32.

    Returns max |Δlogit|, the logit scale (max |logit|), their ratio ``rel``, and the max error per position.
    """
    text = read_text_config(model_dir)
    tokens = sample_tokens(text["vocab_size"], seq_len, seed)
    model = model if model is not None else load_model(model_dir, mesh, dtype="float32")
    hf_model = hf_model if hf_model is not None else load_hf(model_dir)
    ours = tunix_logits(model, tokens, mesh)
    ref, _ = hf_logits_and_hidden(hf_model, tokens)
    stats = _stats(ours, ref)
    stats["per_position"] = np.abs(ours - ref).max(axis=(0, 2)).tolist()
    stats["seq_len"] = seq_len
    return stats


def compare_layers(model_dir, mesh, seq_len: int = 40, seed: int = 0, model=None, hf_model=None) -> list[dict]:
    """Max |Δh| after the embeddings and after each decoder layer, tunix vs transformers, absolute and relative: one
    row (``after``, ``max_abs``, ``scale``, ``rel``) each; the first row far above the others is where a port
    diverges."""
    text = read_text_config(model_dir)
    tokens = sample_tokens(text["vocab_size"], seq_len, seed)
    model = model if model is not None else load_model(model_dir, mesh, dtype="float32")
    hf_model = hf_model if hf_model is not None else load_hf(model_dir)
    ours = tunix_hidden_states(model, tokens, mesh)
    _, ref = hf_logits_and_hidden(hf_model, tokens)
    names = ["embeddings"] + [f"layer {i} ({k})" for i, k in enumerate(layer_kinds(text))]
    return [{"after": name, **_stats(o, r)} for name, o, r in zip(names, ours, ref, strict=True)]


def rounding_budget(model_dir, mesh, seq_len: int = 40, seed: int = 0, model=None) -> list[dict]:
    """Where the fp32 residual comes from: each fp32 run against a float64 transformers reference, one row
    (``comparison`` and :func:`compare_logits`' statistics) each.

    If tunix fp32 is as far from the fp64 reference as transformers' own fp32 run is, the tunix-vs-transformers
    difference is float32 rounding, not a port bug.
    """
    text = read_text_config(model_dir)
    tokens = sample_tokens(text["vocab_size"], seq_len, seed)
    model = model if model is not None else load_model(model_dir, mesh, dtype="float32")
    ours = tunix_logits(model, tokens, mesh)
    ref32, _ = hf_logits_and_hidden(load_hf(model_dir, "float32"), tokens)
    ref64, _ = hf_logits_and_hidden(load_hf(model_dir, "float64"), tokens)
    return [
        {"comparison": "tunix fp32 vs transformers fp32", **_stats(ours, ref32)},
        {"comparison": "tunix fp32 vs transformers fp64", **_stats(ours, ref64)},
        {"comparison": "transformers fp32 vs transformers fp64", **_stats(ref32, ref64)},
    ]
