"""The learning check's spread: pass@1 after training over several seeds and several sets of four problems.

One greedy answer per problem after 20 steps is close to the edge: a check that gives 4 of 4 on one machine may
give 3 of 4 on another, or with another seed. This script runs ``learn`` (the same function as
``python -m gemma_tpu_helpers learn``) for each seed on each set, scores the base model once per set, and prints a
markdown table and a summary line, the figures the README and notebook 09 quote.

    .venv/bin/python tools/learn_spread.py                          # smoke, seeds 0-4, three sets, vLLM
    .venv/bin/python tools/learn_spread.py --seeds 0,1 --sets 0 --generator transformers   # quicker

``--sets`` picks sets of four by rank of reference length (0: the four shortest, the default check; 1: the next
four; ...). Each run works in its own folder under ``--work`` (default: a temporary folder, deleted at the end).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="smoke")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--sets", default="0,1,2", help="sets of four problems, by rank of reference length")
    ap.add_argument("--generator", default="vllm", choices=("vllm", "transformers"))
    ap.add_argument("--steps", type=int, default=None, help="instead of the profile's learn.steps (to try a setting)")
    ap.add_argument("--lr", type=float, default=None, help="instead of the profile's learn.learning_rate")
    ap.add_argument("--rank", type=int, default=None, help="instead of the profile's learn.rank (alpha = 2 x rank)")
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()

    from gemma_tpu_helpers.course.config import profiles
    from gemma_tpu_helpers.course.training import learning_check

    profile = profiles.configure_jax(profiles.get_profile(args.profile))
    changes = {k: v for k, v in (("steps", args.steps), ("learning_rate", args.lr), ("rank", args.rank),
                                 ("alpha", args.rank and 2 * args.rank)) if v is not None}
    profile = dataclasses.replace(profile, learn=dataclasses.replace(profile.learn, **changes))
    k = profile.learn.tasks
    by_length = learning_check.by_length()  # the ranking the default set comes from
    sets = [sorted(by_length[i * k:(i + 1) * k]) for i in map(int, args.sets.split(","))]
    seeds = [int(s) for s in args.seeds.split(",")]
    work = args.work or Path(tempfile.mkdtemp(prefix="learn-spread-"))
    rows = []
    try:
        for n, tasks in zip(args.sets.split(","), sets):
            before = None
            for seed in seeds:
                t0 = time.perf_counter()
                res = learning_check.learn(learning_check.with_seed(profile, seed), tasks=tasks, held_out=[],
                                           run_dir=work / f"set{n}-seed{seed}", generator=args.generator,
                                           before=before, progress=False, log=lambda *a: None)
                before = res.before
                passed = int(round(res.pass_at_1("after") * len(tasks)))
                rows.append((n, ",".join(t.split("_")[0] for t in tasks), seed, passed, res.losses[0], res.losses[-1],
                             time.perf_counter() - t0))
                print(f"set {n} seed {seed}: {passed}/{len(tasks)} loss {res.losses[0]:.3f} -> {res.losses[-1]:.3f} "
                      f"({rows[-1][-1]:.0f} s)", flush=True)
                shutil.rmtree(work / f"set{n}-seed{seed}" / "learn" / "merged", ignore_errors=True)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    spec = profile.learn
    print(f"\n{args.profile}: {spec.steps} steps, lr {spec.learning_rate:g}, r{spec.rank}, generator {args.generator}")
    print("| set | problems | seed | passed | loss first -> last | seconds |\n| --- | --- | --- | --- | --- | --- |")
    for n, names, seed, passed, l0, l1, s in rows:
        print(f"| {n} | {names} | {seed} | {passed}/{k} | {l0:.3f} -> {l1:.3f} | {s:.0f} |")
    full = sum(r[3] == k for r in rows)
    most = sum(r[3] >= k - 1 for r in rows)
    print(f"\n{k} of {k} in {full} of {len(rows)} runs; at least {k - 1} of {k} in {most} of {len(rows)}; "
          f"worst {min(r[3] for r in rows)} of {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
