"""The serving steps (notebooks 08-10): serve, eval, learn, cost, bench."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from ...fixes.core import http_client
from ...fixes.eval import eval_problems, eval_sample, eval_score, eval_simulate
from ...fixes.serve import vllm_command, vllm_server
from ..budget import cost, serving_bench
from ..config import paths, profiles
from ..front import preflight
from ..training import learning_check
from . import hardware_report
from .cli import Command, cli_path, input_file, non_negative_int, positive_int, positive_seconds, tcp_port

SMOKE_QUESTION = "Write a Verilog module for a 2-to-1 multiplexer."


def _exit_on_signals() -> None:
    """`kill` or a closed terminal: leave through ``with``/``finally``, which stops what the step started."""
    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGHUP, _exit)


# ---------------------------------------------------------------------------------------------------------- serve

def serve_arguments(p) -> None:
    p.add_argument("--model", required=True, help="HF checkpoint directory (config, safetensors, tokenizer)")
    p.add_argument("--profile", default=None,
                   help="smoke / smoke-e / smoke-moe (CPU, runs here) or a TPU profile (prints the command: the "
                        "docker line on a TPU VM; on Colab, where there is no Docker, the vllm-tpu install and its "
                        "`vllm serve`)")
    p.add_argument("--smoke-test", action="store_true", help="start, send one chat request, print the answer, stop")
    p.add_argument("--port", type=tcp_port, default=None, help="default: a free port (CPU), 8000 in a printed command")
    p.add_argument("--api-key", default=None, help=f"require this key (default: ${vllm_command.API_KEY_ENV} if set)")
    p.add_argument("--print-command", action="store_true", help="print the command instead of running it")
    p.add_argument("--timeout", type=positive_seconds, default=vllm_server.START_TIMEOUT_S,
                   help="seconds to wait for /health")


def run_serve(args) -> int:
    """Step 08. TPU profiles (or ``--print-command``): print the command and exit: the docker line and the pip
    alternative on a TPU VM; on Colab (``serve.docker`` False) the vllm-tpu install, the ``vllm serve`` line and the
    ``eval`` that talks to it (with ``--smoke-test`` it starts there, as on a CPU). CPU: start the server; with
    ``--smoke-test``, send one chat request, print the answer and stop; otherwise serve until Ctrl-C."""
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
    _exit_on_signals()
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


# ----------------------------------------------------------------------------------------------------------- eval

def pass_at_ks(text: str) -> list[int]:
    """``--k``: comma-separated positive integers such as 1,5."""
    try:
        ks = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        ks = []
    if not ks or any(k < 1 for k in ks):
        raise argparse.ArgumentTypeError(f"takes comma-separated positive integers such as 1,5 (got {text!r})")
    return ks


def eval_arguments(p) -> None:
    p.add_argument("--problems", type=cli_path, default=None,
                   help="folder in the VerilogEval v2 layout (default: the 28 shipped problems)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000 (vLLM)")
    src.add_argument("--completions", type=input_file,
                     help="JSONL with task_id and completion per line (a results file works too)")
    src.add_argument("--calibrate", action="store_true",
                     help="score every reference as a completion: the toolchain's ceiling on --problems, cached in "
                          "RUN_DIR/eval per (problems, iverilog version) and used by later scores on them")
    p.add_argument("--model", help="model name on the server (with --url)")
    p.add_argument("--preset", choices=sorted(eval_sample.PRESETS), default=None,
                   help="VerilogEval v2's protocol: official-greedy = n 1, temperature 0, top-p 0.01; "
                        "official-sampled = n 20, temperature 0.85, top-p 0.95; both top-k 0 = none "
                        "(with --url; --k defaults to 1)")
    p.add_argument("--n", type=positive_int, default=None, help="samples per problem (with --url; default 1)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (with --url; default 0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling (with --url)")
    p.add_argument("--top-k", type=non_negative_int, default=None,
                   help="top-k sampling, 0 = none (with --url; default 0, not the checkpoint's generation_config)")
    p.add_argument("--max-tokens", type=positive_int, default=2048, help="max new tokens per answer (with --url)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $VLLM_API_KEY)")
    p.add_argument("--request-timeout", type=positive_seconds, default=600.0, help="seconds per generation request")
    p.add_argument("--k", type=pass_at_ks, default=None,
                   help="comma-separated k values for pass@k (default 1,5; 1 with --preset)")
    p.add_argument("--tasks", default=None, help="comma-separated task ids to keep (default: all)")
    p.add_argument("--timeout", type=positive_seconds, default=eval_simulate.DEFAULT_TIMEOUT,
                   help="seconds per simulation, as VerilogEval's `timeout 30` (the compile gets as long again)")
    p.add_argument("--workers", type=positive_int, default=2, help="parallel simulations")
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
    preset). Without a preset: greedy, n 1, no top-p and no top-k (never the checkpoint's generation_config)."""
    chosen = (dict(eval_sample.PRESETS[args.preset]) if args.preset else
              {"n": 1, "temperature": 0.0, "top_p": eval_sample.NO_TOP_P, "top_k": eval_sample.NO_TOP_K})
    for key in ("n", "temperature", "top_p", "top_k"):
        given = getattr(args, key)
        if given is None:
            continue
        if args.preset and given != chosen[key]:
            flag = "--" + key.replace("_", "-")
            raise eval_problems.EvalError(f"--preset {args.preset} sets {flag} {chosen[key]}; drop {flag} {given} "
                                          f"or the preset")
        chosen[key] = given
    return chosen


def _calibrate(args, problems, cache_dir: Path, version: str, iverilog: str | None) -> int:
    cal = eval_score.calibrate(problems, cache_dir, timeout=args.timeout, workers=args.workers, refresh=args.overwrite,
                               iverilog=iverilog)
    print(cal.summary())
    for row in cal.table().itertuples():
        print(f"  {row.task_id}: {row.category} [{row.official}] {row.detail}")
    print(f"cached in {cal.path}")
    warning = eval_simulate.version_warning(version)
    if warning:
        print(warning, file=sys.stderr)
    return 0


def _completions(args, problems) -> list[dict]:
    if not args.url:
        return eval_sample.read_completions(args.completions)
    if not args.model:
        raise eval_problems.EvalError("--url needs --model (the name the server serves; see `curl URL/v1/models`)")
    s = sampling_settings(args)
    return eval_sample.sample_completions(args.url, args.model, problems, n=s["n"], temperature=s["temperature"],
                                          max_tokens=args.max_tokens, api_key=args.api_key,
                                          timeout=args.request_timeout, top_p=s["top_p"], top_k=s["top_k"])


def run_eval(args) -> int:
    """Step 09: sample (``--url``) or read (``--completions``) answers, simulate them, print pass@k with the
    simulator version, raw and over the calibrated problems; or ``--calibrate`` the problem set first. Calibrations
    are kept in RUN_DIR/eval (default: the profile's run directory)."""
    if not args.run_dir:
        try:
            args.run_dir = profiles.get_profile(args.profile).local_dir()
        except ValueError as e:
            raise eval_problems.EvalError(f"{e} (or pass --run-dir)") from None
    ks = args.k or ([1] if args.preset else [1, 5])
    if args.out and Path(args.out).exists() and not args.overwrite:
        raise eval_problems.EvalError(f"{args.out} exists; pass --overwrite to replace it")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    problems = eval_problems.load_problems(args.problems or paths.SHIPPED_EVAL, tasks=tasks)
    iverilog = eval_simulate.simulator_tools(paths.iverilog())[0]  # the course's build first, else PATH's
    version = eval_simulate.simulator_version(iverilog)
    print(f"simulator: Icarus Verilog {version} ({iverilog})")
    cache_dir = Path(args.run_dir) / "eval"
    if args.calibrate:
        return _calibrate(args, problems, cache_dir, version, iverilog)
    completions = _completions(args, problems)
    results, _ = eval_score.score_completions(problems, completions, ks=ks, timeout=args.timeout, workers=args.workers,
                                              iverilog=iverilog)
    scored = [p for p in problems if p.task_id in set(results["task_id"])]
    calibration = eval_score.find_calibration(scored, cache_dir, iverilog)
    lines = eval_score.score_lines(results, ks, calibration, iverilog)
    if args.out:
        eval_sample.write_jsonl_atomic(args.out, eval_score.records(results), overwrite=args.overwrite)
        print(f"wrote {len(results)} results to {args.out}")
    counts = eval_score.category_counts(results)
    print(f"scored {len(results)} samples on {results['task_id'].nunique()} of {len(problems)} problems: "
          + ", ".join(f"{c}={int(v)}" for c, v in counts.items()))
    for line in lines:
        print(line, file=sys.stderr if line.startswith("warning:") else sys.stdout)
    answers = ({"url": args.url, "model": args.model, **sampling_settings(args)} if args.url
               else {"completions": str(args.completions)})
    record = hardware_report.record_eval(
        args.run_dir, eval_score.pass_at_k_table(results, sorted({1, *ks})), results["task_id"].nunique(),
        len(results), version, answers,
        calibration.ceiling(p.task_id for p in scored) if calibration is not None else None)
    print(f"score recorded in {record} (report --hardware reads it)")
    if calibration is None:
        where = f" --problems {args.problems}" if args.problems else ""
        print(f"no calibration for these problems with iverilog {version} in {cache_dir}: run "
              f"`eval --calibrate{where}` once to see which problems a correct design cannot pass here")
    else:
        print(f"calibration: {calibration.path}")
    return 0


# ---------------------------------------------------------------------------------------------------------- learn

def _task_list(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [] if text.strip().lower() == "none" else [t.strip() for t in text.split(",") if t.strip()]


def learn_arguments(p) -> None:
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
    p.add_argument("--seed", type=non_negative_int, default=None,
                   help="training seed: the LoRA's initial A and the rows' order (default: the profile's, 0)")
    p.add_argument("--run-dir", type=cli_path, default=None, help="run directory (default runs/<profile>); the "
                   "check works in its learn/ folder")


def run_learn(args) -> int:
    """Steps 06/09: train on K eval problems, merge, serve, score: one line ``pass@1 before X after Y``."""
    prof = learning_check.with_seed(profiles.get_profile(args.profile), args.seed)
    learning_check.check_profile(prof)
    profiles.configure_jax(prof)
    preflight.require(prof)
    res = learning_check.learn(prof, tasks=_task_list(args.tasks), held_out=_task_list(args.held_out),
                               run_dir=args.run_dir, broken=args.broken, generator=args.generator)
    print(res.table().to_string(index=False))
    print("seconds: " + ", ".join(f"{k} {v:g}" for k, v in res.seconds.items()))
    print("memorisation: the trained problems are the problems scored (the held-out ones show it)")
    print(res.line())
    return 0


# ----------------------------------------------------------------------------------------------------------- cost

def cost_arguments(p) -> None:
    p.add_argument("--tpu-hours", type=float, help="hours the training run took on the TPU")
    p.add_argument("--gpu-hours", type=float, help="hours the same run took on the GPUs")
    p.add_argument("--tpu", default=cost.DEFAULT_TPU, help=f"TPU platform (default {cost.DEFAULT_TPU})")
    p.add_argument("--gpu", default=cost.DEFAULT_GPU, help=f"GPU platform (default {cost.DEFAULT_GPU})")
    p.add_argument("--price", action="append", default=[], metavar="NAME=USD",
                   help=f"override or add a price in USD/hour (repeatable); defaults: "
                        f"{', '.join(f'{k}={v:.2f}' for k, v in profiles.PRICES_USD_PER_HOUR.items())} "
                        f"({profiles.PRICES_DATE})")
    p.add_argument("--throughput", type=float, help="serving output tokens/s (vllm bench serve's output_throughput)")
    p.add_argument("--platform", help="platform that served --throughput")


def run_cost(args) -> int:
    """Step 10: the training-cost comparison and/or USD per million output tokens."""
    prices = cost.parse_price_overrides(args.price)
    training = args.tpu_hours is not None or args.gpu_hours is not None
    serving = args.throughput is not None or args.platform is not None
    if not training and not serving:
        raise cost.CostError("give --tpu-hours and --gpu-hours (training), or --throughput and --platform (serving)")
    if training and (args.tpu_hours is None or args.gpu_hours is None):
        raise cost.CostError("the training comparison needs both --tpu-hours and --gpu-hours")
    if serving and (args.throughput is None or args.platform is None):
        raise cost.CostError("the serving cost needs both --throughput and --platform")
    train_df = cost.training_comparison(args.tpu_hours, args.gpu_hours, args.tpu, args.gpu, prices) if training \
        else None
    serve_df = cost.serving_comparison({args.platform: args.throughput}, prices) if serving else None
    note = f" (overridden: {', '.join(sorted(prices))})" if prices else ""
    print(f"prices: list prices of {profiles.PRICES_DATE}, on-demand, us-central1{note}")
    if train_df is not None:
        print(train_df.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
        print(f"time ratio (GPU/TPU): {train_df.attrs['time_ratio']:.2f}")
        print(f"cost ratio (GPU/TPU): {train_df.attrs['cost_ratio']:.2f}")
    if serve_df is not None:
        row = serve_df.iloc[0]
        print(f"{row['platform']}: {row['output_tok_per_s']:.1f} output tok/s at ${row['usd_per_hour']:.2f}/h = "
              f"${row['usd_per_million_output_tokens']:.2f} per million output tokens")
    return 0


# ---------------------------------------------------------------------------------------------------------- bench

def bench_arguments(p) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a running OpenAI-compatible vLLM server, e.g. http://127.0.0.1:8000")
    src.add_argument("--serve-model", type=cli_path, metavar="DIR",
                     help="start a CPU vLLM server for this checkpoint, benchmark it, stop it (smoke)")
    p.add_argument("--model", default=None, help="served model name (default: the first the server lists)")
    p.add_argument("--tokenizer", default=None,
                   help="checkpoint dir or Hub id for the tokenizer (default: the served model's dir, if local)")
    p.add_argument("--input-lens", default=",".join(map(str, serving_bench.DEFAULT_INPUT_LENS)),
                   help="comma-separated prompt lengths in tokens (default %(default)s; the paper: up to 4096)")
    p.add_argument("--qps", default=",".join(f"{q:g}" for q in serving_bench.DEFAULT_QPS),
                   help="comma-separated request rates (default %(default)s)")
    p.add_argument("--output-len", type=positive_int, default=serving_bench.DEFAULT_OUTPUT_LEN,
                   help="output tokens per request")
    p.add_argument("--num-prompts", type=positive_int, default=serving_bench.DEFAULT_NUM_PROMPTS,
                   help="requests per point")
    p.add_argument("--out", type=cli_path, default=None, help="results folder (default runs/<profile>/bench)")
    p.add_argument("--api-key", default=None, help="the server's key (default: $VLLM_API_KEY)")
    p.add_argument("--profile", default=None, help="profile for --serve-model and the default --out")
    p.add_argument("--timeout", type=positive_seconds, default=serving_bench.SWEEP_TIMEOUT_S,
                   help="seconds for the whole sweep")


def run_bench(args) -> int:
    """Step 10: a QPS x input-length sweep with ``vllm bench serve``; prints the table, writes sweep.csv."""
    api_key = http_client.resolve_api_key(args.api_key)
    server = None
    _exit_on_signals()
    try:
        prof = profiles.get_profile(args.profile)
        out = Path(args.out) if args.out else prof.local_dir() / "bench"
        input_lens = serving_bench.parse_list(args.input_lens, int, "--input-lens")
        qps = serving_bench.parse_list(args.qps, float, "--qps")
        url, model = args.url, args.model
        if args.serve_model:
            if args.model not in (None, vllm_command.SERVED_NAME):
                raise serving_bench.BenchError(f"--serve-model serves the checkpoint as "
                                               f"{vllm_command.SERVED_NAME!r}; drop --model")
            server = serving_bench.start_server(prof, args.serve_model, api_key=api_key)
            print(f"vLLM ready at {server.base_url} in {server.start_s:.1f} s", flush=True)
            url, model = server.base_url, vllm_command.SERVED_NAME
        t0 = time.perf_counter()
        df = serving_bench.sweep(url, model, input_lens, qps, args.output_len, args.num_prompts, out,
                                 tokenizer=args.tokenizer or args.serve_model, api_key=api_key, timeout=args.timeout)
    finally:
        if server is not None:
            server.stop()
    cols = ["input_len", "qps", "completed", "request_throughput", "output_throughput", "median_ttft_ms",
            "p99_ttft_ms", "median_tpot_ms", "median_e2el_ms"]
    print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(f"{len(df)} points in {time.perf_counter() - t0:.1f} s; table: {out / 'sweep.csv'}, raw JSON: {out / 'raw'}")
    return 0


COMMANDS = (
    Command("serve", "08: serve a checkpoint with vLLM (CPU build here; on TPU the docker line, or on Colab the pip "
            "route)", serve_arguments, run_serve),
    Command("eval", "09: VerilogEval-style pass@k with iverilog (--url server or --completions file)",
            eval_arguments, run_eval),
    Command("learn", "06/09: the learning check: train on K eval problems, merge, serve, score pass@1 before and "
            "after", learn_arguments, run_learn),
    Command("cost", "10: TPU-vs-GPU training cost ratio and $ per million output tokens", cost_arguments, run_cost),
    Command("bench", "10: vllm bench serve QPS sweep (TTFT/TPOT/throughput vs QPS per input length)",
            bench_arguments, run_bench),
)
