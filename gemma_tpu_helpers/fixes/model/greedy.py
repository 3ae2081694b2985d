"""Greedy parity: vLLM's greedy tokens equal the JAX (tunix) model's on the same checkpoint.

:func:`jax_greedy` and ``vllm_client.Client.complete_ids`` decode from the same ids; :func:`parity_table` and
:func:`parity_summary` line them up and say whether a divergence sits on a near-tie (fp32 noise, not a bug).
"""

from __future__ import annotations

from .forward_inputs import causal_inputs

# Raw text, no chat template: on the random tiny model it gives a varied continuation with no near-ties (chat
# prompts tend to repeat one token).
PARITY_TEXT = "always @(posedge clk) begin\n  if (rst) q <= 0;"  # 5+ distinct tokens in 20 on the replica


def jax_greedy(model, mesh, token_ids, n: int, return_margins: bool = False):
    """``n`` greedy tokens from the tunix model, recomputing the whole padded sequence each step (one jitted
    forward; the causal mask hides the padding). ``return_margins``: also each step's top-2 logit gap, since a
    near-tie under fp32 noise can flip an argmax without a bug."""
    import jax
    import numpy as np
    from flax import nnx

    @nnx.jit
    def forward(model, toks, positions, mask):
        logits, _ = model(toks, positions, None, mask)
        return logits

    prompt = [int(t) for t in token_ids]
    seq = np.zeros((1, len(prompt) + n), dtype=np.int32)
    seq[0, : len(prompt)] = prompt
    cur = len(prompt)
    out, margins = [], []
    with jax.set_mesh(mesh):
        _, positions, mask = causal_inputs(seq)
        for _ in range(n):
            logits = forward(model, jax.numpy.asarray(seq), positions, mask)
            last = np.asarray(logits[0, cur - 1], dtype=np.float64)
            best = int(last.argmax())
            top2 = np.sort(last)[-2:]
            out.append(best)
            margins.append(float(top2[1] - top2[0]))
            seq[0, cur] = best
            cur += 1
    return (out, margins) if return_margins else out


def parity_table(jax_tokens, jax_margins, vllm_out: dict):
    """Position by position: JAX token, vLLM token, equal, JAX's top-2 logit gap and vLLM's top-2 logprob gap.

    (A logprob gap equals the logit gap: log-softmax only shifts all logits of a position by the same amount.)
    """
    import pandas as pd

    rows = []
    for i, (j, v) in enumerate(zip(jax_tokens, vllm_out["token_ids"], strict=True)):
        top = vllm_out["top"][i] if i < len(vllm_out["top"]) else []
        gap = top[0][1] - top[1][1] if len(top) >= 2 else float("nan")
        rows.append({"position": i, "jax token": j, "vllm token": v, "equal": j == v,
                     "jax top-2 gap": round(jax_margins[i], 4), "vllm top-2 gap": round(gap, 4)})
    return pd.DataFrame(rows)


def parity_summary(table) -> dict:
    """How many leading tokens agree, and whether a first divergence sits on a near-tie."""
    eq = table["equal"].tolist()
    prefix = eq.index(False) if False in eq else len(eq)
    out = {"n": len(eq), "equal_prefix": prefix, "all_equal": prefix == len(eq),
           "min_jax_gap": float(table["jax top-2 gap"].min())}
    if prefix < len(eq):
        out["first_divergence_jax_gap"] = float(table["jax top-2 gap"].iloc[prefix])
    return out
