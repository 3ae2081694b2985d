"""Data-pipeline throughput: rows/s for tokenise + mask + pack (data.tokenize_rows, data.pack) on CodeV-R1-like rows.

The rows are the shipped Verilog pairs, cycled to ``--rows`` (10,000: the paper's training rows), each prompt
repeated until the example is about as long as a CodeV-R1-like length (``data.codev_like_lengths``: mean 922, p99
2553 tokens). The tokenizer is the tiny model's, in the real Gemma 4 format (``tiny.build_tokenizer``: GemmaTokenizer,
the 31B's chat template). The data settings are the v5p-8 profile's. Figures only; nothing asserts on time.

    .venv/bin/python bench/data_bench.py [--rows 10000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def codev_like_rows(tokenizer, n: int, seed: int = 0) -> list[dict]:
    """``n`` shipped rows (cycled), prompts repeated to reach CodeV-R1-like example lengths."""
    import json

    from gemma_tpu_helpers import data

    shipped = [json.loads(line) for line in data.SHIPPED_SFT.read_text().splitlines() if line.strip()]
    targets = data.codev_like_lengths(n=n, seed=seed)
    rows = []
    for i, want in enumerate(targets):
        row = shipped[i % len(shipped)]
        per = max(1, len(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]))
        base = len(tokenizer(row["response"], add_special_tokens=False)["input_ids"])
        k = max(1, round((int(want) - base) / per))
        rows.append({**row, "prompt": "\n\n".join([row["prompt"]] * k)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)

    from gemma_tpu_helpers import data, profiles, tiny

    prof = profiles.get_profile("v5p-8")
    tokenizer = tiny.build_tokenizer(tiny.tiny_text_config()["vocab_size"])
    rows = codev_like_rows(tokenizer, args.rows)
    print(f"{len(rows):,} rows, load {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    ways = {  # the per-row loop tokenize_rows was before batching, and tokenize_rows itself
        "per row (tokenize_example, two tokenizer calls a row)":
            lambda: [data.tokenize_example(tokenizer, data.spec_messages(r, prof.data)) for r in rows],
        f"batched (tokenize_rows, {data.TOKENIZE_BATCH} rows a call)":
            lambda: data.tokenize_rows(rows, tokenizer, progress=False, spec=prof.data),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    pack_s = []
    for _ in range(args.repeat):  # alternating, so that both see the same load
        for name, fn in ways.items():
            t = time.perf_counter()
            examples = fn()
            times[name].append(time.perf_counter() - t)
        t = time.perf_counter()
        packed = data.pack(examples, prof.train.max_seq_len, prof.data.overlong, tokenizer.pad_token_id or 0)
        pack_s.append(time.perf_counter() - t)
    lengths = [len(ids) for ids, _ in examples]
    pk = statistics.median(pack_s)
    print(f"example tokens: mean {statistics.mean(lengths):.0f}, max {max(lengths)}; packed into {len(packed):,} rows "
          f"of {prof.train.max_seq_len} in {pk:.2f} s ({len(rows) / pk:,.0f} rows/s)")
    for name, ts in times.items():
        tok = statistics.median(ts)
        print(f"tokenise + mask, {name}: {tok:.2f} s ({len(rows) / tok:,.0f} rows/s); with the packing "
              f"{len(rows) / (tok + pk):,.0f} rows/s (runs {', '.join(f'{x:.1f}' for x in ts)} s)")
    print(f"(medians of {args.repeat}; load after {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
