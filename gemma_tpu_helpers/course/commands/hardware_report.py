"""Report your run: what a run on real hardware measured, as one markdown block to paste back (``report --hardware``).

It reads what the steps recorded in the run directory, and says for each missing figure which step makes it:
``train/done.json`` (the training's devices and peak HBM, :func:`train.device_record`), ``train/metrics.jsonl`` (the
clean step time: the median of ``step_s``, which leaves out compiles, saves and evaluations),
``merged/merge_info.json`` (the merge's seconds), ``bench/sweep.csv`` (the ``bench`` sweep) and
``eval/last_score.json`` (the last ``eval``'s pass@k, :func:`record_eval`), beside the versions of this environment.
For a TPU profile the plan's predictions stand beside the measured step time and peak HBM. Nothing here imports JAX:
the report runs on any host, the serving VM included (docs/tpu-vm.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path

from ...fixes.core.errors import GemmaTpuError
from ...fixes.core.file_io import to_path, write_atomic
from ...fixes.serve import vllm_command
from ..budget import plan, predictions
from ..config import paths
from ..config.profiles import Profile, resolve_run
from ..front import logbook, preflight
from ..training import train
from .cli import PROG

REPORT = "hardware_report.md"  # in the run directory (the local one when the run directory is on gs://)
EVAL_SCORE = "last_score.json"  # in <run>/eval/: the last `eval`'s score (record_eval)
GIB = 2**30
CHECKOUT = paths.REPO


class ReportError(GemmaTpuError, ValueError):
    """A record the report reads is damaged; the message names the file and the step that writes it again."""


@dataclasses.dataclass(frozen=True)
class Figure:
    name: str
    value: str | None  # None: missing; ``step`` is the command that makes it, ``why`` says more where needed
    compare: str = ""  # the course's prediction for it, where it has one
    step: str = ""
    why: str = ""

    def cell(self) -> str:
        if self.value is not None:
            return self.value
        return "missing" + (f": run `{self.step}`" if self.step else "") + (f" ({self.why})" if self.why else "")


# ------------------------------------------------------------------------------------------ what the steps record

def record_eval(run_dir: str | os.PathLike, pass_at_k: dict, problems: int, samples: int, simulator: str,
                answers: dict, ceiling: float | None = None) -> Path:
    """Write ``<run_dir>/eval/last_score.json`` (atomically): the pass@k of the last ``eval``, what it scored and
    where the answers came from. A NaN pass@k (fewer samples than k) is written as null."""
    clean = {str(k): (None if v is None or math.isnan(v) else round(float(v), 6)) for k, v in pass_at_k.items()}
    record = {"pass_at_k": clean, "problems": int(problems), "samples": int(samples), "iverilog": simulator,
              "ceiling": ceiling, "answers": answers, "host": host(),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return write_atomic(Path(run_dir) / "eval" / EVAL_SCORE, json.dumps(record, indent=1) + "\n")


def host() -> str:
    """This machine's accelerator, read without JAX: "TPU v6e x 8 (v6e-8)", else its CPU."""
    chips, kind = preflight.tpu_chips()
    if chips:
        accel = preflight.accelerator_type()
        return f"TPU {kind} x {chips}" + (f" ({accel})" if accel else "")
    return f"{platform.machine()} CPU, {os.cpu_count()} cores"


# ------------------------------------------------------------------------------------------------------ reading

def _read_json(path, writer: str) -> dict | None:
    path = to_path(path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ReportError(f"{path} is not JSON ({e}); {writer} writes it: run that step again.") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path} is not a JSON object; {writer} writes it: run that step again.")
    return data


def course_version() -> str | None:
    """The checkout's commit (with "+ local changes" when files differ from it), None outside a git checkout."""
    if not (CHECKOUT / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(CHECKOUT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(CHECKOUT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode:
        return None
    return f"commit {head.stdout.strip()}" + (" + local changes" if dirty.stdout.strip() else "")


def clean_step_seconds(run_dir) -> tuple[float | None, int, int]:
    """(median ``step_s`` of the clean steps, how many, how many steps) from the training's metrics
    (:func:`train.read_metrics`: the last value of a step wins)."""
    try:
        df = train.read_metrics(run_dir)
    except ValueError as e:
        raise ReportError(f"{to_path(run_dir) / 'train' / 'metrics.jsonl'} has a line that is not JSON ({e}); train "
                          f"writes it: run the training again (it resumes).") from None
    if df.empty or "step_s" not in df:
        return None, 0, int(df["loss"].notna().sum()) if "loss" in df else 0
    steps = df[df["loss"].notna()]
    clean = steps["step_s"].dropna()
    return (float(clean.median()) if len(clean) else None), len(clean), len(steps)


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def prediction(profile: Profile, run_dir) -> dict | None:
    """The plan's prediction for a TPU profile: its AOT plan (cached in the run directory, else the one shipped)
    and the run :func:`predictions.predict_run` derives from it. None for a CPU profile or without a plan."""
    if profile.hardware.platform != "tpu":
        return None
    setting = (profile.name, profile.train.remat, profile.lora.qlora)
    found = plan.course_plans(run_dir, settings=(setting,))
    if not found:
        return None
    p = found[0]
    out = {"peak_bytes": p.peak_bytes, "source": p.source}
    if p.flops is not None and p.layers >= p.model_layers and profile.hardware.peak_bf16_flops_per_chip:
        out["run"] = predictions.predict_run(p, profile)
    return out


def figures(profile: Profile, run_dir=None) -> list[Figure]:
    """Every figure of the report for ``profile``'s run directory (default: runs/<profile>), missing ones with the
    step that makes them."""
    run = resolve_run(profile, run_dir)
    run_dir, local = run.dir, run.local
    name = profile.name
    train_cmd = f"{PROG} train --profile {name}"
    url = f"http://{vllm_command.HOST}:{vllm_command.DEFAULT_PORT}"
    out = [Figure("course", course_version(), why="not a git checkout"),
           Figure("versions", ", ".join(f"{k} {v}" for k, v in logbook.versions().items() if v != "not installed")),
           Figure("this host", host())]
    pred = prediction(profile, local)
    run = (pred or {}).get("run")
    done = _read_json(to_path(run_dir) / "train" / train.DONE, "train")
    out += _training_figures(done, run, train_cmd, run_dir)
    median, clean, steps = clean_step_seconds(run_dir)
    step_pred = (f"{run['step_s']:.2f} s (roofline) to {run['paper_mfu_step_s']:.2f} s (the paper's MFU)"
                 if run else "")
    if median is not None:
        out.append(Figure("clean step time", f"{median:.2f} s per optimizer step (median of {clean} clean steps "
                                             f"of {steps})", compare=step_pred))
    else:
        why = (f"none of its {steps} steps is clean: a process's first step compiles, the last saves, and saves and "
               f"evaluations are left out; train more steps" if steps else "")
        out.append(Figure("clean step time", None, compare=step_pred, step=train_cmd, why=why))
    out.append(_hbm_figure(done, pred, train_cmd))
    out.append(_merge_figure(_read_json(local / "merged" / "merge_info.json", "merge"),
                             f"{PROG} merge --profile {name}"))
    out.append(_score_figure(_read_json(local / "eval" / EVAL_SCORE, "eval"),
                             f"{PROG} eval --url {url} --model {vllm_command.SERVED_NAME} --preset official-greedy "
                             f"--profile {name}"))
    out.append(_serving(local / "bench" / "sweep.csv", f"{PROG} bench --url {url} --profile {name}"))
    return out


def _training_figures(done: dict | None, run: dict | None, train_cmd: str, run_dir) -> list[Figure]:
    """The devices and the time of the training from its ``done.json``, beside the plan's prediction (``run``)."""
    if done is None:
        started = (to_path(run_dir) / "train" / "metrics.jsonl").is_file()
        why = "the training has not finished: the same command resumes it" if started else ""
        return [Figure("training devices", None, step=train_cmd, why=why),
                Figure("training", None, step=train_cmd, why=why)]
    if "device_count" in done:
        procs = done.get("process_count", 1)
        devices = Figure("training devices", f"{done['device_kind']} x {done['device_count']} "
                                             f"({procs} process{'es' if procs != 1 else ''})")
    else:
        devices = Figure("training devices", None, step=f"{train_cmd} --run-dir NEW_DIR",
                         why="not recorded: trained before the course recorded it")
    hours = (f"{run['roofline_hours']['packed']:.2f} h (roofline) to {run['paper_mfu_hours']['packed']:.2f} h "
             f"(the paper's MFU) for {run['steps']['packed']:,} packed steps" if run else "")
    return [devices, Figure("training", f"{done['steps']:,} steps in {done['seconds']:.1f} s "
                                        f"({done['seconds'] / 3600:.2f} h)", compare=hours)]


def _hbm_figure(done: dict | None, pred: dict | None, train_cmd: str) -> Figure:
    hbm_pred = (f"{_gib(pred['peak_bytes'])} per chip (AOT plan)" if pred and pred.get("peak_bytes") else "")
    if done is None or "device_count" not in done:
        return Figure("peak HBM (training)", None, compare=hbm_pred, step=train_cmd,
                      why="recorded at the end of a training")
    if done.get("peak_hbm_bytes") is not None:
        limit = f" of {_gib(done['hbm_limit_bytes'])}" if done.get("hbm_limit_bytes") else ""
        return Figure("peak HBM (training)", f"{_gib(done['peak_hbm_bytes'])}{limit} per chip (the largest of "
                                             f"this process's chips)", compare=hbm_pred)
    return Figure("peak HBM (training)", "n/a on CPU" if done.get("platform") == "cpu" else
                  f"not reported by the {done.get('platform')} runtime", compare=hbm_pred)


def _merge_figure(info: dict | None, merge_cmd: str) -> Figure:
    if info is None:
        return Figure("merge", None, step=merge_cmd)
    if info.get("seconds") is None:
        return Figure("merge", None, step=f"{merge_cmd} --overwrite",
                      why="not recorded: merged before the course recorded its time")
    return Figure("merge", f"{info['seconds']:.1f} s (step {info['step']}, {info['total_size'] / 1e9:.2f} GB written)")


def _score_figure(score: dict | None, eval_cmd: str) -> Figure:
    if score is None or score.get("pass_at_k", {}).get("1") is None:
        return Figure("pass@1", None, step=eval_cmd, why="with the server up")
    ans = score.get("answers", {})
    how = (f"{ans.get('n', '?')} sample(s) a problem at temperature {ans.get('temperature', '?')} from "
           f"{ans['url']}" if "url" in ans else f"answers from {ans.get('completions', '?')}")
    ceiling = f", ceiling {score['ceiling']:.4f}" if score.get("ceiling") is not None else ""
    return Figure("pass@1", f"{score['pass_at_k']['1']:.4f} on {score['problems']} problems ({how}; "
                            f"iverilog {score['iverilog']}{ceiling}; {score.get('host', '?')})")


def _serving(path: Path, step: str) -> Figure:
    if not path.is_file():
        return Figure("serving (bench sweep)", None, step=step, why="with the server up")
    import pandas as pd

    df = pd.read_csv(path)
    if df.empty or "output_throughput" not in df:
        return Figure("serving (bench sweep)", None, step=step, why=f"{path} holds no sweep")
    best = df.loc[df["output_throughput"].idxmax()]
    return Figure("serving (bench sweep)", f"peak {best['output_throughput']:.1f} output tok/s at input "
                                           f"{int(best['input_len'])}, QPS {best['qps']:g} (median TTFT "
                                           f"{best['median_ttft_ms']:.0f} ms there; {len(df)} points)")


def format_report(profile: Profile, found: list[Figure], run_dir) -> str:
    """The markdown block to paste: one table, then the missing figures as steps to run."""
    predicted = any(f.compare for f in found)
    head = "| figure | this run |" + (" predicted by the course (never measured on a TPU) |" if predicted else "")
    lines = [f"### gemma-tpu run report: {profile.name} ({run_dir})", "", head,
             "| --- | --- |" + (" --- |" if predicted else "")]
    for f in found:
        cell = f.cell().replace("|", "\\|")
        lines.append(f"| {f.name} | {cell} |" + (f" {f.compare} |" if predicted else ""))
    steps = list(dict.fromkeys(f.step for f in found if f.value is None and f.step))
    if steps:
        lines += ["", "To fill the missing figures, run: " + "; then ".join(f"`{s}`" for s in steps)]
    return "\n".join(lines) + "\n"


def write_report(profile: Profile, run_dir=None) -> tuple[str, Path]:
    """The report's markdown, also written (atomically) to ``<run dir>/hardware_report.md``; the local run
    directory when the run directory is on gs://."""
    run = resolve_run(profile, run_dir)
    text = format_report(profile, figures(profile, run), run.dir)
    return text, write_atomic(run.local / REPORT, text)
