"""`make bench`: the streamed merge (merge.merge_lora) vs the paper's load-everything merge vs `cp -r` of the base.

A synthetic Gemma 4 of a few GB is written first: the tiny model's config (tiny.tiny_text_config, i.e. the 31B's
fields) with larger widths, the real key layout (`model.language_model.*`, taken from a transformers model built on
the meta device, so no RAM is spent on it), bf16 like the 31B, in several shards with an index. A synthetic LoRA
(rank 64, every target, tunix's paths and shapes) is saved with Orbax in the layout tunix's PeftTrainer writes.

Each way runs in its own subprocess; wall time and peak RSS (GNU time's %e and %M) are printed side by side.
Nothing asserts on time. Goals: streamed peak RSS <= 1.3x the largest shard, wall <= 2x the copy.
The page cache is warmed first, and nothing is fsynced, so all three measure the same thing (memory-speed I/O).

    .venv/bin/python bench/merge_bench.py [--dir /tmp/merge_bench] [--layers 18] [--shard-mb 500] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# What grows from the tiny model (hidden differs from both head dims, as tunix's loader needs).
BENCH_OVERRIDES = {"vocab_size": 32768, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "num_global_key_value_heads": 4, "head_dim": 128,
                   "global_head_dim": 256}


def text_config(layers: int) -> dict:
    from gemma_tpu_helpers import tiny

    return dict(tiny.tiny_text_config(layers), **BENCH_OVERRIDES)


def tensor_specs(text: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor a Gemma4ForConditionalGeneration saves for this text config (tied lm_head)."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig

    config = Gemma4Config(text_config=Gemma4TextConfig(**text), vision_config=None, audio_config=None)
    with torch.device("meta"):
        model = Gemma4ForConditionalGeneration(config)
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items() if k != "lm_head.weight"], config


def check_specs_match_tiny(tmp: Path) -> None:
    """The meta-model key list reproduces what save_pretrained writes (checked on the real tiny checkpoint)."""
    from gemma_tpu_helpers import tiny

    base = tiny.write_tiny_model(tmp / "tiny", layers=6, overwrite=True)
    saved = set(json.loads((base / "model.safetensors.index.json").read_text())["weight_map"])
    specs, _ = tensor_specs(tiny.tiny_text_config(6))
    assert {k for k, _ in specs} == saved, "the synthetic base would not have the real key layout"
    shutil.rmtree(base)


def write_base(out: Path, layers: int, shard_mb: int, seed: int = 0) -> Path:
    """A random bf16 Gemma 4 checkpoint, written shard by shard (memory: one shard)."""
    import torch
    from safetensors.torch import save_file

    text = text_config(layers)
    specs, config = tensor_specs(text)
    out.mkdir(parents=True, exist_ok=True)
    config.text_config.dtype = "bfloat16"
    config.save_pretrained(out)
    torch.manual_seed(seed)
    limit = shard_mb << 20
    shards, cur, size = [], {}, 0
    for name, shape in specs:
        n = 2 * int(torch.Size(shape).numel())
        if cur and size + n > limit:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = shape
        size += n
    shards.append(cur)
    weight_map, total = {}, 0
    for i, group in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {k: (torch.randn(s, dtype=torch.float32) * 0.02).to(torch.bfloat16) for k, s in group.items()}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update({k: fname for k in group})
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": 1}))
    return out


def write_lora(ckpt: Path, base: Path, rank: int = 64) -> Path:
    from gemma_tpu_helpers import gemma4, lora, merge

    text = gemma4.read_text_config(base)
    arrays = merge.synthetic_lora(text, lora.HF_TARGETS, rank)
    meta = {"targets": list(lora.HF_TARGETS), "rank": rank, "alpha": float(rank), "dropout": 0.0,
            "qwix_regex": lora.regex_for(lora.HF_TARGETS), "base_model": "synthetic",
            "num_layers": text["num_hidden_layers"]}
    return merge.write_lora_checkpoint(ckpt, arrays, meta, step=1)


def paper_merge(base: Path, ckpt: Path, out: Path) -> None:
    """The paper's approach: every shard in RAM, merge, one model.safetensors (same mapping as ours)."""
    import torch
    from safetensors.torch import load_file, save_file

    from gemma_tpu_helpers import gemma4, merge

    index = json.loads((base / "model.safetensors.index.json").read_text())
    state = {}
    for shard in sorted(set(index["weight_map"].values())):
        state.update(load_file(str(base / shard)))
    _, arrays = merge.restore_lora(ckpt)
    for d in merge.plan(arrays, merge.read_lora_config(ckpt), gemma4.read_text_config(base)):
        w = state[d.hf]
        state[d.hf] = (w.float() + torch.from_numpy(d.delta())).to(w.dtype)
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for p in base.iterdir():
        if not p.name.endswith(".safetensors") and p.name != "model.safetensors.index.json":
            shutil.copy2(p, out / p.name)


def timed(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of a command, measured by GNU time (%e, %M).

    Not os.wait4 on a child of this process: a forked child's ru_maxrss counts the parent's pages it held before
    exec, so every way would show this (large) process's RSS.
    """
    with tempfile.NamedTemporaryFile("r", suffix=".time") as f:
        proc = subprocess.run(["/usr/bin/time", "-o", f.name, "-f", "%e %M", *argv], cwd=REPO)
        if proc.returncode:
            raise SystemExit(f"{argv} failed with exit code {proc.returncode}")
        wall, kib = f.read().split()[-2:]
    return float(wall), int(kib) / 1024


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp/merge_bench"))
    p.add_argument("--layers", type=int, default=18, help="a multiple of 6 (18: about 2.4 GB in bf16)")
    p.add_argument("--shard-mb", type=int, default=500)
    p.add_argument("--keep", action="store_true", help="keep the synthetic base and checkpoint for the next run")
    p.add_argument("--paper-merge", nargs=3, metavar=("BASE", "CKPT", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.paper_merge:
        paper_merge(*map(Path, args.paper_merge))
        return 0

    work = args.dir
    base, ckpt = work / "base", work / "checkpoints"
    if not (base / "model.safetensors.index.json").is_file():
        shutil.rmtree(work, ignore_errors=True)
        t = time.perf_counter()
        check_specs_match_tiny(work)
        write_base(base, args.layers, args.shard_mb)
        write_lora(ckpt, base)
        print(f"synthetic base + LoRA written in {time.perf_counter() - t:.0f} s")
    shards = sorted(base.glob("*.safetensors"))
    largest = max(s.stat().st_size for s in shards) / 2**20
    total = sum(s.stat().st_size for s in shards) / 1e9
    print(f"base: {total:.2f} GB in {len(shards)} shards (largest {largest:.0f} MiB), bf16, "
          f"{args.layers} layers; LoRA rank 64 on all 7 targets")
    subprocess.run(f"cat {base}/*.safetensors > /dev/null", shell=True, check=True)  # warm the page cache

    py = sys.executable
    ways = {
        "streamed merge (merge.merge_lora)": [py, "-c", "import sys; from gemma_tpu_helpers import merge; "
                                              "merge.merge_lora(sys.argv[1], sys.argv[2], sys.argv[3], progress=False)",
                                              str(base), str(ckpt), str(work / "out_streamed")],
        "load-everything merge (paper)": [py, str(Path(__file__).resolve()), "--paper-merge", str(base), str(ckpt),
                                          str(work / "out_paper")],
        "cp -r base": ["cp", "-r", str(base), str(work / "out_cp")],
    }
    rows = []
    for name, cmd in ways.items():
        out = Path(cmd[-1])
        shutil.rmtree(out, ignore_errors=True)
        wall, rss = timed(cmd)
        rows.append((name, wall, rss))
        print(f"  {name}: {wall:.1f} s, peak RSS {rss:.0f} MiB", flush=True)

    from safetensors import safe_open

    key = "model.language_model.layers.0.mlp.down_proj.weight"
    index = json.loads((work / "out_streamed" / "model.safetensors.index.json").read_text())
    with safe_open(work / "out_streamed" / index["weight_map"][key], "pt") as a, \
            safe_open(work / "out_paper" / "model.safetensors", "pt") as b:
        x, y = a.get_tensor(key).float(), b.get_tensor(key).float()
        same = f"max |diff| {float((x - y).abs().max()):.1e} ({int((x != y).sum())} of {x.numel()} values differ)"
    copy_wall = rows[-1][1]
    print(f"\nstreamed vs paper output, {key}: {same}")
    print(f"\n| way | wall (s) | wall / cp | peak RSS (MiB) | RSS / largest shard ({largest:.0f} MiB) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, wall, rss in rows:
        print(f"| {name} | {wall:.1f} | {wall / copy_wall:.2f} | {rss:.0f} | {rss / largest:.2f} |")
    streamed = rows[0]
    print(f"\ngoals: peak RSS <= 1.3x largest shard: {streamed[2] / largest:.2f}x; wall <= 2x cp: "
          f"{streamed[1] / copy_wall:.2f}x")
    for out in ("out_streamed", "out_paper", "out_cp"):
        shutil.rmtree(work / out, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
