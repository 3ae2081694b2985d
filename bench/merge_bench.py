"""`make bench`: the streamed merge (merge.merge_lora) vs the paper's load-everything merge vs `cp -r` of the base.

A synthetic Gemma 4 of a few GB is written first: the tiny model's config (tiny.tiny_text_config, i.e. the 31B's
fields) with larger widths, the real key layout (`model.language_model.*`, taken from a transformers model built on
the meta device, so no RAM is spent on it), bf16 like the 31B, in several shards with an index. A synthetic LoRA
(rank 64, every target, tunix's paths and shapes) is saved with Orbax in the layout tunix's PeftTrainer writes.

Each way runs in its own subprocess; wall time and peak RSS (GNU time's %e and %M) are printed side by side.
The streamed merge (XLA kernel), `cp -r` and the weight check of that merge alternate `--repeat` times and their
medians give the lines `merge/cp: X.Xx` and `weight check/merge: X.XXx`; the numpy reference kernel (the merge
before XLA) and the paper's merge run once.
Nothing asserts on time. Goals: streamed peak RSS <= 1.3x the largest shard, wall <= 1.5x the floor, the floor being
the larger of the fastest `cp -r` and the merge's ΔW matmuls alone (`merge/floor: X.Xx`), on the bench checkpoint and
on the 31B projection. `--scaling` prints the merge and cp walls at three checkpoint sizes instead.

Measured on the 2-core dev machine (load 1 to 3), 18 layers, 2.44 GB: merge 7.0 s, fastest cp 0.9 s, ΔW matmuls
1.0 s: about 7x its floor. The merge grows linearly (3.0, 4.6, 7.5 s at 0.90, 1.67, 2.44 GB: about 2.9 s/GB plus
1 s of imports and LoRA restore). The matmuls saturate both cores, so reading, writing and the add and rounding
cannot run beside them: the kernel over a 31B gate_proj takes 0.30-0.40 s on the streamed path, 0.18-0.22 s on
blocks already in memory, 0.12-0.19 s for its matmuls alone.
The page cache is warmed first, and nothing is fsynced, so all ways measure the same thing (memory-speed I/O).

Then: the XLA output against the numpy reference, tensor by tensor (elements that differ, and by how many ulps);
where one shard's time goes (read, casts, maths, write) with each kernel; and one full-size weight of the real 31B
per shape (q, o, gate, down) at rank 64, from which the whole 62 GB checkpoint's merge wall is projected.

    .venv/bin/python bench/merge_bench.py [--dir /tmp/merge_bench] [--layers 18] [--shard-mb 500] [--repeat 3] [--keep]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from gemma_tpu_helpers.fixes.model import model_size

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# What grows from the tiny model (hidden differs from both head dims, as tunix's loader needs).
BENCH_OVERRIDES = {"vocab_size": 32768, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "num_global_key_value_heads": 4, "head_dim": 128,
                   "global_head_dim": 256}


def text_config(layers: int) -> dict:
    from gemma_tpu_helpers.course.config import tiny

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
    """The meta-model key list reproduces what save_pretrained writes (checked on the real tiny checkpoint), the
    vision tower aside: the synthetic base has none (the merge copies it byte for byte, like any untargeted tensor)."""
    from gemma_tpu_helpers.course.config import tiny

    base = tiny.write_tiny_model(tmp / "tiny", layers=6, overwrite=True)
    vision = ("model.vision_tower.", "model.embed_vision.")
    saved = {k for k in json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
             if not k.startswith(vision)}
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
    from gemma_tpu_helpers.fixes.model import gemma4, layout
    from gemma_tpu_helpers.fixes.train import lora, lora_checkpoint

    text = gemma4.read_text_config(base)
    arrays = layout.synthetic_lora(text, lora.HF_TARGETS, rank)
    meta = {"targets": list(lora.HF_TARGETS), "rank": rank, "alpha": float(rank), "dropout": 0.0,
            "qwix_regex": lora.regex_for(lora.HF_TARGETS), "base_model": "synthetic",
            "num_layers": text["num_hidden_layers"]}
    return lora_checkpoint.write_lora_checkpoint(ckpt, arrays, meta, step=1)


def paper_merge(base: Path, ckpt: Path, out: Path) -> None:
    """The paper's approach: every shard in RAM, merge, one model.safetensors (same mapping as ours)."""
    import torch
    from safetensors.torch import load_file, save_file

    from gemma_tpu_helpers.fixes.export import merge_plan
    from gemma_tpu_helpers.fixes.model import gemma4
    from gemma_tpu_helpers.fixes.train import lora_checkpoint

    index = json.loads((base / "model.safetensors.index.json").read_text())
    state = {}
    for shard in sorted(set(index["weight_map"].values())):
        state.update(load_file(str(base / shard)))
    _, arrays = lora_checkpoint.restore_lora(ckpt)
    for d in merge_plan.plan_merge(arrays, lora_checkpoint.read_lora_config(ckpt), gemma4.read_text_config(base)):
        w = state[d.hf]
        state[d.hf] = (w.float() + torch.from_numpy(d.delta())).to(w.dtype)
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for p in base.iterdir():
        if not p.name.endswith(".safetensors") and p.name != "model.safetensors.index.json":
            shutil.copy2(p, out / p.name)


def timed(argv: list[str], env: dict | None = None) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of a command, measured by GNU time (%e, %M).

    Not os.wait4 on a child of this process: a forked child's ru_maxrss counts the parent's pages it held before
    exec, so every way would show this (large) process's RSS.
    """
    with tempfile.NamedTemporaryFile("r", suffix=".time") as f:
        proc = subprocess.run(["/usr/bin/time", "-o", f.name, "-f", "%e %M", *argv], cwd=REPO,
                              env={**os.environ, **(env or {})})
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
    p.add_argument("--repeat", type=int, default=3, help="runs of the streamed merge and of cp (medians)")
    p.add_argument("--skip-paper", action="store_true", help="skip the paper's load-everything merge (62 s, 8 GB)")
    p.add_argument("--scaling", action="store_true",
                   help="only: merge wall and cp wall at 6, 12 and 18 layers (how the cost grows with the checkpoint)")
    p.add_argument("--paper-merge", nargs=3, metavar=("BASE", "CKPT", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.paper_merge:
        paper_merge(*map(Path, args.paper_merge))
        return 0

    work = args.dir
    if args.scaling:
        print(scaling(work / "scaling", args.shard_mb))
        return 0
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
    merge_cmd = lambda kernel, out: [py, "-c", "import sys; from gemma_tpu_helpers.fixes.export import merge; "  # noqa: E731
                                      "merge.merge_lora(*sys.argv[1:4], progress=False, kernel=sys.argv[4])",
                                      str(base), str(ckpt), str(out), kernel]
    cpu_only = {"JAX_PLATFORMS": "cpu"}  # a host-side step: no accelerator (and no libtpu start-up)
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min average, {os.cpu_count()} cores)")
    runs: dict[str, list[tuple[float, float]]] = {}
    check = "weight check of the merge (weight_check.verify_weights)"
    # the streamed weight check of this round's streamed merge (verify --weights): reads base and merged, no writes
    ways = {"streamed merge, XLA kernel (merge.merge_lora)": (merge_cmd("xla", work / "out_streamed"), cpu_only),
            "cp -r base": (["cp", "-r", str(base), str(work / "out_cp")], None),
            check: ([py, "-c", "import sys; from gemma_tpu_helpers.fixes.export import weight_check; "
                     "r = weight_check.verify_weights(*sys.argv[1:4], progress=False); sys.exit(0 if r['ok'] else 1)",
                     str(base), str(ckpt), str(work / "out_streamed")], cpu_only)}
    for i in range(args.repeat):
        for name, (cmd, env) in ways.items():
            if name != check:
                shutil.rmtree(cmd[-2] if name.startswith("streamed") else cmd[-1], ignore_errors=True)
            runs.setdefault(name, []).append(timed(cmd, env))
            print(f"  run {i + 1}: {name}: {runs[name][-1][0]:.1f} s, peak RSS {runs[name][-1][1]:.0f} MiB", flush=True)
    once = {"streamed merge, numpy kernel (before)": (merge_cmd("numpy", work / "out_numpy"), cpu_only)}
    if not args.skip_paper:
        once["load-everything merge (paper)"] = ([py, str(Path(__file__).resolve()), "--paper-merge", str(base),
                                                  str(ckpt), str(work / "out_paper")], None)
    for name, (cmd, env) in once.items():
        shutil.rmtree(cmd[-2] if "merge_lora" in cmd[2] else cmd[-1], ignore_errors=True)
        runs[name] = [timed(cmd, env)]
        print(f"  {name}: {runs[name][0][0]:.1f} s, peak RSS {runs[name][0][1]:.0f} MiB", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")

    med = {name: (statistics.median(w for w, _ in r), max(m for _, m in r)) for name, r in runs.items()}
    copy_wall = med["cp -r base"][0]
    print(f"\n| way | runs | wall (s), median | wall / cp | peak RSS (MiB) | RSS / largest shard ({largest:.0f} MiB) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (wall, rss) in med.items():
        print(f"| {name} | {len(runs[name])} | {wall:.1f} | {wall / copy_wall:.2f} | {rss:.0f} | {rss / largest:.2f} |")
    streamed = med["streamed merge, XLA kernel (merge.merge_lora)"]
    print(f"\nmerge/cp: {streamed[0] / copy_wall:.1f}x (goal <= 3x; runs: "
          f"{', '.join(f'{w:.1f}' for w, _ in runs['streamed merge, XLA kernel (merge.merge_lora)'])} s vs "
          f"{', '.join(f'{w:.1f}' for w, _ in runs['cp -r base'])} s)")
    dots = dots_alone(base, ckpt)
    best_copy = min(w for w, _ in runs["cp -r base"])  # a floor is the best this machine did
    floor = max(best_copy, dots)
    print(f"merge/floor: {streamed[0] / floor:.1f}x (goal <= 1.5x; floor = max(fastest cp -r {best_copy:.1f} s, the "
          f"ΔW matmuls alone {dots:.1f} s), load {os.getloadavg()[0]:.2f})")
    print(f"peak RSS / largest shard: {streamed[1] / largest:.2f}x (goal <= 1.3x)")
    checked = med[check]
    print(f"weight check/merge: {checked[0] / streamed[0]:.2f}x (goal: about 1x or less; runs: "
          f"{', '.join(f'{w:.1f}' for w, _ in runs[check])} s), peak RSS "
          f"{checked[1] / largest:.2f}x the largest shard")
    print(kernel_differences(work / "out_streamed", work / "out_numpy"))
    if not args.skip_paper:
        print(paper_difference(work / "out_streamed", work / "out_paper"))
    print(shard_profile(base, ckpt))
    print(projection(copy_bytes_per_s=sum(s.stat().st_size for s in shards) / best_copy, work=work))
    for out in ("out_streamed", "out_numpy", "out_paper", "out_cp"):
        shutil.rmtree(work / out, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def dot_seconds(a: np.ndarray, b: np.ndarray, scale: float, out_dim: int, in_dim: int, repeat: int = 3) -> float:
    """The floor of one tensor's merge: its ΔW matmuls alone, the merge's own XLA dot over the merge's row blocks
    (same shapes, same precision; no read, no add, no rounding, no write); median of ``repeat``."""
    import jax

    from gemma_tpu_helpers.fixes.export import safetensors_io

    cpu = jax.devices("cpu")[0]
    dot = _dot_kernel()
    rows = safetensors_io.block_rows(in_dim)
    at = jax.device_put(np.ascontiguousarray(a.astype(np.float32).T), cpu)
    bt = np.ascontiguousarray(b.astype(np.float32).T)
    blocks = [jax.device_put(bt[r:r + rows], cpu) for r in range(0, out_dim, rows)]
    s = jax.device_put(np.float32(scale), cpu)
    dot(blocks[0], at, s).block_until_ready()  # compiled outside the timing
    return _time(lambda: [dot(x, at, s) for x in blocks][-1].block_until_ready(), repeat)[0]


@functools.cache
def _dot_kernel():
    import jax
    import jax.numpy as jnp
    from jax import lax

    return jax.jit(lambda bt, at, s: s * jnp.dot(bt, at, precision=lax.Precision.HIGHEST))


def dots_alone(base: Path, ckpt: Path) -> float:
    """Seconds of every targeted tensor's ΔW matmuls alone (:func:`dot_seconds`), the whole checkpoint."""
    from gemma_tpu_helpers.fixes.export import merge_plan
    from gemma_tpu_helpers.fixes.model import gemma4
    from gemma_tpu_helpers.fixes.train import lora_checkpoint

    _, arrays = lora_checkpoint.restore_lora(ckpt)
    deltas = merge_plan.plan_merge(arrays, lora_checkpoint.read_lora_config(ckpt), gemma4.read_text_config(base))
    return sum(dot_seconds(d.a, d.b, d.scale, *d.shape, repeat=1) for d in deltas)


def scaling(work: Path, shard_mb: int, layers=(6, 12, 18)) -> str:
    """The streamed merge's wall (one run, its own process) and cp -r's at three checkpoint sizes, with seconds per
    GB: a cost that grows linearly keeps s/GB flat. Each size's synthetic base is written, then removed."""
    py = sys.executable
    lines = [f"merge wall against checkpoint size (load {os.getloadavg()[0]:.2f})",
             "| layers | GB | merge s | cp s | merge s/GB | cp s/GB | merge/cp |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in layers:
        shutil.rmtree(work, ignore_errors=True)
        base, ckpt = write_base(work / "base", n, shard_mb), work / "checkpoints"
        write_lora(ckpt, base)
        gb = sum(p.stat().st_size for p in base.glob("*.safetensors")) / 1e9
        subprocess.run(f"cat {base}/*.safetensors > /dev/null", shell=True, check=True)
        merge_s, _ = timed([py, "-c", "import sys; from gemma_tpu_helpers.fixes.export import merge; "
                            "merge.merge_lora(*sys.argv[1:4], progress=False)", str(base), str(ckpt),
                            str(work / "out")], {"JAX_PLATFORMS": "cpu"})
        cp_s, _ = timed(["cp", "-r", str(base), str(work / "out_cp")])
        lines.append(f"| {n} | {gb:.2f} | {merge_s:.1f} | {cp_s:.1f} | {merge_s / gb:.2f} | {cp_s / gb:.2f} | "
                     f"{merge_s / cp_s:.1f} |")
    shutil.rmtree(work, ignore_errors=True)
    return "\n".join(lines)


def _shard_tensors(path: Path) -> dict[str, np.ndarray]:
    import ml_dtypes  # noqa: F401  (numpy learns bfloat16, which safetensors' numpy reader needs)
    from safetensors import safe_open

    with safe_open(path, framework="np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def kernel_differences(xla_dir: Path, numpy_dir: Path) -> str:
    """Every tensor of the two merges compared: untargeted must be identical; targeted, how many elements differ
    and by how many ulps (merge.ulp_distance)."""
    from gemma_tpu_helpers.fixes.export import safetensors_io

    counts, total, untargeted_diff, worst = {}, 0, 0, 0
    for shard in sorted(p.name for p in xla_dir.glob("*.safetensors")):
        a, b = _shard_tensors(xla_dir / shard), _shard_tensors(numpy_dir / shard)
        for key in a:
            ulps = safetensors_io.ulp_distance(a[key], b[key])
            if not key.endswith("_proj.weight"):
                untargeted_diff += int((ulps > 0).sum())
                continue
            total += ulps.size
            worst = max(worst, int(ulps.max()))
            for u, n in zip(*np.unique(ulps[ulps > 0], return_counts=True)):
                counts[int(u)] = counts.get(int(u), 0) + int(n)
    hist = ", ".join(f"{n} by {u} ulp" for u, n in sorted(counts.items())) or "none"
    return (f"\nXLA vs numpy kernel: targeted tensors: {sum(counts.values())} of {total} elements differ ({hist}); "
            f"untargeted elements that differ: {untargeted_diff}")


def paper_difference(streamed_dir: Path, paper_dir: Path) -> str:
    from safetensors import safe_open

    key = "model.language_model.layers.0.mlp.down_proj.weight"
    index = json.loads((streamed_dir / "model.safetensors.index.json").read_text())
    with safe_open(streamed_dir / index["weight_map"][key], "pt") as a, \
            safe_open(paper_dir / "model.safetensors", "pt") as b:
        x, y = a.get_tensor(key).float(), b.get_tensor(key).float()
        return (f"streamed vs paper output, {key}: max |diff| {float((x - y).abs().max()):.1e} "
                f"({int((x != y).sum())} of {x.numel()} values differ)")


def _time(fn, repeat: int = 3) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def shard_profile(base: Path, ckpt: Path) -> str:
    """Where the time of the targeted tensors of one shard goes, each step timed alone (medians of 3):
    before (the numpy kernel: a matmul, an add that casts bf16 up and reads ΔW transposed, a cast down) and after
    (the XLA kernel over the same row blocks the merge uses, with the dot alone timed too)."""
    import jax
    import ml_dtypes

    from gemma_tpu_helpers.fixes.export import merge_plan, safetensors_io
    from gemma_tpu_helpers.fixes.model import gemma4
    from gemma_tpu_helpers.fixes.train import lora_checkpoint

    _, shards, _ = safetensors_io.base_layout(base)
    _, arrays = lora_checkpoint.restore_lora(ckpt)
    deltas = {d.hf: d for d in merge_plan.plan_merge(arrays, lora_checkpoint.read_lora_config(ckpt),
                                                     gemma4.read_text_config(base))}
    shard = max(shards, key=lambda s: sum(n in deltas for n in shards[s]))
    names = [n for n in shards[shard] if n in deltas]
    header, start = safetensors_io.read_header(base / shard)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    cpu = jax.devices("cpu")[0]
    dot = _dot_kernel()  # the ΔW matmuls alone, as dot_seconds times them
    t = dict.fromkeys(("read", "before: matmul (A·B)ᵀ·s", "before: cast up + add", "before: cast down",
                       "after: device_put (aliased)", "after: XLA dot alone", "after: XLA kernel (dot + casts + add)",
                       "after: to host", "write"), 0.0)
    elements = differ = 0
    with open(base / shard, "rb") as src, tempfile.TemporaryFile() as sink:
        for name in names:
            d, (b0, b1) = deltas[name], header[name]["data_offsets"]
            out_dim, in_dim = header[name]["shape"]
            elements += out_dim * in_dim

            def read():
                src.seek(start + b0)
                return safetensors_io._read_block(src, b1 - b0).view(bf16).reshape(out_dim, in_dim)

            def matmul():
                dw = (a @ b).T
                dw *= s
                return dw

            def write():
                sink.seek(0)
                sink.write(merged)

            dt, w = _time(read)
            t["read"] += dt
            a, b, s = d.a.astype(np.float32), d.b.astype(np.float32), np.float32(d.scale)
            dt, dw = _time(matmul)
            t["before: matmul (A·B)ᵀ·s"] += dt
            dt, m = _time(lambda: np.add(w, dw, dtype=np.float32))  # noqa: F821 (the del below)
            t["before: cast up + add"] += dt
            dt, merged = _time(lambda: m.astype(bf16))  # noqa: F821
            t["before: cast down"] += dt
            del dw, m
            fn = safetensors_io._xla_block_kernel("bfloat16", fuse_scale=bool(np.frexp(s)[0] == 0.5))
            bt, at = np.ascontiguousarray(b.T), jax.device_put(np.ascontiguousarray(a.T), cpu)
            rows = safetensors_io.block_rows(in_dim)
            blocks = [(w[r:r + rows].view(np.uint16), bt[r:r + rows]) for r in range(0, out_dim, rows)]
            dt, dev = _time(lambda: [(jax.device_put(x, cpu, may_alias=True), jax.device_put(y, cpu))
                                     for x, y in blocks])
            t["after: device_put (aliased)"] += dt
            fn(*dev[0], at, s)[0].block_until_ready()  # compiled outside the timing
            dot(dev[0][1], at, s).block_until_ready()
            dt, _ = _time(lambda: [dot(y, at, s) for _, y in dev][-1].block_until_ready())
            t["after: XLA dot alone"] += dt

            def kernel():
                res = [fn(x, y, at, s) for x, y in dev]
                res[-1][0].block_until_ready()
                return res

            dt, res = _time(kernel)
            t["after: XLA kernel (dot + casts + add)"] += dt
            dt, host = _time(lambda: [np.asarray(r[0]) for r in res])
            t["after: to host"] += dt
            differ += int((np.concatenate(host).view(bf16) != merged).sum())
            dt, _ = _time(write)
            t["write"] += dt
    before = t["read"] + t["before: matmul (A·B)ᵀ·s"] + t["before: cast up + add"] + t["before: cast down"] + t["write"]
    after = (t["read"] + t["after: device_put (aliased)"] + t["after: XLA kernel (dot + casts + add)"]
             + t["after: to host"] + t["write"])
    lines = [f"\nwhere the time goes: the {len(names)} targeted tensors of {shard} ({elements * 2 / 1e6:.0f} MB bf16), "
             f"each step alone and sequential (the merge overlaps reading, maths and writing); load "
             f"{os.getloadavg()[0]:.2f}; XLA vs numpy here: {differ} elements differ",
             "| step | s | ns per element |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {v:.3f} | {1e9 * v / elements:.2f} |" for k, v in t.items()]
    lines.append(f"| sum before (read + numpy steps + write) | {before:.3f} | {1e9 * before / elements:.2f} |")
    lines.append(f"| sum after (read + XLA steps + write) | {after:.3f} | {1e9 * after / elements:.2f} |")
    return "\n".join(lines)


# One full-size weight per shape of the real 31B (HF [out, in]); rank 64.
SHAPES_31B = {"q_proj (local)": lambda c: (c["num_attention_heads"] * c["head_dim"], c["hidden_size"]),
              "o_proj (local)": lambda c: (c["hidden_size"], c["num_attention_heads"] * c["head_dim"]),
              "gate_proj": lambda c: (c["intermediate_size"], c["hidden_size"]),
              "down_proj": lambda c: (c["hidden_size"], c["intermediate_size"])}


def targeted_31b(c: dict) -> tuple[dict[tuple[int, int], int], int]:
    """({(out, in): how many such targeted tensors}, total parameter count) of the real 31B, all 7 targets."""
    import collections

    from gemma_tpu_helpers.fixes.model import layout

    return dict(collections.Counter(layout.targeted_weights(c).values())), model_size.param_count(c)


def projection(copy_bytes_per_s: float, work: Path, rank: int = 64) -> str:
    """Each 31B shape merged alone (medians of 3) through merge.write_merged_shard, then the whole checkpoint:
    every targeted tensor at its shape's measured rate, everything else at the measured cp rate."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from gemma_tpu_helpers.fixes.export import merge_plan, safetensors_io, weight_check
    from gemma_tpu_helpers.fixes.model import gemma4

    c = gemma4.GEMMA4_31B_TEXT_CONFIG
    rng = np.random.default_rng(0)
    lines = [f"\none full-size 31B weight at rank {rank} (bf16, through merge.write_merged_shard, then "
             f"weight_check.check_tensor; load {os.getloadavg()[0]:.2f})",
             "| tensor [out, in] | MB | XLA kernel s | GB/s | ΔW matmuls alone s | numpy kernel s | weight check s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    rate, check_rate, dot_rate = {}, {}, {}
    for label, shape in SHAPES_31B.items():
        out_dim, in_dim = shape(c)
        path = work / "w31b.safetensors"
        w = rng.standard_normal((out_dim, in_dim), dtype=np.float32)
        w *= 0.02
        save_file({"w": w.astype(ml_dtypes.bfloat16)}, str(path))
        del w
        delta = merge_plan.Delta("w", "layers/0/mlp/gate_proj", "gate_proj",
                            (rng.standard_normal((in_dim, rank)) * 0.02).astype(np.float32),
                            (rng.standard_normal((rank, out_dim)) * 0.02).astype(np.float32), 1.0)
        run = lambda kernel: safetensors_io.write_merged_shard(path, work / "w31b_out.safetensors",  # noqa: E731
                                                               {"w": delta}, kernel)
        run("xla")  # compile once, outside the timing
        xla_s, _ = _time(lambda: run("xla"))
        dot_s = dot_seconds(delta.a, delta.b, delta.scale, out_dim, in_dim)
        numpy_s = _time(lambda: run("numpy"), repeat=1)[0] if label == "gate_proj" else None
        header, start = safetensors_io.read_header(path)
        check = lambda: weight_check.check_tensor(path, work / "w31b_out.safetensors", start, start,  # noqa: E731
                                                  header["w"], delta)
        with threadpool_limits(1, user_api="blas"):  # as verify_weights runs it: one BLAS thread per worker
            check_s, res = _time(check)
        assert res["excess"] <= 1, res
        mb = out_dim * in_dim * 2 / 1e6
        rate[(out_dim, in_dim)] = mb * 1e6 / xla_s
        dot_rate[(out_dim, in_dim)] = mb * 1e6 / dot_s
        check_rate[(out_dim, in_dim)] = mb * 1e6 / check_s
        lines.append(f"| {label} [{out_dim}, {in_dim}] | {mb:.0f} | {xla_s:.2f} | {mb / 1e3 / xla_s:.2f} | "
                     f"{dot_s:.2f} | "
                     + (f"{numpy_s:.2f} |" if numpy_s else "- |") + f" {check_s:.2f} |")
    path.unlink()
    (work / "w31b_out.safetensors").unlink()
    shapes, params = targeted_31b(c)
    gb = 2 * params  # the language model's weights in bf16 (the vision tower, ~1 GB, is copied too)
    seconds = check_seconds = dot_total = targeted_bytes = 0.0
    fallback, check_fallback = min(rate.values()), min(check_rate.values())
    for (out_dim, in_dim), count in shapes.items():
        nbytes = 2 * out_dim * in_dim * count
        targeted_bytes += nbytes
        seconds += nbytes / rate.get((out_dim, in_dim), rate.get((in_dim, out_dim), fallback))
        dot_total += nbytes / dot_rate.get((out_dim, in_dim), dot_rate.get((in_dim, out_dim), min(dot_rate.values())))
        check_seconds += nbytes / check_rate.get((out_dim, in_dim), check_rate.get((in_dim, out_dim), check_fallback))
    seconds += (gb - targeted_bytes) / copy_bytes_per_s
    check_seconds += (gb - targeted_bytes) / copy_bytes_per_s  # two files read and compared ~ one read, one written
    lines.append(f"projected merge of the 31B ({gb / 1e9:.0f} GB, {targeted_bytes / 1e9:.1f} GB of it in targeted "
                 f"tensors; shapes not timed above at the slowest rate): {seconds:.0f} s = {seconds / 60:.1f} min, vs "
                 f"cp at this machine's rate {gb / copy_bytes_per_s:.0f} s (plus restoring the LoRA)")
    floor = max(gb / copy_bytes_per_s, dot_total)
    lines.append(f"31B projection merge/floor: {seconds / floor:.1f}x (floor = max(cp {gb / copy_bytes_per_s:.0f} s, "
                 f"the ΔW matmuls alone {dot_total:.0f} s))")
    lines.append(f"projected weight check of that merge (one thread; verify_weights runs tensors on every core): "
                 f"{check_seconds:.0f} s = {check_seconds / 60:.1f} min, {check_seconds / seconds:.1f}x the merge")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
