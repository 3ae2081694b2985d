"""Data-pipeline throughput: rows/s for tokenise + mask + pack (data.tokenize_rows, data.pack) on CodeV-R1-like rows.

The rows are the shipped Verilog pairs, cycled to ``--rows`` (10,000: the paper's training rows), each prompt
repeated until the example is about as long as a CodeV-R1-like length (``data.codev_like_lengths``: mean 922, p99
2553 tokens). The tokenizer is the tiny model's, in the real Gemma 4 format (``tiny.build_tokenizer``: GemmaTokenizer,
the 31B's chat template). The data settings are the v5p-8 profile's.

Three ways side by side, alternating so that they see the same load: the per-row reference
(``data.tokenize_example``, two tokenizer calls a row), ``tokenize_rows`` as it was at ``--before`` (read from git),
and ``tokenize_rows`` now; the outputs must be identical (checked). Then where the time of ``tokenize_rows`` goes,
stage by stage, before and now. Figures only; nothing asserts on time.

Measured on the 2-core dev machine under a load of 4 to 5 (others' tests beside it), 10,000 rows, tokenise + mask:
431 rows/s per row, 538 before, 738 now. The Rust tokenizer takes 68% of the time now (75% before: the offsets it
no longer computes), the chat template's 3 renders a row 22%, everything else 10%. The tokenizer alone ran at
about 1,070 rows/s, which caps any pipeline that tokenises every character of every example once, as an exact one
must, on this machine at that load.

    .venv/bin/python bench/data_bench.py [--rows 10000] [--repeat 3] [--before REV]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
BEFORE = "2cbb1d7f0a3b851cbfb965247c6e7e5d929c5552"  # data.py before the throughput work of #15


def codev_like_rows(tokenizer, n: int, seed: int = 0) -> list[dict]:
    """``n`` shipped rows (cycled), prompts repeated to reach CodeV-R1-like example lengths."""
    import json

    from gemma_tpu_helpers.course.config import paths
    from gemma_tpu_helpers.fixes.train import data

    shipped = [json.loads(line) for line in paths.SHIPPED_SFT.read_text().splitlines() if line.strip()]
    targets = data.codev_like_lengths(n=n, seed=seed)
    rows = []
    for i, want in enumerate(targets):
        row = shipped[i % len(shipped)]
        per = max(1, len(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]))
        base = len(tokenizer(row["response"], add_special_tokens=False)["input_ids"])
        k = max(1, round((int(want) - base) / per))
        rows.append({**row, "prompt": "\n\n".join([row["prompt"]] * k)})
    return rows


def data_module_at(rev: str):
    """``gemma_tpu_helpers.fixes.train.data`` as it was at git revision ``rev``; None when git or the revision is
    missing. A file from before the stage folders (``fixes/data.py``, or ``gemma_tpu_helpers/data.py`` before the two
    tiers) has its relative imports (``from .errors import ...``) resolved to today's module of that name."""
    for path in ("gemma_tpu_helpers/fixes/train/data.py", "gemma_tpu_helpers/fixes/data.py",
                 "gemma_tpu_helpers/data.py"):
        try:
            source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True,
                                    text=True).stdout
            break
        except (OSError, subprocess.CalledProcessError):
            source = None
    if source is None:
        return None
    package = "gemma_tpu_helpers.fixes.train"
    if not path.endswith("/train/data.py"):  # a flat folder: each sibling it imports is one of today's fixes
        package = "gemma_tpu_helpers.fixes._flat"
        sys.modules[package] = importlib.util.module_from_spec(importlib.util.spec_from_loader(package, loader=None))
        for file in (REPO / "gemma_tpu_helpers" / "fixes").glob("*/*.py"):
            if file.stem != "__init__":
                sys.modules[f"{package}.{file.stem}"] = importlib.import_module(
                    f"gemma_tpu_helpers.fixes.{file.parent.name}.{file.stem}")
    name = f"{package}._data_before"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    module.__package__, module.__file__ = package, str(REPO / path)
    sys.modules[name] = module
    exec(compile(source, f"{rev[:7]}:{path}", "exec"), module.__dict__)
    return module


STAGES = ("messages (training_target)", "chat template (split_answer)", "Rust tokenizer (batched calls)",
          "ids + loss mask (_join_example)", "packing")


def encode(module, tokenizer, prompts: list[str], answers: list[str]):
    """The tokenizer calls of ``module.tokenize_rows``: one batched call of both (now), or two plain ones (before)."""
    if hasattr(module, "_encode_texts"):
        ids = module._encode_texts(tokenizer, prompts + answers)
        return ids[:len(prompts)], ids[len(prompts):]
    return (tokenizer(prompts, add_special_tokens=False)["input_ids"],
            tokenizer(answers, add_special_tokens=False)["input_ids"])


def stages(module, rows, tokenizer, prof) -> dict[str, float]:
    """Seconds per stage of ``module.tokenize_rows`` (its calls, batch by batch, each stage timed on its own) and
    of the packing."""
    took = dict.fromkeys(STAGES, 0.0)
    examples = []
    for start in range(0, len(rows), module.TOKENIZE_BATCH):
        t = [time.perf_counter()]
        messages = [module.spec_messages(r, prof.data) for r in rows[start:start + module.TOKENIZE_BATCH]]
        t.append(time.perf_counter())
        splits = [module.split_answer(tokenizer, m) for m in messages]
        t.append(time.perf_counter())
        p_ids, a_ids = encode(module, tokenizer, [p for p, _, _ in splits], [a for _, a, _ in splits])
        t.append(time.perf_counter())
        examples += [module._join_example(tokenizer, p, a, eot) for p, a, (_, _, eot) in zip(p_ids, a_ids, splits)]
        t.append(time.perf_counter())
        for name, a, b in zip(STAGES, t, t[1:]):
            took[name] += b - a
    t = time.perf_counter()
    module.pack(examples, prof.train.max_seq_len, prof.data.overlong, tokenizer.pad_token_id or 0)
    took["packing"] = time.perf_counter() - t
    return took


def _bare_tokenizer(texts: list[str], tokenizer) -> int:
    """The floor: the same prompt and answer texts through the tokenizer alone, in tokenize_rows's batches."""
    from gemma_tpu_helpers.fixes.train import data

    return sum(len(ids) for i in range(0, len(texts), 2 * data.TOKENIZE_BATCH)
               for ids in data._encode_texts(tokenizer, texts[i:i + 2 * data.TOKENIZE_BATCH]))


def _pipeline(rows: list[dict], tokenizer, spec) -> int:
    from gemma_tpu_helpers.fixes.train import data

    return sum(len(ids) for ids, _ in data.tokenize_rows(rows, tokenizer, progress=False, spec=spec))


def _in_processes(fn, parts: list, *args) -> float:
    """Wall seconds of ``fn(part, *args)`` for each part, one forked process per part, all at once; one part runs
    in this process (a forked process's Rust tokenizer runs on one thread: the tokenizers library turns its thread
    pool off after a fork, so 2 processes are 2 threads, as 1 process is)."""
    import multiprocessing

    if len(parts) == 1:
        t = time.perf_counter()
        fn(parts[0], *args)
        return time.perf_counter() - t
    with multiprocessing.get_context("fork").Pool(len(parts)) as pool:
        pool.apply(len, ([],))  # the workers are up before the clock starts
        t = time.perf_counter()
        pool.starmap(fn, [(part, *args) for part in parts])
        return time.perf_counter() - t


def floor_ratios(rows: list[dict], tokenizer, prof, repeat: int) -> str:
    """The pipeline (tokenize_rows) against its floor on this machine, the bare tokenizer on the same texts, at 1
    and 2 processes (each process takes half the rows); medians of ``repeat``, the two alternating.

    Measured on the 2-core dev machine, 3,000 rows, load about 1, before / after the render-while-tokenising overlap:
    1 process 1,834 / 2,128 rows/s against the tokenizer's 3,053 / 2,983 (0.60 / 0.71); 2 processes 0.65 / 0.68 (the
    Rust tokenizer of one process already uses both cores). The chat template's 3 renders a row are 32% of the
    pipeline's single-thread time: they stand between it and 0.9."""
    from gemma_tpu_helpers.fixes.train import data

    splits = [data.split_answer(tokenizer, data.spec_messages(r, prof.data)) for r in rows]
    lines = [f"the pipeline against the bare tokenizer on the same rows (load {os.getloadavg()[0]:.2f}):"]
    for procs in (1, 2):
        row_parts = [rows[i::procs] for i in range(procs)]
        text_parts = [[p for p, _, _ in splits[i::procs]] + [a for _, a, _ in splits[i::procs]] for i in range(procs)]
        pipe, bare = [], []
        for _ in range(repeat):
            pipe.append(_in_processes(_pipeline, row_parts, tokenizer, prof.data))
            bare.append(_in_processes(_bare_tokenizer, text_parts, tokenizer))
        p, b = statistics.median(pipe), statistics.median(bare)
        lines.append(f"  {procs} process{'es' if procs > 1 else ''}: pipeline {len(rows) / p:,.0f} rows/s, bare "
                     f"tokenizer {len(rows) / b:,.0f} rows/s -> data/tokenizer: {b / p:.2f}")
    return "\n".join(lines)


def scaling(rows: list[dict], tokenizer, prof, repeat: int, sizes=(1_000, 3_000, 10_000)) -> str:
    """tokenize_rows's rows/s at three row counts (the first rows of the same list; medians of ``repeat``): a cost
    that grows linearly keeps rows/s flat."""
    lines = [f"data rows/s against row count (load {os.getloadavg()[0]:.2f}):"]
    for n in sizes:
        ts = []
        for _ in range(repeat):
            t = time.perf_counter()
            _pipeline(rows[:n], tokenizer, prof.data)
            ts.append(time.perf_counter() - t)
        lines.append(f"  {n:>6,} rows: {n / statistics.median(ts):,.0f} rows/s")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--before", default=BEFORE, help="git revision whose tokenize_rows is the 'before' column")
    p.add_argument("--scaling", action="store_true",
                   help="only: rows/s of tokenize_rows at 1,000, 3,000 and 10,000 rows")
    args = p.parse_args(argv)

    from gemma_tpu_helpers.course.config import profiles, tiny
    from gemma_tpu_helpers.fixes.train import data

    prof = profiles.get_profile("v5p-8")
    tokenizer = tiny.build_tokenizer(tiny.tiny_text_config()["vocab_size"])
    rows = codev_like_rows(tokenizer, max(args.rows, 10_000) if args.scaling else args.rows)
    if args.scaling:
        print(scaling(rows, tokenizer, prof, args.repeat))
        return 0
    print(f"{len(rows):,} rows, load {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    ways = {"per row (tokenize_example: 3 renders, 2 tokenizer calls a row)":
            lambda: [data.tokenize_example(tokenizer, data.spec_messages(r, prof.data)) for r in rows]}
    old = data_module_at(args.before)
    if old is None:
        print(f"(no 'before' column: git show {args.before} failed)")
    else:
        ways[f"before ({args.before[:7]}: tokenize_rows)"] = \
            lambda: old.tokenize_rows(rows, tokenizer, progress=False, spec=prof.data)
    ways[f"now (tokenize_rows, {data.TOKENIZE_BATCH} rows a call)"] = \
        lambda: data.tokenize_rows(rows, tokenizer, progress=False, spec=prof.data)
    times: dict[str, list[float]] = {name: [] for name in ways}
    results = {}
    pack_s = []
    for _ in range(args.repeat):  # alternating, so that all see the same load
        for name, fn in ways.items():
            t = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - t)
        examples = results[name]  # the last way's: now
        t = time.perf_counter()
        packed = data.pack(examples, prof.train.max_seq_len, prof.data.overlong, tokenizer.pad_token_id or 0)
        pack_s.append(time.perf_counter() - t)
    reference = next(iter(results.values()))
    for name, got in results.items():
        same = len(got) == len(reference) and all((a == c).all() and (b == d).all() and a.dtype == c.dtype
                                                  and b.dtype == d.dtype for (a, b), (c, d) in zip(got, reference))
        if not same:
            raise SystemExit(f"{name}: its ids or masks differ from the per-row reference")
    lengths = [len(ids) for ids, _ in examples]
    pk = statistics.median(pack_s)
    print(f"example tokens: mean {statistics.mean(lengths):.0f}, max {max(lengths)}; packed into {len(packed):,} rows "
          f"of {prof.train.max_seq_len} in {pk:.2f} s ({len(rows) / pk:,.0f} rows/s); ids and masks identical across "
          f"the {len(ways)} ways")
    width = max(map(len, ways))
    print(f"{'tokenise + mask':{width}}  {'s':>6}  {'rows/s':>7}  {'+ pack':>7}  runs (s)")
    for name, ts in times.items():
        tok = statistics.median(ts)
        print(f"{name:{width}}  {tok:6.2f}  {len(rows) / tok:7,.0f}  {len(rows) / (tok + pk):7,.0f}  "
              f"{', '.join(f'{x:.1f}' for x in ts)}")
    print(f"(medians of {args.repeat}; load after {os.getloadavg()[0]:.2f})")
    print(floor_ratios(rows, tokenizer, prof, args.repeat))
    split = {"before": stages(old, rows, tokenizer, prof)} if old is not None else {}
    split["now"] = stages(data, rows, tokenizer, prof)
    print(f"where the time goes, stage by stage (load after {os.getloadavg()[0]:.2f}):")
    print(f"  {'':34}" + "".join(f"  {k:>14}" for k in split))
    for name in STAGES + ("total",):
        cells = []
        for took in split.values():
            sec = sum(took.values()) if name == "total" else took[name]
            cells.append(f"{sec:6.2f} s {100 * sec / sum(took.values()):4.0f}%")
        print(f"  {name:34}" + "".join(f"  {c}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
