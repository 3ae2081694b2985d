"""The fixes' command-line steps, wired in ``__main__.py``: where a step takes ``--profile``, the profile's run
directory and mesh become the plain arguments the fix takes."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from ..fixes import (eval_problems, eval_sample, eval_score, eval_simulate, http_client, merge, peft_export, verify,
                     vllm_command, vllm_server, weight_check)
from ..fixes.file_io import cli_path, cli_path_or_gs
from . import learning_check, paths, preflight, profiles

# ---------------------------------------------------------------------------------------------------------------
# merge

def add_merge_arguments(p) -> None:
    p.add_argument("--profile", default=None,
                   help="take --base, --checkpoint and --out from the profile's run directory (runs/<profile>/base, "
                        "checkpoints, merged) where they are not given")
    p.add_argument("--base", type=cli_path, default=None,
                   help="base HF checkpoint directory (config, shards, index, tokenizer)")
    p.add_argument("--checkpoint", type=cli_path_or_gs, default=None, help="the run's Orbax `checkpoints` directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--out", type=cli_path, default=None, help="output directory (written atomically)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")


def merge_paths(args) -> tuple[Path, Path, Path]:
    """``(base, checkpoint, out)`` of the merge command: as given, else from ``--profile``'s run directory."""
    if args.profile is None and None in (args.base, args.checkpoint, args.out):
        raise merge.MergeError("merge needs --base, --checkpoint and --out, or --profile NAME to take them "
                               "from runs/<profile>/ (base, checkpoints, merged).")
    prof = profiles.get_profile(args.profile) if args.profile else None
    run_dir, local = (prof.run_dir(), prof.local_dir()) if prof else (None, None)  # local: base, merged
    return (args.base or local / "base", args.checkpoint or run_dir / "checkpoints", args.out or local / "merged")


def main_merge(args) -> int:
    base, checkpoint, out = merge_paths(args)
    r = merge.merge_lora(base, checkpoint, out, step=args.step, overwrite=args.overwrite)
    print(f"merged step {r.step}: {r.merged_tensors} tensors with LoRA, {r.copied_tensors} copied, {r.shards} shards, "
          f"{r.bytes / 1e9:.3f} GB in {r.seconds:.1f} s -> {r.out_dir}")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# verify

def add_verify_arguments(p) -> None:
    p.add_argument("--base", type=cli_path, required=True, help="the base HF checkpoint directory")
    p.add_argument("--checkpoint", type=cli_path_or_gs, required=True, help="the run's Orbax `checkpoints` directory")
    p.add_argument("--merged", type=cli_path, required=True, help="the merged checkpoint directory")
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=40)
    p.add_argument("--profile", default=None, help="JAX devices/mesh profile (default: smoke)")
    p.add_argument("--weights", action="store_true",
                   help="the streamed weight check alone, without the logits: every tensor against base + ΔW of "
                        "the LoRA, one at a time, on the host (any model size, the 31B included; no accelerator)")


SHOWN_PROBLEMS = 8


def main_verify(args) -> int:
    if args.weights:
        return main_verify_weights(args)
    prof = profiles.configure_jax(args.profile or "smoke")
    res = verify.verify_merge(args.base, args.checkpoint, args.merged, step=args.step, mesh=prof.make_mesh(),
                 seq_len=args.seq_len)
    w = res["weights"]
    print(f"weights: {w['merged_tensors']} merged tensors within rounding of base + ΔW (at most {w['max_ulps']} ulp), "
          f"{w['copied_tensors']} copied byte for byte" if w["ok"] else f"weights: {len(w['problems'])} problem(s)")
    for problem in w["problems"][:SHOWN_PROBLEMS]:
        print(f"FAILED: {problem}")
    for r in res["rows"]:
        b = f"(bound {r['bound']:.1e}: {res['bound_rule']})" if r["bound"] else ""
        print(f"{r['comparison']:50s} max |dlogit| {r['max_abs']:.3e}  scale {r['scale']:.3f}  "
              f"relative {r['rel']:.3e} {b}")
    for note in res["notes"]:
        print(f"note: {note}")
    print("verify: OK" if res["ok"] else "verify: FAILED")
    return 0 if res["ok"] else 1


def main_verify_weights(args) -> int:
    profiles.configure_jax(args.profile or "smoke")  # Orbax imports JAX: the host CPU, no accelerator wanted
    res = weight_check.verify_weights(args.base, args.checkpoint, args.merged, step=args.step)
    print(f"step {res['step']}: {res['merged_tensors']} merged tensors vs base + ΔW (at most {res['max_ulps']} ulp; "
          f"{res['max_excess']:.2f} of the allowed rounding; {res['changed_share']:.0%} of their elements changed), "
          f"{res['copied_tensors']} copied; "
          f"{res['bytes'] / 1e9:.2f} GB checked in {res['seconds']:.1f} s")
    table = weight_check.worst_tensors(res, 5)
    if len(table):
        print(table.to_string(index=False))
    for note in res["notes"]:
        print(f"note: {note}")
    for problem in res["problems"][:SHOWN_PROBLEMS]:
        print(f"FAILED: {problem}")
    if len(res["problems"]) > SHOWN_PROBLEMS:
        print(f"FAILED: ... and {len(res['problems']) - SHOWN_PROBLEMS} more")
    print("verify --weights: OK" if res["ok"] else f"verify --weights: FAILED ({len(res['problems'])} problem(s))")
    return 0 if res["ok"] else 1


# ---------------------------------------------------------------------------------------------------------------
# export-adapter

def add_export_arguments(p) -> None:
    p.add_argument("--base", type=cli_path, required=True, help="the base HF checkpoint directory")
    p.add_argument("--checkpoint", type=cli_path_or_gs, required=True, help="the run's Orbax `checkpoints` directory")
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--out", type=cli_path, required=True, help="the adapter directory to write")
    p.add_argument("--overwrite", action="store_true")



def main_export_adapter(args) -> int:
    out = peft_export.export_peft_adapter(args.checkpoint, args.out, args.base, step=args.step, overwrite=args.overwrite)
    print(f"wrote PEFT adapter {out}")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# eval

def _parse_ks(text) -> list[int]:
    if isinstance(text, (list, tuple)):
        return [int(k) for k in text]
    try:
        ks = [int(k) for k in str(text).split(",") if k.strip()]
    except ValueError:
        raise eval_problems.EvalError(f"--k takes comma-separated integers such as 1,5 (got {text!r})") from None
    if not ks or any(k < 1 for k in ks):
        raise eval_problems.EvalError(f"--k takes positive integers such as 1,5 (got {text!r})")
    return ks


def add_eval_arguments(p) -> None:
    """The ``eval`` sub-command's arguments."""
    p.add_argument("--problems", type=cli_path, default=None,
                   help="folder in the VerilogEval v2 layout (default: the 28 shipped problems)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000 (vLLM)")
    src.add_argument("--completions", type=cli_path, help="JSONL with task_id and completion per line (a results file works too)")
    src.add_argument("--calibrate", action="store_true",
                     help="score every reference as a completion: the toolchain's ceiling on --problems, cached in "
                          "RUN_DIR/eval per (problems, iverilog version) and used by later scores on them")
    p.add_argument("--model", help="model name on the server (with --url)")
    p.add_argument("--preset", choices=sorted(eval_sample.PRESETS), default=None,
                   help="VerilogEval v2's protocol: official-greedy = n 1, temperature 0, top-p 0.01; "
                        "official-sampled = n 20, temperature 0.85, top-p 0.95; both top-k 0 = none "
                        "(with --url; --k defaults to 1)")
    p.add_argument("--n", type=int, default=None, help="samples per problem (with --url; default 1)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (with --url; default 0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling (with --url)")
    p.add_argument("--top-k", type=int, default=None,
                   help="top-k sampling, 0 = none (with --url; default 0, not the checkpoint's generation_config)")
    p.add_argument("--max-tokens", type=int, default=2048, help="max new tokens per answer (with --url)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $VLLM_API_KEY)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per generation request")
    p.add_argument("--k", default=None, help="comma-separated k values for pass@k (default 1,5; 1 with --preset)")
    p.add_argument("--tasks", default=None, help="comma-separated task ids to keep (default: all)")
    p.add_argument("--timeout", type=float, default=eval_simulate.DEFAULT_TIMEOUT,
                   help="seconds per simulation, as VerilogEval's `timeout 30` (the compile gets as long again)")
    p.add_argument("--workers", type=int, default=2, help="parallel simulations")
    p.add_argument("--out", type=cli_path, default=None, help="write per-sample results here (JSONL)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out file; with --calibrate, redo a cached calibration")
    p.add_argument("--run-dir", type=cli_path, default=None,
                   help="run directory whose eval/ holds the calibrations (the course's default: runs/<profile>)")
    p.add_argument("--profile", default=None,
                   help=f"whose run directory (runs/<profile>) holds the calibrations: one of "
                        f"{', '.join(profiles.PROFILES)} (default: ${profiles.ENV_VAR}, else smoke without a TPU)")


def sampling_settings(args) -> dict:
    """n, temperature, top_p and top_k from --preset and the explicit flags (a flag may not contradict the
    preset). Without a preset: greedy, n 1, no top-k, top_p unset."""
    chosen = dict(eval_sample.PRESETS[args.preset]) if getattr(args, "preset", None) else {"n": 1, "temperature": 0.0,
                                                                                "top_p": None, "top_k": eval_sample.NO_TOP_K}
    for key in ("n", "temperature", "top_p", "top_k"):
        given = getattr(args, key, None)
        if given is None:
            continue
        if getattr(args, "preset", None) and given != chosen[key]:
            flag = "--" + key.replace("_", "-")
            raise eval_problems.EvalError(f"--preset {args.preset} sets {flag} {chosen[key]}; drop {flag} {given} or the preset")
        chosen[key] = given
    return chosen


def main_eval(args) -> int:
    """``eval``: sample (``--url``) or read (``--completions``) answers, simulate them, print pass@k with the
    simulator version, raw and over the calibrated problems; or ``--calibrate`` the problem set first. Calibrations
    are kept in RUN_DIR/eval (default: the profile's run directory)."""
    if not args.run_dir:
        try:
            args.run_dir = profiles.get_profile(args.profile).local_dir()
        except ValueError as e:
            raise eval_problems.EvalError(f"{e} (or pass --run-dir)") from None
    ks = _parse_ks(args.k or ("1" if getattr(args, "preset", None) else "1,5"))
    if args.out and Path(args.out).exists() and not args.overwrite:
        raise eval_problems.EvalError(f"{args.out} exists; pass --overwrite to replace it")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if getattr(args, "tasks", None) else None
    problems = eval_problems.load_problems(args.problems or paths.SHIPPED_EVAL, tasks=tasks)
    eval_simulate.simulator_tools()
    version = eval_simulate.simulator_version()
    print(f"simulator: Icarus Verilog {version} ({eval_simulate.simulator_tools()[0]})")
    cache_dir = Path(args.run_dir) / "eval"
    if getattr(args, "calibrate", False):
        cal = eval_score.calibrate(problems, cache_dir, timeout=args.timeout, workers=args.workers, refresh=args.overwrite)
        print(cal.summary())
        for row in cal.table().itertuples():
            print(f"  {row.task_id}: {row.category} [{row.official}] {row.detail}")
        print(f"cached in {cal.path}")
        warning = eval_simulate.version_warning(version)
        if warning:
            print(warning, file=sys.stderr)
        return 0
    if args.url:
        if not args.model:
            raise eval_problems.EvalError("--url needs --model (the name the server serves; see `curl URL/v1/models`)")
        sampling = sampling_settings(args)
        completions = eval_sample.sample_completions(args.url, args.model, problems, n=sampling["n"],
                                         temperature=sampling["temperature"], max_tokens=args.max_tokens,
                                         api_key=args.api_key, timeout=args.request_timeout,
                                         top_p=sampling["top_p"], top_k=sampling["top_k"])
    else:
        completions = eval_sample.read_completions(args.completions)
    results, _ = eval_score.score_completions(problems, completions, ks=ks, timeout=args.timeout, workers=args.workers)
    scored = [p for p in problems if p.task_id in set(results["task_id"])]
    calibration = eval_score.find_calibration(scored, cache_dir)
    lines = eval_score.score_lines(results, ks, calibration)
    if args.out:
        eval_sample.write_jsonl_atomic(args.out, eval_score.records(results), overwrite=args.overwrite)
        print(f"wrote {len(results)} results to {args.out}")
    counts = eval_score.category_counts(results)
    n_tasks = results["task_id"].nunique()
    print(f"scored {len(results)} samples on {n_tasks} of {len(problems)} problems: "
          + ", ".join(f"{c}={int(v)}" for c, v in counts.items()))
    for line in lines:
        print(line, file=sys.stderr if line.startswith("warning:") else sys.stdout)
    if calibration is None:
        where = f" --problems {args.problems}" if args.problems else ""
        print(f"no calibration for these problems with iverilog {version} in {cache_dir}: run "
              f"`eval --calibrate{where}` once to see which problems a correct design cannot pass here")
    else:
        print(f"calibration: {calibration.path}")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# serve

SMOKE_QUESTION = "Write a Verilog module for a 2-to-1 multiplexer."


def add_serve_arguments(p) -> None:
    """The ``serve`` sub-command's arguments (``python -m gemma_tpu_helpers serve ...``)."""
    p.add_argument("--model", required=True, help="HF checkpoint directory (config, safetensors, tokenizer)")
    p.add_argument("--profile", default=None,
                   help="smoke / smoke-e / smoke-moe (CPU, runs here) or a TPU profile (prints the command: the "
                        "docker line on a TPU VM; on Colab, where there is no Docker, the vllm-tpu install and its "
                        "`vllm serve`)")
    p.add_argument("--smoke-test", action="store_true", help="start, send one chat request, print the answer, stop")
    p.add_argument("--port", type=int, default=None, help="default: a free port (CPU), 8000 in a printed command")
    p.add_argument("--api-key", default=None, help=f"require this key (default: ${vllm_command.API_KEY_ENV} if set)")
    p.add_argument("--print-command", action="store_true", help="print the command instead of running it")
    p.add_argument("--timeout", type=float, default=vllm_server.START_TIMEOUT_S, help="seconds to wait for /health")


def main_serve(args) -> int:
    """``python -m gemma_tpu_helpers serve --model DIR [--profile P] [--smoke-test] [--port N] [--api-key K]``.

    TPU profiles (or ``--print-command``): print the command and exit: the docker line and the pip alternative on
    a TPU VM; on Colab (``serve.docker`` False) the vllm-tpu install, the ``vllm serve`` line and the ``eval`` that
    talks to it (with ``--smoke-test`` it starts there, as on a CPU). CPU: start the server; with ``--smoke-test``,
    send one chat request, print the answer and stop; otherwise serve until Ctrl-C.
    """
    prof = profiles.get_profile(args.profile)
    api_key = http_client.resolve_api_key(args.api_key)
    port = args.port or vllm_command.DEFAULT_PORT
    how = vllm_command.route(prof.serving)
    if how == "pip" and not args.smoke_test:
        print(f"# {prof.name}: {prof.hardware.num_devices} TPU chip, no Docker: vllm-tpu from pip, a plain `vllm "
              f"serve`\n" + vllm_command.tpu_pip_instructions(prof.serving, args.model, port=port, api_key=api_key))
        print(f"# then evaluate through it:\npython -m gemma_tpu_helpers eval --url http://{vllm_command.HOST}:{port} "
              f"--model {vllm_command.SERVED_NAME} --profile {prof.name}")
        return 0
    if how == "docker" or args.print_command:
        print(vllm_command.shell_line(prof.serving, args.model, port=port, api_key=api_key))
        if how == "docker":
            print("\n# pip route instead of docker:\n"
                  + vllm_command.tpu_pip_instructions(prof.serving, args.model, port=port, api_key=api_key))
        return 0
    if how == "cpu":
        paths.serve_python(check=True)  # the course's venv: say `make serve-venv` when it is missing
    server = vllm_server.start(prof.serving, args.model, port=args.port, api_key=api_key, timeout=args.timeout)

    def _exit(signum, frame):  # `kill` or a closed tmux pane: leave through `with server:` so it stops the group
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGHUP, _exit)
    with server:
        print(f"vLLM ready at {server.base_url} (model {server.served_name!r}, pid {server.pid}) in "
              f"{server.start_s:.1f} s; log: {server.log_path}", flush=True)
        try:
            if args.smoke_test:
                # special tokens kept: a random smoke model may answer in them alone, which would print as ''
                answer = server.chat(SMOKE_QUESTION, max_tokens=32, skip_special_tokens=False)
                print(f"Q: {SMOKE_QUESTION}\nA: {answer['text']!r}\n({answer['latency_s']:.2f} s, "
                      f"{answer['usage']['completion_tokens']} tokens, finish: {answer['finish_reason']})")
                return 0 if answer["usage"]["completion_tokens"] > 0 else 1
            print("serving; Ctrl-C stops it", flush=True)
            while server.alive():
                time.sleep(1.0)
            print(f"error: the server exited ({server.proc.returncode}). Log tail:\n{server.log_tail()}",
                  file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0


# ---------------------------------------------------------------------------------------------------------------
# learn

def _task_list(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [] if text.strip().lower() == "none" else [t.strip() for t in text.split(",") if t.strip()]


def add_learn_arguments(p) -> None:
    """The ``learn`` sub-command's arguments."""
    p.add_argument("--profile", default=None, help="smoke, smoke-e or smoke-moe (the profiles with a learning check)")
    p.add_argument("--tasks", default=None, metavar="A,B,...",
                   help="task ids to train on and score (default: the profile's K problems with the shortest "
                        "references)")
    p.add_argument("--held-out", default=None, metavar="A,B,...",
                   help="task ids to score without training on them (default: the next shortest; 'none': none)")
    p.add_argument("--broken", choices=sorted(learning_check.BROKEN), default=None,
                   help="break one link of the chain, to see the check fail: " + "; ".join(
                       f"{k}: {v}" for k, v in learning_check.BROKEN.items()))
    p.add_argument("--generator", choices=learning_check.GENERATORS, default="vllm",
                   help="who answers: vLLM's server (default, as notebook 08 serves) or transformers in-process")
    p.add_argument("--run-dir", type=cli_path, default=None, help="run directory (default runs/<profile>); the "
                   "check works in its learn/ folder")


def main_learn(args) -> int:
    """Train on K eval problems, merge, serve, score: one line ``pass@1 before X after Y``."""
    prof = profiles.get_profile(args.profile)
    learning_check.check_profile(prof)
    profiles.configure_jax(prof)
    preflight.require(prof)
    res = learning_check.learn(prof, tasks=_task_list(args.tasks), held_out=_task_list(args.held_out), run_dir=args.run_dir,
                      broken=args.broken, generator=args.generator)
    print(res.table().to_string(index=False))
    print("seconds: " + ", ".join(f"{k} {v:g}" for k, v in res.seconds.items()))
    print("memorisation: the trained problems are the problems scored (the held-out ones show it)")
    print(res.line())
    return 0
