"""`make bench`: the smoke train step through the helpers (train.train) against a bare tunix loop.

Both train the profile's LoRA on the same batches with the same loss and optimizer (helper_overhead.compare checks that
their losses agree); the ratio of median step times after the first, compiling, step is what the helpers add.
Then the helpers' step against this machine's floor: its tokens/s, and its FLOP rate (plan.analytic_step_flops: the
matmuls one optimizer step computes, dense attention, the recompute left out) over the host's own matmul rate,
measured in the same process (an fp32 [2048, 2048] product on one CPU device, all cores): a CPU "MFU".
Nothing asserts on time. Goal: ratio <= 1.02.

    .venv/bin/python bench/train_step_bench.py [--profile smoke] [--steps 6] [--base DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gemma_tpu_helpers.course.budget import plan  # noqa: E402
from gemma_tpu_helpers.course.config import base_model, profiles
from gemma_tpu_helpers.fixes.model import gemma4  # noqa: E402

GOAL = 1.02


def host_matmul_flops(n: int = 2048, repeat: int = 10) -> float:
    """FLOP/s of an fp32 [n, n] x [n, n] product on one CPU device (XLA, every core), best of ``repeat``."""
    import time

    import jax
    import numpy as np

    x = jax.device_put(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32), jax.devices("cpu")[0])
    mm = jax.jit(lambda a: a @ a)
    mm(x).block_until_ready()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        mm(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="smoke")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--base", default=None, help="checkpoint to train (default: the profile's base model)")
    args = ap.parse_args()
    profile = profiles.configure_jax(args.profile)
    from gemma_tpu_helpers.course.training import helper_overhead

    base = Path(args.base) if args.base else base_model.ensure_base(profile)
    with tempfile.TemporaryDirectory(prefix="train_step_bench_") as tmp:
        table = helper_overhead.compare(profile, base, Path(tmp) / "run", steps=args.steps)
    print(table.round(4).to_string(index=False))
    a = table.attrs
    print(f"median step after the first: helpers {a['helpers_step_s']:.3f} s, bare tunix {a['bare_step_s']:.3f} s")
    print(f"train step time ratio (helpers / bare tunix): {a['ratio']:.3f}  (goal <= {GOAL}; "
          f"{'met' if a['ratio'] <= GOAL else 'NOT met'})  max |loss diff| {a['max_loss_diff']:.1e}")
    t = profile.train
    text = gemma4.read_text_config(base)
    flops = t.grad_accum * plan.analytic_step_flops(text, t.micro_batch, t.max_seq_len, profile.lora.rank,
                                                    profile.lora.targets, t.remat)["model"]
    peak = host_matmul_flops()
    step_s = a["helpers_step_s"]
    tokens = t.grad_accum * t.micro_batch * t.max_seq_len
    print(f"smoke step: {step_s:.2f} s, {tokens / step_s:,.0f} tokens/s ({tokens} token slots a step), "
          f"{flops / step_s / 1e9:.1f} GFLOP/s of {flops / 1e9:.0f} GFLOP a step; host matmul {peak / 1e9:.0f} GFLOP/s "
          f"-> CPU MFU: {flops / step_s / peak:.3f} (load {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
