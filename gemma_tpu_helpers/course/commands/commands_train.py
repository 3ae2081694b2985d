"""The training steps (notebooks 06-07): train, launch, merge, verify, export-adapter. Where a step takes
``--profile``, the profile's run directory and mesh become the plain arguments the fix takes."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ...fixes.export import merge, peft_export, verify, weight_check
from ...fixes.train import data, multihost
from ...fixes.train.preemption import PREEMPTED_EXIT
from ..config import profiles
from ..front import preflight
from ..training import launch, profile_steps, train
from .cli import (
    Command,
    cli_path,
    cli_path_or_gs,
    data_source_arguments,
    flags_note,
    non_negative_int,
    positive_int,
    positive_seconds,
    profile_argument,
)

SHOWN_PROBLEMS = 8

# ---------------------------------------------------------------------------------------------------------- train

TRAIN_EPILOG = (f"Spot TPUs: on SIGTERM (the preemption notice) training ends the step it is in, every worker saves "
                f"a checkpoint of that same step, and the command exits {PREEMPTED_EXIT}; run it again to resume from "
                f"that step.")


def train_arguments(p) -> None:
    profile_argument(p)
    p.add_argument("--run-dir", type=cli_path_or_gs, default=None,
                   help="run directory (default runs/<profile>), or gs://BUCKET/PATH")
    p.add_argument("--base", type=cli_path, default=None,
                   help="base checkpoint dir (default: the profile's, built or downloaded)")
    p.add_argument("--max-steps", type=positive_int, default=None, help="override the profile's max_steps")
    p.add_argument("--stop-after", type=positive_int, default=None, metavar="STEP",
                   help="a first run: stop after this step of the full run, saved; the same command without it "
                        "resumes (the schedule stays the full run's)")
    p.add_argument("--max-seq-len", type=positive_int, default=None,
                   help="override the profile's max_seq_len: tokens per row (longer examples are dropped, or trimmed "
                        "if the profile says so)")
    p.add_argument("--checkpoint-every", type=positive_int, default=None,
                   help="override the profile's checkpoint interval")
    data_source_arguments(p)
    p.add_argument("--no-experts", action="store_true",
                   help="MoE profiles: LoRA on attention and the dense MLP only, the routed experts untrained")
    g = p.add_argument_group("multi-host (every worker runs the same command; see `launch`)")
    g.add_argument("--coordinator", default=None,
                   help="process 0's HOST:PORT (PORT+1 is used too), or 'auto' on a TPU pod (JAX detects the workers)")
    g.add_argument("--num-processes", type=positive_int, default=None, help="how many processes join (with HOST:PORT)")
    g.add_argument("--process-id", type=non_negative_int, default=None,
                   help="this process's id, 0..N-1 (with HOST:PORT)")
    g.add_argument("--join-timeout", type=positive_seconds, default=120,
                   help="seconds to wait for all processes to join")


def _join(prof, args) -> None:
    local = None
    if prof.hardware.platform == "cpu" and args.coordinator != "auto":
        n = args.num_processes or 1
        if prof.hardware.num_devices % n:
            raise multihost.MultihostError(f"profile {prof.name!r} has {prof.hardware.num_devices} devices, "
                                           f"which do not divide into {n} processes.")
        local = prof.hardware.num_devices // n
    multihost.initialize(args.coordinator, args.num_processes, args.process_id, local_devices=local,
                         timeout_s=args.join_timeout)


def run_train(args) -> int:
    """Step 06: LoRA training with checkpoints; resumes from the latest checkpoint in the run dir."""
    prof = profiles.configure_jax(args.profile)
    preflight.require(prof)
    if args.coordinator:
        _join(prof, args)
    prof = dataclasses.replace(prof, data=data.with_source(prof.data, args.source, args.config))
    if args.max_seq_len:
        prof = dataclasses.replace(prof, train=dataclasses.replace(prof.train, max_seq_len=args.max_seq_len))
    if args.no_experts:
        prof = profile_steps.without_experts(prof)
    result = train.train(prof, run_dir=args.run_dir, base_dir=args.base, max_steps=args.max_steps,
                         checkpoint_every=args.checkpoint_every, stop_after=args.stop_after)
    if not multihost.is_main():
        return 0
    m = result.metrics.dropna(subset=["loss"])
    plot = result.checkpoint_dir.parent / "train" / "loss.png"
    train.plot_loss(result.metrics, plot)
    end = result.stopped_at if result.stopped_at is not None else result.total_steps
    print(f"trained steps {result.start_step}..{end} in {result.seconds:.1f} s; "
          f"loss {m['loss'].iloc[0]:.4f} -> {m['loss'].iloc[-1]:.4f}; checkpoints in {result.checkpoint_dir}; "
          f"loss curve {plot}")
    if result.stopped_at is not None:
        print(f"stopped after step {result.stopped_at} of {result.total_steps} as asked (--stop-after): the same "
              f"command without --stop-after resumes from step {result.stopped_at}")
    return 0


# --------------------------------------------------------------------------------------------------------- launch

def launch_arguments(p) -> None:
    p.add_argument("--workers", type=positive_int, required=True, help="number of hosts (TPU VM workers)")
    p.add_argument("--tpu", default=None, help="TPU VM name: one `gcloud compute tpus tpu-vm ssh --worker=all` line")
    p.add_argument("--zone", default=None, help="the TPU VM's zone (with --tpu)")
    p.add_argument("--coordinator", default="127.0.0.1:8476",
                   help="without --tpu: process 0's HOST:PORT (PORT and PORT+1 must be free there)")
    p.add_argument("--workdir", default="gemma-tpu", help="with --tpu: the checkout's directory on every worker")
    p.add_argument("--python", default=None, help="python to run (default: .venv/bin/python on a TPU, this one here)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment for the workers")
    p.add_argument("--run", action="store_true", help="run the commands (default: print them)")
    p.add_argument("--timeout", type=positive_seconds, default=None,
                   help="with --run: stop all workers after this many seconds")
    p.add_argument("step", nargs=argparse.REMAINDER, help="-- STEP ARGS...: the course step to run")


def run_launch(args) -> int:
    """Multi-host: print (or --run) the commands that run a step on every worker of a TPU pod (or local workers)."""
    step = args.step[1:] if args.step[:1] == ["--"] else args.step
    env = dict(kv.split("=", 1) for kv in args.env)
    commands = launch.launch_commands(args.workers, step, tpu=args.tpu, zone=args.zone,
                                      coordinator=args.coordinator, workdir=args.workdir,
                                      python=args.python or (sys.executable if not args.tpu else ".venv/bin/python"),
                                      env=env)
    print(launch.format_commands(commands), flush=True)
    return launch.run_commands(commands, timeout_s=args.timeout, wait_on=(PREEMPTED_EXIT,)) if args.run else 0


# ---------------------------------------------------------------------------------------------------------- merge

def merge_arguments(p) -> None:
    p.add_argument("--profile", default=None,
                   help="take --base, --checkpoint and --out from the profile's run directory (runs/<profile>/base, "
                        "checkpoints, merged) where they are not given")
    p.add_argument("--base", type=cli_path, default=None,
                   help="base HF checkpoint directory (config, shards, index, tokenizer)")
    p.add_argument("--checkpoint", type=cli_path_or_gs, default=None, help="the run's Orbax `checkpoints` directory")
    p.add_argument("--step", type=non_negative_int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--out", type=cli_path, default=None, help="output directory (written atomically)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--no-fold-expert-scale", dest="fold_expert_scale", action="store_false",
                   help="MoE: keep per_expert_scale in the router instead of folding it into each expert's down_proj "
                        "(tpu-inference never applies it: a TPU server would then give other logits)")


def merge_paths(args) -> tuple[Path, Path, Path]:
    """``(base, checkpoint, out)`` of the merge command: as given, else from ``--profile``'s run directory."""
    if args.profile is None and None in (args.base, args.checkpoint, args.out):
        raise merge.MergeError("merge needs --base, --checkpoint and --out, or --profile NAME to take them "
                               "from runs/<profile>/ (base, checkpoints, merged).")
    run = profiles.resolve_run(profiles.get_profile(args.profile)) if args.profile else None  # local: base, merged
    return (args.base or run.local / "base", args.checkpoint or run.checkpoints, args.out or run.local / "merged")


def run_merge(args) -> int:
    """Step 07: merge the trained LoRA (Orbax) into the base's sharded safetensors, streamed."""
    base, checkpoint, out = merge_paths(args)
    r = merge.merge_lora(base, checkpoint, out, step=args.step, overwrite=args.overwrite,
                         fold_expert_scale=args.fold_expert_scale)
    folded = ", per_expert_scale folded into down_proj" if r.info.get("fold_expert_scale") else ""
    print(f"merged step {r.step}: {r.merged_tensors} tensors with LoRA, {r.copied_tensors} copied, {r.shards} shards, "
          f"{r.bytes / 1e9:.3f} GB in {r.seconds:.1f} s{folded} -> {r.out_dir}")
    return 0


# --------------------------------------------------------------------------------------------------------- verify

def verify_arguments(p) -> None:
    p.add_argument("--base", type=cli_path, required=True, help="the base HF checkpoint directory")
    p.add_argument("--checkpoint", type=cli_path_or_gs, required=True, help="the run's Orbax `checkpoints` directory")
    p.add_argument("--merged", type=cli_path, required=True, help="the merged checkpoint directory")
    p.add_argument("--step", type=non_negative_int, default=None)
    p.add_argument("--seq-len", type=positive_int, default=40)
    p.add_argument("--profile", default=None, help="JAX devices/mesh profile (default: smoke)")
    p.add_argument("--weights", action="store_true",
                   help="the streamed weight check alone, without the logits: every tensor against base + ΔW of "
                        "the LoRA, one at a time, on the host (any model size, the 31B included; no accelerator)")


def run_verify(args) -> int:
    """Step 07: the merged model against base + LoRA, every tensor and then the logits (--weights: the tensors)."""
    if args.weights:
        return _verify_weights(args)
    prof = profiles.configure_jax(args.profile or "smoke")
    res = verify.verify_merge(args.base, args.checkpoint, args.merged, step=args.step, mesh=prof.make_mesh(),
                              seq_len=args.seq_len)
    w = res.weights
    print(f"weights: {w.merged_tensors} merged tensors within rounding of base + ΔW (at most {w.max_ulps} ulp), "
          f"{w.copied_tensors} copied byte for byte" if w.ok else f"weights: {len(w.problems)} problem(s)")
    for problem in w.problems[:SHOWN_PROBLEMS]:
        print(f"FAILED: {problem}")
    if w.params:
        print(f"note:{flags_note(w.params)}")
    for r in res.rows:
        b = f"(bound {r.bound:.1e}: {res.bound_rule})" if r.bound else ""
        print(f"{r.comparison:50s} max |dlogit| {r.max_abs:.3e}  scale {r.scale:.3f}  relative {r.rel:.3e} {b}")
    for note in res.notes:
        print(f"note: {note}")
    print("verify: OK" if res.ok else "verify: FAILED")
    return 0 if res.ok else 1


def _folded(res: weight_check.WeightCheck) -> str:
    """The MoE merge's fold, as the weight check saw it (nothing for a model without per_expert_scale)."""
    if not res.ones_tensors:
        return ""
    alone = f" ({res.folded_tensors} down_proj scaled without a LoRA)" if res.folded_tensors else ""
    return f", {res.ones_tensors} per_expert_scale folded into down_proj and checked as ones{alone}"


def _verify_weights(args) -> int:
    profiles.configure_jax(args.profile or "smoke")  # Orbax imports JAX: the host CPU, no accelerator wanted
    res = weight_check.verify_weights(args.base, args.checkpoint, args.merged, step=args.step)
    print(f"step {res.step}: {res.merged_tensors} merged tensors vs base + ΔW (at most {res.max_ulps} ulp; "
          f"{res.max_excess:.2f} of the allowed rounding; {res.changed_share:.0%} of their elements changed), "
          f"{res.copied_tensors} copied{_folded(res)}; {res.bytes / 1e9:.2f} GB checked in {res.seconds:.1f} s")
    worst = weight_check.worst_tensors(res, 5)
    if worst:
        import pandas as pd

        print(pd.DataFrame(worst).drop(columns="worst_at").to_string(index=False))
    for note in res.notes:
        print(f"note: {note}")
    for problem in res.problems[:SHOWN_PROBLEMS]:
        print(f"FAILED: {problem}")
    if len(res.problems) > SHOWN_PROBLEMS:
        print(f"FAILED: ... and {len(res.problems) - SHOWN_PROBLEMS} more")
    if res.params:
        print(f"note:{flags_note(res.params)}")
    print("verify --weights: OK" if res.ok else f"verify --weights: FAILED ({len(res.problems)} problem(s))")
    return 0 if res.ok else 1


# ------------------------------------------------------------------------------------------------- export-adapter

def export_adapter_arguments(p) -> None:
    p.add_argument("--base", type=cli_path, required=True, help="the base HF checkpoint directory")
    p.add_argument("--checkpoint", type=cli_path_or_gs, required=True, help="the run's Orbax `checkpoints` directory")
    p.add_argument("--step", type=non_negative_int, default=None)
    p.add_argument("--out", type=cli_path, required=True, help="the adapter directory to write")
    p.add_argument("--overwrite", action="store_true")


def run_export_adapter(args) -> int:
    """Step 07: the trained LoRA as an unmerged PEFT adapter."""
    out = peft_export.export_peft_adapter(args.checkpoint, args.out, args.base, step=args.step,
                                          overwrite=args.overwrite)
    print(f"wrote PEFT adapter {out}")
    return 0


COMMANDS = (
    Command("train", "06: LoRA training with Orbax checkpoints; resumes automatically", train_arguments, run_train,
            epilog=TRAIN_EPILOG),
    Command("launch", "multi-host: print (or --run) the per-worker commands of a step on a TPU pod",
            launch_arguments, run_launch,
            description="Example: launch --workers 4 --tpu my-v5p-32 --zone us-east5-a -- train --profile v5p-8"),
    Command("merge", "07: merge the trained LoRA (Orbax) into the base's sharded safetensors, streamed",
            merge_arguments, run_merge),
    Command("verify", "07: merged model vs base + LoRA: every tensor (streamed), then the logits "
            "(--weights: the tensors alone, any model size)", verify_arguments, run_verify),
    Command("export-adapter", "07: the trained LoRA as an unmerged PEFT adapter (for PEFT; serve the merged "
            "weights with vLLM)", export_adapter_arguments, run_export_adapter),
)
