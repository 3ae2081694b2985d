"""``python -m gemma_tpu_helpers <step> ...``: the functions the notebooks call, from a shell (for tmux on a TPU VM)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from .course import (base_model, commands, cost, exercises, launch, logbook, paths, plan, preflight, profile_steps,
                     profiles, serving_bench, site, tiny, train, workshop)
from .fixes import data, gemma4, multihost, parity
from .fixes import mesh as mesh_lib
from .fixes.errors import run_cli
from .fixes.file_io import cli_path, cli_path_or_gs
from .fixes.preemption import PREEMPTED_EXIT
from .fixes.gemma4 import load_model


def _profile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=None, help=f"one of {', '.join(profiles.PROFILES)} "
                   f"(default: ${profiles.ENV_VAR}, else smoke when no TPU is visible)")


def _data_source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", type=paths.data_source, default=None,
                   help="another copy of the profile's data: a local copy of the dataset's repository, a dataset id, "
                        "a .jsonl/.json/.parquet file or 'shipped' (the course's replica; default: the profile's)")
    p.add_argument("--config", default=None,
                   help=f"the dataset's config (default: the profile's, e.g. sft for CodeV-R1, which a copy of the "
                        f"repository needs too; a single file has none; '{data.NO_CONFIG}' for a source without configs)")


def cmd_setup(args) -> int:
    """Step 00: versions, devices, profile, course map and the profile's memory estimate."""
    if args.check:  # workshop: is this machine ready? one screen, a fix per item (gemma_tpu_helpers.course.workshop)

        return workshop.main_check(args)
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
    text = base_model.profile_text_config(prof)
    est = plan.memory_estimate(prof, text)
    print(f"params: {est['params']:,}  LoRA: {est['lora_params']:,} ({est['trainable_pct']:.2f}% trainable)")
    print(plan.memory_table(est).to_string(index=False))
    print(logbook.course_map().drop(columns=["helpers"]).to_string(index=False))
    if failed:
        raise preflight.PreflightError(f"pre-flight failed ({', '.join(failed)}): each FAIL line above says what "
                                       f"to do.")
    return 0


def cmd_tiny_model(args) -> int:
    """Write the tiny Gemma 4 checkpoint (31B structure, real on-disk layout, trained tokenizer)."""
    out = tiny.write_tiny_model(args.out_dir, seed=args.seed, layers=args.layers, overwrite=args.overwrite,
                                variant=args.variant)
    shards = sorted(p.name for p in Path(out).glob("*.safetensors"))
    print(f"wrote {out}: {len(shards)} safetensors shards + index, config, generation config, tokenizer")
    return 0


def cmd_parity(args) -> int:
    """tunix vs transformers logits (and, with --layers, hidden states per layer) on a checkpoint."""
    prof = profiles.configure_jax(args.profile)
    preflight.require(prof)

    mesh = prof.make_mesh()
    model = load_model(args.model_dir, mesh, dtype="float32")
    stats = parity.compare_logits(args.model_dir, mesh, seq_len=args.seq_len, model=model)
    print(f"max |dlogit|: {stats['max_abs']:.3e}  logit scale: {stats['scale']:.3f}  relative: {stats['rel']:.3e}"
          f"  (bound {args.bound:.0e})")
    if args.layers:
        print(parity.compare_layers(args.model_dir, mesh, seq_len=args.seq_len, model=model).to_string(index=False))
    ok = stats["rel"] <= args.bound
    print("parity: OK" if ok else "parity: FAILED")
    return 0 if ok else 1


def cmd_mesh(args) -> int:
    """Step 01: the profile's mesh, the tp sizes the model allows, and the trainer mesh-context probe."""
    prof = profiles.configure_jax(args.profile)
    preflight.require(prof)  # a TPU profile needs its TPU, free; checked before JAX is imported

    mesh = prof.make_mesh()
    print(f"mesh {dict(mesh.shape)}:\n{mesh_lib.describe(mesh).to_string()}")
    text = base_model.profile_text_config(prof) if prof.model.source != "tiny" else gemma4.read_text_config(base_model.ensure_base(prof))
    print(mesh_lib.tp_table(text).to_string(index=False))
    if args.probe:
        print(mesh_lib.compare_trainer_contexts(base_model.ensure_check_model(prof), mesh).to_string(index=False))
    return 0


def cmd_report(args) -> int:
    """Write runs/<profile>/report.md from the figures the notebooks recorded."""
    prof = profiles.get_profile(args.profile)
    print(logbook.write_report(prof.run_dir(args.runs)))
    return 0


def cmd_demo(args) -> int:
    """Run every notebook in order under the profile; executed copies and report.md go to runs/<profile>/."""
    prof = profiles.get_profile(args.profile)
    run_dir = prof.run_dir(args.runs)
    results = logbook.run_notebooks(prof.name, run_dir)
    for r in results:
        print(f"{r['notebook']:28s} {r['seconds']:7.1f} s  {r['error'] or 'ok'}")
    print(logbook.write_report(run_dir))
    return 1 if any(r["error"] for r in results) else 0


def cmd_lora(args) -> int:
    """Step 02: which tunix module gets LoRA for each HF target, per layer."""
    prof = profiles.configure_jax(args.profile)
    preflight.require(prof)  # the TPU profiles load the real model on the chips (after downloading it)

    report = profile_steps.lora_report(prof, regex=args.regex)
    print(report.to_string(index=False))
    if report.attrs.get("experts"):  # an MoE: where most of its parameters are, and that LoRA does not reach them
        print(report.attrs["experts"])
    return 0


def cmd_sharding(args) -> int:
    """Step 03: per-device bytes, audit flags and the fix plan for the profile's model on its mesh."""
    prof = profiles.configure_jax(args.profile)

    summary, _, changes = profile_steps.sharding_plan(prof)
    print((summary / 2**30).round(3).to_string())
    print(changes.to_string(index=False) if len(changes) else "no changes needed")
    return 0


def cmd_plan(args) -> int:
    """Step 04: per-chip memory plan; --aot: XLA's compiled figures for the profile's TPU topology (libtpu, no TPU)."""
    return plan.main_plan(args.profile, args.aot, args.remat, args.seq_len, args.layers, args.qlora)


def cmd_data_stats(args) -> int:
    """Step 05: packed vs pad-to-max token use for the profile's data."""
    prof = profiles.get_profile(args.profile)
    tokenizer_dir = base_model.ensure_tokenizer(prof, base=args.base)  # the tokenizer files alone, never the weights
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    spec = data.with_source(prof.data, args.source, args.config)
    if args.show_example is not None:  # one example as it is trained: the loss span inside ⟦ ⟧
        view = data.show_row(spec, tokenizer, args.show_example)
        print(view["text"])
        print(f"\n{view['tokens']} tokens: {view['prompt_tokens']} of prompt (no loss), "
              f"{view['trained_tokens']} trained (inside {''.join(data.TRAINED_MARKS)})")
        return 0
    prepared = data.prepare(spec, tokenizer, prof.train.max_seq_len, prof.train.seed, progress=False)
    padded = data.pad_to_max([(np.zeros(n, np.int32), np.zeros(n, np.int8)) for n in prepared.lengths],
                             prof.train.max_seq_len, prof.data.overlong)
    s = prepared.train.stats
    print(f"examples: {s['examples']} (kept {s['kept']}, dropped {s['dropped']}, trimmed {s['trimmed']}; "
          f"max_seq_len {prof.train.max_seq_len}, overlong={prof.data.overlong})")
    print(f"packed rows: {s['rows']}  pad-to-max rows: {padded.stats['rows']}")
    print(f"packed token use: {100 * s['token_use']:.1f}%")
    print(f"pad-to-max token use: {100 * padded.stats['token_use']:.1f}%")
    return 0


def cmd_train(args) -> int:
    """Step 06: LoRA training with checkpoints; resumes from the latest checkpoint in the run dir."""
    prof = profiles.configure_jax(args.profile)
    preflight.require(prof)

    if args.coordinator:
        local = None
        if prof.hardware.platform == "cpu" and args.coordinator != "auto":
            n = args.num_processes or 1
            if prof.hardware.num_devices % n:
                raise multihost.MultihostError(f"profile {prof.name!r} has {prof.hardware.num_devices} devices, "
                                               f"which do not divide into {n} processes.")
            local = prof.hardware.num_devices // n
        multihost.initialize(args.coordinator, args.num_processes, args.process_id, local_devices=local,
                             timeout_s=args.join_timeout)

    prof = dataclasses.replace(prof, data=data.with_source(prof.data, args.source, args.config))
    result = train.train(prof, run_dir=args.run_dir, base_dir=args.base, max_steps=args.max_steps,
                         checkpoint_every=args.checkpoint_every)
    if not multihost.is_main():
        return 0
    m = result.metrics.dropna(subset=["loss"])
    plot = result.checkpoint_dir.parent / "train" / "loss.png"
    train.plot_loss(result.metrics, plot)
    print(f"trained steps {result.start_step}..{result.total_steps} in {result.seconds:.1f} s; "
          f"loss {m['loss'].iloc[0]:.4f} -> {m['loss'].iloc[-1]:.4f}; checkpoints in {result.checkpoint_dir}; "
          f"loss curve {plot}")
    return 0


def cmd_launch(args) -> int:
    """Multi-host: print (or --run) the commands that run a step on every worker of a TPU pod (or local workers)."""
    step = args.step[1:] if args.step[:1] == ["--"] else args.step
    env = dict(kv.split("=", 1) for kv in args.env)
    commands = launch.launch_commands(args.workers, step, tpu=args.tpu, zone=args.zone,
                                         coordinator=args.coordinator, workdir=args.workdir,
                                         python=args.python or (sys.executable if not args.tpu else ".venv/bin/python"),
                                         env=env)
    print(launch.format_commands(commands), flush=True)
    return launch.run_commands(commands, timeout_s=args.timeout, wait_on=(PREEMPTED_EXIT,)) if args.run else 0


def cmd_eval(args) -> int:
    """Step 09: VerilogEval-style pass@k with iverilog (from a server or a completions file)."""
    return commands.main_eval(args)


def cmd_cost(args) -> int:
    """Step 10: TPU-vs-GPU training cost and $ per million output tokens."""
    return cost.main_cost(args)


class OneLineParser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (``error: ...``, exit 2), as every other bad input here. Its
    sub-command parsers are of this class too."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m gemma_tpu_helpers",
                       description="gemma-tpu course steps. Each sub-command is what a notebook calls.")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="STEP")

    p = sub.add_parser("setup", help="00: versions, devices, profile, course map, memory estimate")
    _profile_arg(p)
    p.add_argument("--check", action="store_true",
                   help="workshop readiness: venvs, iverilog, devices, free RAM and disk, the model, a fix for each")
    p.add_argument("--serve", action="store_true", help="with --check: also start the vLLM server once (60-100 s)")
    p.add_argument("--runs", type=cli_path, default=None, help="with --check: runs root (default ./runs)")
    p.set_defaults(func=cmd_setup)

    p = sub.add_parser("tiny-model", help="00: write the tiny random Gemma 4 checkpoint + tokenizer")
    p.add_argument("out_dir", type=cli_path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None,
                   help="number of decoder layers; must be a multiple of 6 (5 sliding + 1 global) for 31b, "
                        "26b-a4b and e4b, of 5 (4 + 1) for e2b (default 6 / 6 / 10 / 12 for 31b / 26b-a4b / e2b / "
                        "e4b)")
    p.add_argument("--variant", choices=("31b", "26b-a4b", "e2b", "e4b"), default="31b",
                   help="which real Gemma 4 -it checkpoint to replicate (26b-a4b: the mixture of experts; e2b/e4b: "
                        "per-layer embeddings, KV-shared layers, audio tower, the E chat template)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint in OUT_DIR")
    p.set_defaults(func=cmd_tiny_model)

    p = sub.add_parser("parity", help="00: tunix vs transformers logits on a checkpoint")
    p.add_argument("model_dir", type=cli_path)
    _profile_arg(p)
    p.add_argument("--seq-len", type=int, default=40)
    p.add_argument("--bound", type=float, default=1e-4, help="max |dlogit| / max |logit| allowed")
    p.add_argument("--layers", action="store_true", help="also compare hidden states after each decoder layer")
    p.set_defaults(func=cmd_parity)

    p = sub.add_parser("mesh", help="01: the mesh, valid tp sizes, and the trainer mesh-context probe")
    _profile_arg(p)
    p.add_argument("--probe", action="store_true", help="run one trainer step under each mesh context")
    p.set_defaults(func=cmd_mesh)

    p = sub.add_parser("lora", help="02: LoRA coverage report (HF target names -> tunix modules, per layer)")
    _profile_arg(p)
    p.add_argument("--regex", default=None, help="report a raw qwix regex instead (e.g. the paper's)")
    p.set_defaults(func=cmd_lora)

    p = sub.add_parser("sharding", help="03: sharding audit and fix plan for the profile (abstract shapes, no weights)")
    _profile_arg(p)
    p.set_defaults(func=cmd_sharding)

    p = sub.add_parser("plan", help="04: per-chip memory plan (--aot: XLA's AOT-compiled figures, no TPU needed)")
    _profile_arg(p)
    p.add_argument("--aot", action="store_true", help="AOT-compile the LoRA train step for the profile's TPU topology (needs libtpu)")
    p.add_argument("--remat", default=None, help="none | block | decoder (default: the profile's)")
    p.add_argument("--seq-len", type=int, default=None, help="default: the profile's max_seq_len")
    p.add_argument("--layers", type=int, default=None,
                   help="compile exactly N layers (60 = the full 31B, for make bench); default: 6 and 12, extrapolated")
    p.add_argument("--qlora", default=None, choices=["nf4"],
                   help="compile the QLoRA step (frozen targeted weights in nf4) instead of the profile's plain LoRA")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("data-stats", help="05: packed vs pad-to-max token use for the profile's data")
    _profile_arg(p)
    _data_source_args(p)
    p.add_argument("--base", type=cli_path, default=None, help="checkpoint dir whose tokenizer to use (default: the profile's base)")
    p.add_argument("--show-example", type=int, default=None, metavar="N",
                   help="print example N as it is trained (the loss span marked) instead of the statistics")
    p.set_defaults(func=cmd_data_stats)

    p = sub.add_parser("train", help="06: LoRA training with Orbax checkpoints; resumes automatically",
                       epilog=f"Spot TPUs: on SIGTERM (the preemption notice) training ends the step it is in, "
                              f"every worker saves a checkpoint of that same step, and the command exits "
                              f"{PREEMPTED_EXIT}; run it again to resume from that step.")
    _profile_arg(p)
    p.add_argument("--run-dir", type=cli_path_or_gs, default=None, help="run directory (default runs/<profile>), or gs://BUCKET/PATH")
    p.add_argument("--base", type=cli_path, default=None, help="base checkpoint dir (default: the profile's, built or downloaded)")
    p.add_argument("--max-steps", type=int, default=None, help="override the profile's max_steps")
    p.add_argument("--checkpoint-every", type=int, default=None, help="override the profile's checkpoint interval")
    _data_source_args(p)
    g = p.add_argument_group("multi-host (every worker runs the same command; see `launch`)")
    g.add_argument("--coordinator", default=None,
                   help="process 0's HOST:PORT (PORT+1 is used too), or 'auto' on a TPU pod (JAX detects the workers)")
    g.add_argument("--num-processes", type=int, default=None, help="how many processes join (with HOST:PORT)")
    g.add_argument("--process-id", type=int, default=None, help="this process's id, 0..N-1 (with HOST:PORT)")
    g.add_argument("--join-timeout", type=float, default=120, help="seconds to wait for all processes to join")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("launch", help="multi-host: print (or --run) the per-worker commands of a step on a TPU pod",
                       description="Example: launch --workers 4 --tpu my-v5p-32 --zone us-east5-a -- train --profile v5p-8")
    p.add_argument("--workers", type=int, required=True, help="number of hosts (TPU VM workers)")
    p.add_argument("--tpu", default=None, help="TPU VM name: one `gcloud compute tpus tpu-vm ssh --worker=all` line")
    p.add_argument("--zone", default=None, help="the TPU VM's zone (with --tpu)")
    p.add_argument("--coordinator", default="127.0.0.1:8476",
                   help="without --tpu: process 0's HOST:PORT (PORT and PORT+1 must be free there)")
    p.add_argument("--workdir", default="gemma-tpu", help="with --tpu: the checkout's directory on every worker")
    p.add_argument("--python", default=None, help="python to run (default: .venv/bin/python on a TPU, this one here)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment for the workers")
    p.add_argument("--run", action="store_true", help="run the commands (default: print them)")
    p.add_argument("--timeout", type=float, default=None, help="with --run: stop all workers after this many seconds")
    p.add_argument("step", nargs=argparse.REMAINDER, help="-- STEP ARGS...: the course step to run")
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("merge", help="07: merge the trained LoRA (Orbax) into the base's sharded safetensors, streamed")
    commands.add_merge_arguments(p)
    p.set_defaults(func=commands.main_merge)

    p = sub.add_parser("verify", help="07: merged model vs base + LoRA: every tensor (streamed), then the logits "
                       "(--weights: the tensors alone, any model size)")
    commands.add_verify_arguments(p)
    p.set_defaults(func=commands.main_verify)

    p = sub.add_parser("export-adapter", help="07: the trained LoRA as an unmerged PEFT adapter (vLLM --enable-lora)")
    commands.add_export_arguments(p)
    p.set_defaults(func=commands.main_export_adapter)

    p = sub.add_parser("serve", help="08: serve a checkpoint with vLLM (CPU build here; on TPU the docker line, or on Colab the pip route)")
    commands.add_serve_arguments(p)
    p.set_defaults(func=commands.main_serve)

    p = sub.add_parser("eval", help="09: VerilogEval-style pass@k with iverilog (--url server or --completions file)")
    commands.add_eval_arguments(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("learn", help="06/09: the learning check: train on K eval problems, merge, serve, score "
                       "pass@1 before and after")
    commands.add_learn_arguments(p)
    p.set_defaults(func=commands.main_learn)

    p = sub.add_parser("cost", help="10: TPU-vs-GPU training cost ratio and $ per million output tokens")
    cost.add_arguments(p)
    p.set_defaults(func=cmd_cost)

    p = sub.add_parser("bench", help="10: vllm bench serve QPS sweep (TTFT/TPOT/throughput vs QPS per input length)")
    serving_bench.add_arguments(p)
    p.set_defaults(func=serving_bench.main_bench)

    p = sub.add_parser("solutions", help="workshop: the exercises' tasks and solutions, for teachers (e.g. solutions 02)")
    exercises.add_arguments(p)
    p.set_defaults(func=exercises.main_solutions)

    p = sub.add_parser("site", help="the course site: executed notebooks as HTML + an index, in runs/<profile>/site")
    site.add_arguments(p)
    p.set_defaults(func=site.main_site)

    p = sub.add_parser("demo", help="run all notebooks in order (executed copies + report.md in runs/<profile>/)")
    _profile_arg(p)
    p.add_argument("--runs", type=cli_path, default=None, help="runs root (default ./runs)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("report", help="write runs/<profile>/report.md from the recorded figures")
    _profile_arg(p)
    p.add_argument("--runs", type=cli_path, default=None, help="runs root (default ./runs)")
    p.set_defaults(func=cmd_report)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
