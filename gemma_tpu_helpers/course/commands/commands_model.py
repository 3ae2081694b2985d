"""The model's steps (notebooks 00-05): setup, tiny-model, parity, mesh, lora, sharding, plan, data-stats."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ...fixes.model import gemma4, hf_checkpoint, parity
from ...fixes.train import chat_tokens, data, packing
from ...fixes.train import remat as remat_lib
from ..budget import param_memory, plan, predictions
from ..config import base_model, paths, profiles, tiny
from ..front import logbook, preflight, workshop
from ..training import profile_steps
from ..views import data_views, model_views
from .cli import (
    Command,
    cli_path,
    data_source_arguments,
    non_negative_int,
    positive_int,
    profile_argument,
    runs_argument,
)

# ---------------------------------------------------------------------------------------------------------- setup


def setup_arguments(p) -> None:
    profile_argument(p)
    p.add_argument("--check", action="store_true",
                   help="workshop readiness: venvs, iverilog, devices, free RAM and disk, the model, a fix for each")
    p.add_argument("--serve", action="store_true", help="with --check: also start the vLLM server once (60-100 s)")
    runs_argument(p, "with --check: runs root (default ./runs)")


def run_setup(args) -> int:
    """Step 00: versions, devices, profile, course map and the profile's memory estimate; --check: is this machine
    ready for the workshop? (one screen, a fix per item)."""
    if args.check:
        items = workshop.readiness(args.profile, serve=args.serve, runs=args.runs)
        print(workshop.format_items(items))
        return 1 if any(i.status == workshop.FAIL for i in items) else 0
    prof = profiles.configure_jax(args.profile)
    print(f"profile: {prof.name} - {prof.description}")
    failed = []
    if prof.hardware.platform == "tpu":  # before JAX looks for the TPU: no libtpu noise off a TPU
        found = preflight.checks(prof)
        print(f"pre-flight:\n{preflight.format_checks(found)}")
        failed = [c.name for c in found if c.status == "fail"]
    for k, v in logbook.versions().items():
        print(f"  {k:18s} {v}")
    if not {"tpu", "hbm"} & set(failed):  # JAX would fail (or print libtpu's noise) looking for the TPU
        print("devices:", json.dumps(logbook.devices()))
    est = param_memory.memory_estimate(prof, base_model.profile_text_config(prof))
    print(f"params: {est['params']:,}  LoRA: {est['lora_params']:,} ({est['trainable_pct']:.2f}% trainable)")
    print(param_memory.memory_table(est).to_string(index=False))
    print(logbook.course_map().drop(columns=["helpers"]).to_string(index=False))
    if failed:
        raise preflight.PreflightError(f"pre-flight failed ({', '.join(failed)}): each FAIL line above says what "
                                       f"to do.")
    return 0


# ----------------------------------------------------------------------------------------------------- tiny-model

def tiny_model_arguments(p) -> None:
    p.add_argument("out_dir", type=cli_path)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--layers", type=positive_int, default=None,
                   help="number of decoder layers; must be a multiple of 6 (5 sliding + 1 global) for 31b, "
                        "26b-a4b and e4b, of 5 (4 + 1) for e2b (default 6 / 6 / 10 / 12 for 31b / 26b-a4b / e2b / "
                        "e4b)")
    p.add_argument("--variant", choices=("31b", "26b-a4b", "e2b", "e4b"), default="31b",
                   help="which real Gemma 4 -it checkpoint to replicate (26b-a4b: the mixture of experts; e2b/e4b: "
                        "per-layer embeddings, KV-shared layers, audio tower, the E chat template)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint in OUT_DIR")


def run_tiny_model(args) -> int:
    """Write the tiny Gemma 4 checkpoint (31B structure, real on-disk layout, trained tokenizer)."""
    out = tiny.write_tiny_model(args.out_dir, seed=args.seed, layers=args.layers, overwrite=args.overwrite,
                                variant=args.variant)
    shards = sorted(p.name for p in Path(out).glob("*.safetensors"))
    print(f"wrote {out}: {len(shards)} safetensors shards + index, config, generation config, tokenizer")
    return 0


# --------------------------------------------------------------------------------------------------------- parity

def parity_arguments(p) -> None:
    p.add_argument("model_dir", type=cli_path)
    profile_argument(p)
    p.add_argument("--seq-len", type=positive_int, default=40)
    p.add_argument("--bound", type=float, default=1e-4, help="max |dlogit| / max |logit| allowed")
    p.add_argument("--layers", action="store_true", help="also compare hidden states after each decoder layer")


def run_parity(args) -> int:
    """tunix vs transformers logits (and, with --layers, hidden states per layer) on a checkpoint."""
    prof = profiles.configure_jax(args.profile)
    preflight.require(prof)
    mesh = prof.make_mesh()
    model = gemma4.load_model(args.model_dir, mesh, dtype="float32")
    stats = parity.compare_logits(args.model_dir, mesh, seq_len=args.seq_len, model=model)
    print(f"max |dlogit|: {stats['max_abs']:.3e}  logit scale: {stats['scale']:.3f}  relative: {stats['rel']:.3e}"
          f"  (bound {args.bound:.0e})")
    if args.layers:
        import pandas as pd

        layers = parity.compare_layers(args.model_dir, mesh, seq_len=args.seq_len, model=model)
        print(pd.DataFrame(layers).to_string(index=False))
    ok = stats["rel"] <= args.bound
    print("parity: OK" if ok else "parity: FAILED")
    return 0 if ok else 1


# ----------------------------------------------------------------------------------------------------------- mesh

def mesh_arguments(p) -> None:
    profile_argument(p)
    p.add_argument("--probe", action="store_true", help="run one trainer step under each mesh context")


def run_mesh(args) -> int:
    """Step 01: the profile's mesh, the tp sizes the model allows, and the trainer mesh-context probe."""
    prof = profiles.configure_jax(args.profile)
    preflight.require(prof)  # a TPU profile needs its TPU, free; checked before JAX is imported
    mesh = prof.make_mesh()
    print(f"mesh {dict(mesh.shape)}:\n{model_views.mesh_grid(mesh).to_string()}")
    text = (base_model.profile_text_config(prof) if prof.model.source != "tiny"
            else hf_checkpoint.read_text_config(base_model.ensure_base(prof)))
    print(model_views.tp_table(text).to_string(index=False))
    if args.probe:
        print(model_views.compare_trainer_contexts(base_model.ensure_check_model(prof), mesh).to_string(index=False))
    return 0


# ----------------------------------------------------------------------------------------------------------- lora

def lora_arguments(p) -> None:
    profile_argument(p)
    p.add_argument("--regex", default=None, help="report a raw qwix regex instead (e.g. the paper's)")
    p.add_argument("--no-experts", action="store_true",
                   help="MoE profiles: LoRA on attention and the dense MLP only, the routed experts untrained")


def run_lora(args) -> int:
    """Step 02: which tunix module gets LoRA for each HF target, per layer."""
    prof = profiles.configure_jax(args.profile)
    preflight.require(prof)  # the TPU profiles load the real model on the chips (after downloading it)
    if args.no_experts:
        prof = profile_steps.without_experts(prof)
    report = profile_steps.lora_report(prof, regex=args.regex)
    print(report.to_string(index=False))
    for key in ("experts", "counts"):  # an MoE: where most of its parameters are, and what LoRA reaches
        if report.attrs.get(key):
            print(report.attrs[key])
    return 0


# ------------------------------------------------------------------------------------------------------- sharding

def run_sharding(args) -> int:
    """Step 03: per-device bytes, audit flags and the fix plan for the profile's model on its mesh."""
    prof = profiles.configure_jax(args.profile)
    summary, _, changes = profile_steps.sharding_plan(prof)
    print((summary / 2**30).round(3).to_string())
    print(changes.to_string(index=False) if len(changes) else "no changes needed")
    return 0


# ----------------------------------------------------------------------------------------------------------- plan

def plan_arguments(p) -> None:
    profile_argument(p)
    p.add_argument("--aot", action="store_true",
                   help="AOT-compile the LoRA train step for the profile's TPU topology (needs libtpu)")
    p.add_argument("--remat", default=None, help="none | block | decoder (default: the profile's)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="default: the profile's max_seq_len")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="compile exactly N layers (60 = the full 31B, for make bench); default: 6 and 12, extrapolated")
    p.add_argument("--qlora", default=None, choices=["nf4"],
                   help="compile the QLoRA step (frozen targeted weights in nf4) instead of the profile's plain LoRA")


def run_plan(args) -> int:
    """Step 04: the analytic per-chip estimate; --aot: XLA's compiled figures for the profile's TPU topology
    (libtpu, no TPU)."""
    if not profiles.tpu_visible():  # compile-only on a host: keep JAX's runtime on the CPU (set before JAX loads)
        paths.set_settings({"JAX_PLATFORMS": "cpu"}, keep=True)
    profile = profiles.get_profile(args.profile)
    if args.remat is not None:
        remat_lib.check_policy(args.remat)
    est = param_memory.memory_estimate(profile, base_model.profile_text_config(profile))
    print(f"profile {profile.name}: {est['params']:,} params, {est['lora_params']:,} LoRA "
          f"({est['trainable_pct']:.2f}% trainable)")
    print(param_memory.memory_table(est).to_string(index=False))
    if not args.aot:
        known = plan.course_plans(profile.run_dir(), settings=((profile.name, args.remat or profile.train.remat,
                                                                 args.qlora or profile.lora.qlora),),
                                  seq_len=args.seq_len, layers=args.layers)
        if known:  # compiled here before (runs/<profile>/plan) or shipped with the course: no compile
            print(plan.format_plan(known[0]))
            print(f"  from: {known[0].source}")
        print("(add --aot for XLA's compiled per-chip figures, activations included" +
              (", compiled now)" if known else ")"))
        return 0
    result = plan.aot_plan(profile, args.remat, args.seq_len, args.layers, qlora=args.qlora)
    print(plan.format_plan(result))
    if result.layers >= result.model_layers and profile.hardware.peak_bf16_flops_per_chip and not result.hbm_oom:
        print(predictions.format_prediction(predictions.predict_run(result, profile)))
    return 0 if result.fits else 1


# ----------------------------------------------------------------------------------------------------- data-stats

def data_stats_arguments(p) -> None:
    profile_argument(p)
    data_source_arguments(p)
    p.add_argument("--base", type=cli_path, default=None,
                   help="checkpoint dir whose tokenizer to use (default: the profile's base)")
    p.add_argument("--show-example", type=non_negative_int, default=None, metavar="N",
                   help="print example N as it is trained (the loss span marked) instead of the statistics")


def run_data_stats(args) -> int:
    """Step 05: packed vs pad-to-max token use for the profile's data."""
    prof = profiles.get_profile(args.profile)
    tokenizer_dir = base_model.ensure_tokenizer(prof, base=args.base)  # the tokenizer files alone, never the weights
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    spec = data.with_source(prof.data, args.source, args.config)
    if args.show_example is not None:  # one example as it is trained: the loss span inside ⟦ ⟧
        view = data_views.show_row(spec, tokenizer, args.show_example)
        print(view["text"])
        print(f"\n{view['tokens']} tokens: {view['prompt_tokens']} of prompt (no loss), "
              f"{view['trained_tokens']} trained (inside {''.join(chat_tokens.TRAINED_MARKS)})")
        return 0
    max_len = prof.train.max_seq_len
    prepared = data.prepare(spec, tokenizer, max_len, prof.train.seed, progress=False)
    padded = packing.pad_to_max([(np.zeros(n, np.int32), np.zeros(n, np.int8)) for n in prepared.lengths],
                             max_len, prof.data.overlong)
    s = prepared.train.stats
    print(f"examples: {s['examples']} (kept {s['kept']}, dropped {s['dropped']}, trimmed {s['trimmed']}; "
          f"max_seq_len {max_len}, overlong={prof.data.overlong})")
    print(f"packed rows: {s['rows']}  pad-to-max rows: {padded.stats['rows']}")
    print(f"packed token use: {100 * s['token_use']:.1f}%")
    print(f"pad-to-max token use: {100 * padded.stats['token_use']:.1f}%")
    return 0


COMMANDS = (
    Command("setup", "00: versions, devices, profile, course map, memory estimate", setup_arguments, run_setup),
    Command("tiny-model", "00: write the tiny random Gemma 4 checkpoint + tokenizer", tiny_model_arguments,
            run_tiny_model),
    Command("parity", "00: tunix vs transformers logits on a checkpoint", parity_arguments, run_parity),
    Command("mesh", "01: the mesh, valid tp sizes, and the trainer mesh-context probe", mesh_arguments, run_mesh),
    Command("lora", "02: LoRA coverage report (HF target names -> tunix modules, per layer)", lora_arguments,
            run_lora),
    Command("sharding", "03: sharding audit and fix plan for the profile (abstract shapes, no weights)",
            profile_argument, run_sharding),
    Command("plan", "04: per-chip memory plan (--aot: XLA's AOT-compiled figures, no TPU needed)", plan_arguments,
            run_plan),
    Command("data-stats", "05: packed vs pad-to-max token use for the profile's data", data_stats_arguments,
            run_data_stats),
)
