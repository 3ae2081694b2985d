"""`make bench`: the smoke train step through the helpers (train.train) against a bare tunix loop.

Both train the profile's LoRA on the same batches with the same loss and optimizer (overhead.compare checks that
their losses agree); the ratio of median step times after the first, compiling, step is what the helpers add.
Nothing asserts on time. Goal: ratio <= 1.10.

    .venv/bin/python bench/train_step_bench.py [--profile smoke] [--steps 6] [--base DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gemma_tpu_helpers.course import base_model, profiles  # noqa: E402

GOAL = 1.10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="smoke")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--base", default=None, help="checkpoint to train (default: the profile's base model)")
    args = ap.parse_args()
    profile = profiles.configure_jax(args.profile)
    from gemma_tpu_helpers.course import overhead

    base = Path(args.base) if args.base else base_model.ensure_base(profile)
    with tempfile.TemporaryDirectory(prefix="train_step_bench_") as tmp:
        table = overhead.compare(profile, base, Path(tmp) / "run", steps=args.steps)
    print(table.round(4).to_string(index=False))
    a = table.attrs
    print(f"median step after the first: helpers {a['helpers_step_s']:.3f} s, bare tunix {a['bare_step_s']:.3f} s")
    print(f"train step time ratio (helpers / bare tunix): {a['ratio']:.3f}  (goal <= {GOAL}; "
          f"{'met' if a['ratio'] <= GOAL else 'NOT met'})  max |loss diff| {a['max_loss_diff']:.1e}")


if __name__ == "__main__":
    main()
