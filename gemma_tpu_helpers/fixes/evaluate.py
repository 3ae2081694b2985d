"""VerilogEval-style pass@k with Icarus Verilog (notebook 09).

The pieces, in the order a run uses them:

- :func:`load_problems` reads problems in the VerilogEval v2 three-file layout (``<task>_prompt.txt``,
  ``<task>_ref.sv`` with ``module RefModule``, ``<task>_test.sv`` with ``module tb``): the shipped 28 by default, or
  your own VerilogEval copy (its ``dataset_spec-to-rtl`` folder).
- :func:`build_prompt` turns a problem into a spec-to-RTL chat prompt; :func:`sample_completions` asks an
  OpenAI-compatible server (vLLM) for ``n`` answers per problem.
- :func:`extract_verilog` pulls the Verilog out of an answer; :func:`simulate` runs the official harness
  (``iverilog -Wall -Winfloop -Wno-timescale -g2012 -s tb -o bin sample.sv test.sv ref.sv``, then ``vvp bin``) and
  reads ``Mismatches: N in M samples``.
- :func:`score_completions` does both for every answer, in parallel, and computes the unbiased pass@k
  (:func:`pass_at_k`).

A sample passes when its testbench prints ``Mismatches: 0 in M samples`` with M > 0. Every other outcome has one
category, so a failure chart tells you *why* a model fails: ``no_code`` (no Verilog module in the answer),
``compile_error`` (iverilog rejected it: syntax, missing ``TopModule``, ...), ``timeout`` (the simulation did not
finish), ``runtime_error`` (it ran but the testbench printed no usable result) and ``mismatch`` (wrong behaviour).
Beside it, ``official`` is VerilogEval's own failure letter (:data:`OFFICIAL_LETTERS`), for published tables.

The toolchain has a ceiling: :func:`calibrate` scores every reference as a completion, and a problem whose own
reference fails (an unsupported construct, a testbench that times out) is one no model can pass with this
simulator. :func:`score_lines` prints each pass@k raw and over the calibrated problems, with the simulator
version, and warns when it is not Icarus Verilog 12, the version VerilogEval v2 requires (:func:`version_warning`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Sequence

from . import infra
from .errors import GemmaTpuError, run_cli

IVERILOG_FLAGS = ("-Wall", "-Winfloop", "-Wno-timescale", "-g2012", "-s", "tb")
CATEGORIES = ("pass", "mismatch", "compile_error", "runtime_error", "timeout", "no_code")
FILE_SUFFIXES = {"prompt": "_prompt.txt", "ref": "_ref.sv", "test": "_test.sv"}
DEFAULT_TIMEOUT = 30.0  # seconds for the simulation (VerilogEval's `timeout 30 vvp`), and again for the compile
LOG_TAIL_CHARS = 2000
MAX_LOG_BYTES = 8 * 1024 * 1024  # a sample that floods stdout is stopped here
# VerilogEval v2 requires Icarus Verilog 12 (its README; 13, the development branch, is unsupported). Debian 12 and
# Ubuntu 22.04 ship 11, so `make iverilog` builds 12.0 from source into $GEMMA_TPU_TOOLS/iverilog-12 (default
# ~/.cache/gemma-tpu/iverilog-12), where simulator_tools() looks first; $GEMMA_TPU_IVERILOG names another iverilog
# binary.
REQUIRED_IVERILOG = "12"
TOOLS_ENV, IVERILOG_ENV = "GEMMA_TPU_TOOLS", "GEMMA_TPU_IVERILOG"
BUILD_HINT = ("`make iverilog` (or `tools/build_iverilog.sh`) builds Icarus Verilog 12.0 into "
              "$GEMMA_TPU_TOOLS/iverilog-12 in about 5 minutes; `conda install -c conda-forge iverilog=12` also works")
INSTALL_HINT = (f"Install Icarus Verilog 12: {BUILD_HINT}. Any other iverilog on PATH is used as a fallback "
                "(`sudo apt-get install iverilog` gives 11 on Debian 12 / Ubuntu 22.04; "
                "`brew install icarus-verilog`).")
# VerilogEval's spec-to-rtl system message.
SYSTEM_PROMPT = "You are a Verilog RTL designer that only writes code using correct Verilog syntax."

_MISMATCH_RE = re.compile(r"^Mismatches: (\d+) in (\d+) samples\s*$", re.M)

# The course's 28 self-written problems (gemma_tpu_helpers/data/eval); pass your own folder to load_problems.
SHIPPED_EVAL = Path(__file__).resolve().parents[1] / "data" / "eval"


class EvalError(GemmaTpuError, ValueError):
    """Bad input to the evaluation: a problem folder, a completions file, an argument."""


class IverilogNotFoundError(EvalError):
    pass


class ServerError(GemmaTpuError, RuntimeError):
    """The OpenAI-compatible server could not be reached or refused a request."""


# ---------------------------------------------------------------------------
# Problems and prompts
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str  # the spec; the answer must define `module TopModule`
    ref: str  # reference solution, `module RefModule`
    test: str  # testbench `module tb`, prints `Mismatches: N in M samples`
    kind: str | None = None
    description: str | None = None


def load_problems(directory: str | os.PathLike | None = None, tasks: Iterable[str] | None = None) -> list[Problem]:
    """Problems in the VerilogEval v2 three-file layout, sorted by task id.

    ``directory`` defaults to the 28 shipped problems. Any folder with ``<task>_prompt.txt``, ``<task>_ref.sv`` and
    ``<task>_test.sv`` per task works, e.g. VerilogEval v2's ``dataset_spec-to-rtl``. An optional
    ``problems.jsonl`` (``task_id``, ``kind``, ``description``) adds metadata. ``tasks`` keeps only those ids.
    """
    directory = Path(directory) if directory is not None else SHIPPED_EVAL
    if not directory.is_dir():
        raise EvalError(f"Problem folder {directory} does not exist (expected VerilogEval files such as "
                        f"Prob001_zero_prompt.txt, Prob001_zero_ref.sv, Prob001_zero_test.sv).")
    found: dict[str, set[str]] = {}
    for path in directory.iterdir():
        for role, suffix in FILE_SUFFIXES.items():
            if path.name.endswith(suffix) and path.is_file():
                found.setdefault(path.name[: -len(suffix)], set()).add(role)
    if not found:
        raise EvalError(f"No problems in {directory}: expected <task>_prompt.txt, <task>_ref.sv and <task>_test.sv "
                        f"files (the VerilogEval v2 layout).")
    for task_id in sorted(found):
        missing = [task_id + FILE_SUFFIXES[r] for r in FILE_SUFFIXES if r not in found[task_id]]
        if missing:
            raise EvalError(f"Problem {task_id!r} in {directory} is incomplete: missing {', '.join(missing)}. "
                            f"Each task needs {', '.join(task_id + s for s in FILE_SUFFIXES.values())}.")
    meta: dict[str, dict] = {}
    meta_path = directory / "problems.jsonl"
    if meta_path.is_file():
        for line in meta_path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise EvalError(f"{meta_path}: a line is not valid JSON ({e.msg}); fix or remove the file "
                                    f"(it only adds kind/description metadata)") from None
                meta[row.get("task_id")] = row
    wanted = sorted(found)
    if tasks is not None:
        tasks = list(tasks)
        unknown = [t for t in tasks if t not in found]
        if unknown:
            raise EvalError(f"Unknown task id(s) {unknown} in {directory}; it has {len(found)} problems, "
                            f"e.g. {wanted[:3]}.")
        wanted = sorted(set(tasks))
    problems = []
    for task_id in wanted:
        text = {r: (directory / (task_id + s)).read_text(encoding="utf-8") for r, s in FILE_SUFFIXES.items()}
        m = meta.get(task_id, {})
        problems.append(Problem(task_id=task_id, kind=m.get("kind"), description=m.get("description"), **text))
    return problems


def prompt_messages(problem: Problem, system_prompt: str | None = SYSTEM_PROMPT) -> list[dict]:
    """The chat messages sent for a problem: VerilogEval's system prompt and :func:`build_prompt` as the user turn.
    Gemma 4 has a native system turn; the model's template renders it (``serve.rendered_prompt`` shows the text)."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": build_prompt(problem)}]


def build_prompt(problem: Problem) -> str:
    """The user message in VerilogEval's spec-to-RTL style (use it with :data:`SYSTEM_PROMPT`)."""
    return (
        "\nQuestion:\n"
        + problem.prompt.strip()
        + "\n\nAnswer with a complete Verilog module named TopModule, with exactly the interface above, "
        "enclosed in a single ```verilog code block.\n"
        "\nAnswer:\n"
    )


# ---------------------------------------------------------------------------
# Extracting the code
# ---------------------------------------------------------------------------

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.S)
_OPEN_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*)\Z", re.S)
_MODULE_RE = re.compile(r"^[ \t]*module\b.*?\bendmodule\b", re.S | re.M)
_HAS_MODULE = re.compile(r"^[ \t]*module\s+\w+", re.M)
_VERILOG_TAGS = {"", "verilog", "systemverilog", "sv", "v", "vlog"}


# Gemma 4's reasoning: <|channel>thought ... <channel|> (the server keeps special tokens in eval answers, see
# sample_completions); other models' <think> ... </think>. Special-token strings left over are not code.
_CHANNEL_RE = re.compile(r"<\|channel>.*?<channel\|>", re.S)
_LEFTOVER_TOKENS_RE = re.compile(r"<turn\|>|<\|turn>|<eos>|<bos>|<pad>")


def _strip_think(text: str) -> str:
    for pattern, open_, close in ((r"<think>.*?</think>", "<think>", "</think>"), (_CHANNEL_RE, "<|channel>", "<channel|>")):
        text = re.sub(pattern, "", text, flags=re.S) if isinstance(pattern, str) else pattern.sub("", text)
        if close in text:  # the template opened the reasoning in the prompt: the answer follows the last close
            text = text.rsplit(close, 1)[1]
        if open_ in text:  # reasoning cut off by max_tokens: nothing after it is an answer
            text = text.split(open_, 1)[0]
    return _LEFTOVER_TOKENS_RE.sub("", text)


def extract_verilog(text: str | None) -> str | None:
    """The Verilog in a model's answer, or None when there is none.

    Order: the first closed ```verilog / ```systemverilog / ``` block that holds a module (one with
    ``module TopModule`` wins); else an unterminated fence (an answer cut off by max_tokens); else bare
    ``module ... endmodule`` text. Reasoning is removed first: Gemma 4's thought channel ``<|channel>...<channel|>``
    and ``<think>...</think>``.
    """
    if not text:
        return None
    text = _strip_think(text)
    blocks = [(tag.lower(), body) for tag, body in _FENCE_RE.findall(text)]
    blocks = [body.strip() for tag, body in blocks if tag in _VERILOG_TAGS and _HAS_MODULE.search(body)]
    if blocks:
        top = [b for b in blocks if re.search(r"^[ \t]*module\s+TopModule\b", b, re.M)]
        return (top or blocks)[0]
    last = text.rfind("```")
    if last != -1 and text.count("```") % 2 == 1:
        m = _OPEN_FENCE_RE.match(text, last)
        if m and m.group(1).lower() in _VERILOG_TAGS and _HAS_MODULE.search(m.group(2)):
            return m.group(2).strip()
    modules = _MODULE_RE.findall(text)
    if modules:
        return "\n\n".join(m.strip() for m in modules)
    return None


# ---------------------------------------------------------------------------
# Simulation
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class SimResult:
    category: str  # one of CATEGORIES
    mismatches: int | None = None
    samples: int | None = None
    detail: str = ""  # one line: the first compile error, the timeout, ...
    log_tail: str = ""  # the end of iverilog's and vvp's output
    seconds: float = 0.0
    official: str = "?"  # VerilogEval's own failure letter for the same outcome (OFFICIAL_LETTERS)

    @property
    def passed(self) -> bool:
        return self.category == "pass"

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "passed": self.passed}


def iverilog_prefix() -> Path:
    """Where `make iverilog` builds Icarus Verilog 12: ``$GEMMA_TPU_TOOLS/iverilog-12`` (default ~/.cache/gemma-tpu)."""
    return Path(os.environ.get(TOOLS_ENV) or Path.home() / ".cache" / "gemma-tpu") / "iverilog-12"


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def simulator_tools() -> tuple[str, str]:
    """``(iverilog, vvp)`` from one installation: $GEMMA_TPU_IVERILOG, else the built prefix, else PATH.

    vvp is taken from beside iverilog when it is there: a vvp of another version cannot run iverilog's output.
    """
    chosen = os.environ.get(IVERILOG_ENV)
    if chosen:
        if not _executable(Path(chosen)):
            raise IverilogNotFoundError(f"${IVERILOG_ENV} is {chosen!r}, which is not an executable file; point it "
                                        f"at an iverilog binary or unset it. {INSTALL_HINT}")
        iverilog = chosen
    elif _executable(iverilog_prefix() / "bin" / "iverilog"):
        iverilog = str(iverilog_prefix() / "bin" / "iverilog")
    else:
        iverilog = shutil.which("iverilog")
    if iverilog is None:
        raise IverilogNotFoundError(f"`iverilog` was not found in {iverilog_prefix()} nor on PATH; the "
                                    f"VerilogEval harness needs Icarus Verilog. {INSTALL_HINT}")
    beside = Path(iverilog).parent / "vvp"
    vvp = str(beside) if _executable(beside) else shutil.which("vvp")
    if vvp is None:
        raise IverilogNotFoundError(f"`vvp` (Icarus Verilog's simulator) was not found beside {iverilog} nor on "
                                    f"PATH. {INSTALL_HINT}")
    return iverilog, vvp


_VERSIONS: dict[tuple[str, float], str] = {}


def simulator_version() -> str:
    """The Icarus Verilog version that :func:`simulate` uses, e.g. ``"12.0"`` (from ``iverilog -V``)."""
    iverilog, _ = simulator_tools()
    key = (iverilog, os.stat(iverilog).st_mtime)
    if key not in _VERSIONS:
        try:
            out = subprocess.run([iverilog, "-V"], capture_output=True, text=True, timeout=30,
                                 stdin=subprocess.DEVNULL).stdout
        except (OSError, subprocess.TimeoutExpired) as e:
            raise IverilogNotFoundError(f"`{iverilog} -V` failed ({e}). {INSTALL_HINT}") from None
        m = re.search(r"Icarus Verilog version (\S+)", out)
        if m is None:
            raise IverilogNotFoundError(f"`{iverilog} -V` printed no 'Icarus Verilog version' line "
                                        f"(got {out[:200]!r}); is it Icarus Verilog? {INSTALL_HINT}")
        _VERSIONS[key] = m.group(1)
    return _VERSIONS[key]


def version_warning(version: str | None = None) -> str | None:
    """A warning when the simulator is not the version VerilogEval v2 requires (12), else None."""
    version = version or simulator_version()
    if version.split(".")[0] == REQUIRED_IVERILOG:
        return None
    return (f"warning: scored with Icarus Verilog {version}, but VerilogEval v2 requires version "
            f"{REQUIRED_IVERILOG} (13 is unsupported). Scores on the real benchmark differ between versions: of its "
            f"156 references, 151 pass with 11.0 and 152 with 12.0. Fix: {BUILD_HINT}.")


def _run(cmd: list[str], cwd: str, deadline: float, log_path: Path) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group with output to a file; None as exit code on timeout or flood."""
    proc = infra.start_group(cmd, log_path, cwd=cwd)
    rc, why, poll = None, "", 0.005
    while True:
        try:
            rc = proc.wait(timeout=poll)
            break
        except subprocess.TimeoutExpired:
            poll = min(poll * 2, 0.1)
            if time.monotonic() >= deadline:
                why = "timeout"
            elif log_path.stat().st_size > MAX_LOG_BYTES:
                why = "flood"
            if why:
                infra.stop_group(proc, grace=0)  # no grace: a runaway simulation has nothing to save
                break
    return rc, why


def _read_tail(path: Path, limit: int = 64 * 1024) -> str:
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - limit))
        return f.read().decode("utf-8", "replace")


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if "error" in line.lower() or "I give up" in line:
            return line.strip()
    lines = [l for l in log.splitlines() if l.strip()]
    return lines[0].strip() if lines else ""


def simulate(sample_code: str | None, problem: Problem, timeout: float = DEFAULT_TIMEOUT) -> SimResult:
    """Run one sample through the official VerilogEval harness and classify the outcome.

    ``sample_code`` must define ``module TopModule`` (None or blank: ``no_code``). ``timeout`` bounds the
    simulation, as VerilogEval's ``timeout 30`` does, and the compile separately; on expiry the whole process group
    is killed. ``official`` is the letter VerilogEval's own analyzer gives the same outcome (:func:`official_letter`).
    """
    result, full_log = _simulate(sample_code, problem, timeout)
    # No code: VerilogEval compiles an empty sample, and its testbench then finds no TopModule ('m').
    result.official = "m" if result.category == "no_code" else official_letter(full_log, sample_code)
    return result


def _simulate(sample_code: str | None, problem: Problem, timeout: float) -> tuple[SimResult, str]:
    """:func:`simulate`'s result and the whole iverilog + vvp log (with TIMEOUT appended when it was killed)."""
    start = time.monotonic()
    if sample_code is None or not sample_code.strip():
        return SimResult("no_code", detail="no Verilog module in the completion"), ""
    iverilog, vvp = simulator_tools()
    with tempfile.TemporaryDirectory(prefix="verilog-eval-") as tmp:
        d = Path(tmp)
        (d / "sample.sv").write_text(sample_code, encoding="utf-8")
        (d / "test.sv").write_text(problem.test, encoding="utf-8")
        (d / "ref.sv").write_text(problem.ref, encoding="utf-8")
        cmd = [iverilog, *IVERILOG_FLAGS, "-o", "bin", "sample.sv", "test.sv", "ref.sv"]
        rc, why = _run(cmd, tmp, time.monotonic() + timeout, d / "compile.log")
        compile_log = _read_tail(d / "compile.log")
        if why == "timeout":
            return SimResult("timeout", detail=f"iverilog did not finish within {timeout:g} s",
                             log_tail=compile_log[-LOG_TAIL_CHARS:],
                             seconds=time.monotonic() - start), compile_log + "\nTIMEOUT\n"
        if rc != 0 or why or not (d / "bin").is_file():
            return SimResult("compile_error", detail=_first_error(compile_log),
                             log_tail=compile_log[-LOG_TAIL_CHARS:], seconds=time.monotonic() - start), compile_log
        rc, why = _run([vvp, "bin"], tmp, time.monotonic() + timeout, d / "run.log")
        run_log = _read_tail(d / "run.log")
    full_log = compile_log + run_log
    log = full_log[-LOG_TAIL_CHARS:]
    seconds = time.monotonic() - start
    if why == "timeout":  # VerilogEval's harness prints TIMEOUT when its `timeout 30` kills vvp
        return SimResult("timeout", detail=f"simulation did not finish within {timeout:g} s (killed)",
                         log_tail=log, seconds=seconds), full_log + "\nTIMEOUT\n"
    if why == "flood":
        return SimResult("runtime_error", detail=f"simulation printed more than {MAX_LOG_BYTES:,} bytes (killed)",
                         log_tail=log, seconds=seconds), full_log
    if re.search(r"^TIMEOUT\s*$", run_log, re.M):
        return SimResult("timeout", detail="the testbench's own time limit fired (TIMEOUT)", log_tail=log,
                         seconds=seconds), full_log
    found = _MISMATCH_RE.findall(run_log)
    if not found:
        return SimResult("runtime_error", detail=f"no 'Mismatches: N in M samples' line (vvp exit code {rc})",
                         log_tail=log, seconds=seconds), full_log
    n_bad, n_samples = map(int, found[-1])
    if n_samples == 0:
        return SimResult("runtime_error", mismatches=n_bad, samples=0, detail="the testbench checked 0 samples",
                         log_tail=log, seconds=seconds), full_log
    category = "pass" if n_bad == 0 else "mismatch"
    detail = "" if n_bad == 0 else f"{n_bad} of {n_samples} samples differ from the reference"
    return SimResult(category, mismatches=n_bad, samples=n_samples, detail=detail, log_tail=log,
                     seconds=seconds), full_log


# VerilogEval's failure letters, as its analyzer (NVlabs/verilog-eval scripts/sv-iv-analyze) assigns them, so a
# result can be compared with published tables line by line.
OFFICIAL_LETTERS = {
    ".": "pass",
    "S": "syntax error",
    "e": "an assignment that needs an explicit cast",
    "0": "a sized constant of size zero",
    "n": "a process with no sensitivities, which never triggers (a warning; it fails even if the output is right)",
    "w": "a wire assigned like a reg ('is declared here as wire')",
    "m": "unknown module type (no TopModule, e.g. no code)",
    "p": "a signal that cannot be bound (undeclared wire/reg)",
    "c": "clk cannot be bound (the design uses a clock its interface lacks)",
    "T": "timeout (the harness's 30 s limit or the testbench's own TIMEOUT)",
    "C": "another compile error",
    "r": "a runtime failure in a design with a reset edge in a sensitivity list",
    "R": "another runtime failure (mismatches, or no result line)",
}
# Per log line, in this order; the first line that matches one decides.
_OFFICIAL_DECISIVE = (
    ("S", ("syntax error",)),
    ("e", ("error: This assignment requires an explicit cast",)),
    ("0", ("error: Sized numeric constant must have a size greater than zero",)),
    ("n", ("warning: always_comb process has no sensitivities", "found no sensitivities so it will never trigger")),
    ("w", ("is declared here as wire",)),
    ("m", ("Unknown module type",)),
    ("c", ("Unable to bind wire/reg/memory `clk'",)),
    ("T", ("TIMEOUT",)),
)
_OFFICIAL_RESULT_RE = re.compile(r"Mismatches: (\d+) in \d+ samples$")
_RESET_EDGES = ("posedge reset", "negedge reset", "posedge r)")


def official_letter(log: str, sample_code: str | None = None) -> str:
    """VerilogEval's letter for one sample, from its whole iverilog + vvp log (see :data:`OFFICIAL_LETTERS`).

    The rules are the official analyzer's: the first log line with a decisive message gives its letter; else any
    "Unable to bind wire/reg" is ``p``, any other line with "error" is ``C``, a ``Mismatches: 0 in M samples`` line
    is a pass (``.``, even with M = 0); else a runtime failure, ``r`` when the sample's code has a reset edge.
    """
    unbound = compile_error = clean = False
    for line in log.splitlines():
        for letter, needles in _OFFICIAL_DECISIVE:
            if any(needle in line for needle in needles):
                return letter
        compile_error |= "error" in line
        unbound |= "Unable to bind wire/reg" in line
        m = _OFFICIAL_RESULT_RE.match(line)
        clean |= m is not None and int(m.group(1)) == 0
    if unbound:
        return "p"
    if compile_error:
        return "C"
    if clean:
        return "."
    return "r" if any(edge in (sample_code or "") for edge in _RESET_EDGES) else "R"


# ---------------------------------------------------------------------------
# pass@k and scoring
# ---------------------------------------------------------------------------

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` pass: 1 - C(n-c, k) / C(n, k).

    Computed as ``1 - prod(1 - k / i for i in n-c+1..n)``, which stays finite and accurate for large n.
    """
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or int(v) != v:
            raise ValueError(f"pass_at_k: {name} must be an integer, got {v!r}")
    n, c, k = int(n), int(c), int(k)
    if n < 1 or k < 1:
        raise ValueError(f"pass_at_k needs n >= 1 and k >= 1 (got n={n}, k={k})")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n (got c={c}, n={n})")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem; got n={n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def _completion_rows(completions) -> list[dict]:
    if hasattr(completions, "to_dict"):  # a DataFrame
        completions = completions.to_dict("records")
    rows, counters = [], {}
    for i, row in enumerate(completions):
        if "task_id" not in row or "completion" not in row:
            raise EvalError(f"completion row {i} lacks 'task_id' or 'completion' (it has {sorted(row)})")
        task = row["task_id"]
        idx = row.get("sample_index")
        if idx is None or (isinstance(idx, float) and math.isnan(idx)):
            idx = counters.get(task, 0)
        counters[task] = max(counters.get(task, 0), int(idx) + 1)
        rows.append({"task_id": task, "sample_index": int(idx), "completion": row["completion"] or "",
                     "finish_reason": row.get("finish_reason")})
    return rows


def _score_one(row: dict, problem: Problem, timeout: float) -> dict:
    code = extract_verilog(row["completion"])
    res = simulate(code, problem, timeout=timeout)
    return {"task_id": row["task_id"], "sample_index": row["sample_index"], **res.as_dict(),
            "finish_reason": row["finish_reason"], "completion": row["completion"]}


def pass_at_k_table(results, ks: Sequence[int] = (1, 5)) -> dict[int, float]:
    """Mean pass@k over the tasks in ``results``; NaN for a k larger than some task's sample count."""
    per_task = results.groupby("task_id")["passed"].agg(["count", "sum"])
    out = {}
    for k in ks:
        if (per_task["count"] < k).any():
            out[k] = float("nan")
        else:
            out[k] = float(sum(pass_at_k(int(n), int(c), k) for n, c in zip(per_task["count"], per_task["sum"]))
                           / len(per_task))
    return out


def score_completions(problems: Sequence[Problem], completions, ks: Sequence[int] = (1, 5),
                      timeout: float = DEFAULT_TIMEOUT, workers: int = 2, progress: bool = True):
    """Simulate every completion and compute pass@k.

    ``completions``: rows (dicts or a DataFrame) with ``task_id`` and ``completion`` (optional
    ``sample_index``); several rows per task are its n samples. Returns ``(results, scores)``: one row per sample
    (``task_id, sample_index, category, passed, mismatches, samples, detail, log_tail, seconds, finish_reason,
    completion``) and
    ``{k: pass@k}``, the mean over the tasks that have completions (NaN where a task has fewer than k samples).
    """
    import pandas as pd
    from tqdm.auto import tqdm

    by_id = {p.task_id: p for p in problems}
    rows = _completion_rows(completions)
    if not rows:
        raise EvalError("no completions to score")
    unknown = sorted({r["task_id"] for r in rows} - set(by_id))
    if unknown:
        raise EvalError(f"completions for unknown task id(s) {unknown[:5]}{' ...' if len(unknown) > 5 else ''}; "
                        f"the problem set has e.g. {sorted(by_id)[:3]}")
    simulator_tools()  # fail once, clearly, before starting the pool
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(_score_one, r, by_id[r["task_id"]], timeout) for r in rows]
        for _ in tqdm(concurrent.futures.as_completed(futures), total=len(futures), desc="simulate",
                      disable=not progress):
            pass
        out = [f.result() for f in futures]
    results = pd.DataFrame(out).sort_values(["task_id", "sample_index"], kind="stable").reset_index(drop=True)
    results = results.astype({"mismatches": "Int64", "samples": "Int64"})  # missing stays <NA>, not a float NaN
    return results, pass_at_k_table(results, ks)


def records(results) -> list[dict]:
    """``results`` as plain JSON-ready dicts (missing values as None, numpy scalars as Python numbers)."""
    import pandas as pd

    def clean(v):
        if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
            return None
        return v.item() if hasattr(v, "item") else v

    return [{k: clean(v) for k, v in row.items()} for row in results.to_dict("records")]


def results_table(results, ks: Sequence[int] = (1, 5)):
    """Per task: samples, passes, pass@k (NaN where n < k), the count of each failure category and ``official``,
    the samples' VerilogEval letters in order, in groups of five as its analyzer prints them (e.g. ``..S.R .T``)."""
    import pandas as pd

    rows = []
    for task_id, g in results.groupby("task_id", sort=True):
        n, c = len(g), int(g["passed"].sum())
        row = {"task_id": task_id, "n": n, "passed": c}
        for k in ks:
            row[f"pass@{k}"] = pass_at_k(n, c, k) if k <= n else float("nan")
        counts = g["category"].value_counts()
        row.update({cat: int(counts.get(cat, 0)) for cat in CATEGORIES if cat != "pass"})
        if "official" in g:
            letters = "".join(g.sort_values("sample_index")["official"])
            row["official"] = " ".join(letters[i:i + 5] for i in range(0, len(letters), 5))
        rows.append(row)
    return pd.DataFrame(rows)


def category_counts(results):
    """How many samples fell in each category (all categories, in a fixed order)."""
    return results["category"].value_counts().reindex(list(CATEGORIES), fill_value=0)


def failure_chart(results, ax=None, title: str | None = None):
    """Bar chart of the outcome categories (pass included, for scale). Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    counts = category_counts(results)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    colors = ["#2a9d8f" if c == "pass" else "#e76f51" for c in counts.index]
    bars = ax.bar(counts.index, counts.values, color=colors)
    ax.bar_label(bars)
    ax.set_ylabel("samples")
    ax.set_title(title or f"Outcomes of {int(counts.sum())} samples")
    ax.tick_params(axis="x", rotation=20)
    ax.figure.tight_layout()
    return ax


# ---------------------------------------------------------------------------
# Calibration: the toolchain's ceiling on a problem set
# ---------------------------------------------------------------------------

# The official protocol (VerilogEval v2's README): pass@1 from n=1 at temperature 0 (top_p 0.01), and from n=20 at
# temperature 0.85 (top_p 0.95), with no top-k. Its own generator defaults to max_tokens 1024; a reasoning model needs
# more. top_k is sent because vLLM fills a request's unset sampling fields from the served checkpoint's
# generation_config.json (Gemma 4: top_k 64, top_p 0.95); 0 is vLLM's "no top-k" (SamplingParams.top_k).
NO_TOP_K = 0
PRESETS = {
    "official-greedy": {"n": 1, "temperature": 0.0, "top_p": 0.01, "top_k": NO_TOP_K},
    "official-sampled": {"n": 20, "temperature": 0.85, "top_p": 0.95, "top_k": NO_TOP_K},
}
CALIBRATION_GLOB = "calibration-*-iverilog-{version}.json"


def reference_code(problem: Problem) -> str:
    """The problem's reference renamed ``TopModule``: a correct design by construction."""
    return re.sub(r"\bRefModule\b", "TopModule", problem.ref)


def _task_digest(problem: Problem) -> str:
    h = hashlib.sha256()
    for part in (problem.task_id, problem.ref, problem.test):  # the prompt does not change what simulates
        h.update(part.encode("utf-8") + b"\0")
    return h.hexdigest()


def problems_digest(problems: Sequence[Problem]) -> str:
    """SHA-256 over every problem's id, reference and testbench: what a calibration depends on, with the simulator."""
    h = hashlib.sha256()
    for p in sorted(problems, key=lambda p: p.task_id):
        h.update(_task_digest(p).encode())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Each reference scored as a completion: which problems a correct design can pass with this toolchain."""

    simulator: str  # the Icarus Verilog version, e.g. "12.0"
    timeout: float
    digest: str  # problems_digest of the set it was run on
    references: dict  # task_id -> {"digest", "category", "official", "detail", "seconds"}
    path: Path | None = None  # its cache file, when it has one

    @property
    def calibrated(self) -> list[str]:
        """The problems whose reference passes: the set a model can be fairly scored on."""
        return sorted(t for t, r in self.references.items() if r["category"] == "pass")

    @property
    def excluded(self) -> list[str]:
        """The problems whose own reference fails here (a toolchain limit, not a model failure)."""
        return sorted(t for t, r in self.references.items() if r["category"] != "pass")

    def ceiling(self, task_ids: Iterable[str] | None = None) -> float:
        """The best pass@k a perfect model can reach on ``task_ids`` (default: all calibrated problems)."""
        ids = list(self.references) if task_ids is None else list(task_ids)
        return sum(self.references[t]["category"] == "pass" for t in ids) / len(ids)

    def covers(self, problems: Sequence[Problem]) -> bool:
        """True when every problem was calibrated here with the same reference and testbench."""
        return all(self.references.get(p.task_id, {}).get("digest") == _task_digest(p) for p in problems)

    def table(self):
        """One row per problem whose reference fails: ``task_id, category, official, detail``."""
        import pandas as pd

        rows = [{"task_id": t, **{k: self.references[t][k] for k in ("category", "official", "detail")}}
                for t in self.excluded]
        return pd.DataFrame(rows, columns=["task_id", "category", "official", "detail"])

    def summary(self) -> str:
        n, ok = len(self.references), len(self.calibrated)
        return (f"calibration: {ok} of {n} references pass as completions with Icarus Verilog {self.simulator} "
                f"(ceiling {self.ceiling():.4f}); {n - ok} fail with a correct design"
                + (f": {', '.join(self.excluded)}" if self.excluded else ""))

    def as_dict(self) -> dict:
        return {"simulator": self.simulator, "timeout": self.timeout, "digest": self.digest,
                "references": self.references}


def load_calibration(path: str | os.PathLike) -> Calibration:
    """A calibration cache file written by :func:`calibrate`."""
    path = Path(path)
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        return Calibration(simulator=d["simulator"], timeout=float(d["timeout"]), digest=d["digest"],
                           references=d["references"], path=path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EvalError(f"{path} is not a readable calibration file ({type(e).__name__}: {e}); delete it and run "
                        f"`eval --calibrate` again") from None


def calibrate(problems: Sequence[Problem], cache_dir: str | os.PathLike | None = None,
              timeout: float = DEFAULT_TIMEOUT, workers: int = 2, refresh: bool = False,
              progress: bool = True) -> Calibration:
    """Score every problem's reference as a completion: the toolchain's ceiling on this problem set.

    A reference that fails (a construct the simulator does not support, a testbench that times out, a testbench
    that does not compile) marks a problem no model can pass with this toolchain; later scores are also given
    over the calibrated rest. With ``cache_dir`` the result is kept in
    ``cache_dir/calibration-<problems digest>-iverilog-<version>.json`` and reused (same problems, simulator
    version and timeout) unless ``refresh``.
    """
    from tqdm.auto import tqdm

    if not problems:
        raise EvalError("no problems to calibrate")
    version = simulator_version()
    digest = problems_digest(problems)
    path = (Path(cache_dir) / CALIBRATION_GLOB.format(version=version).replace("*", digest[:16])
            if cache_dir is not None else None)
    if path is not None and path.is_file() and not refresh:
        cached = load_calibration(path)
        if cached.digest == digest and cached.simulator == version and cached.timeout == timeout:
            return cached
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = {pool.submit(simulate, reference_code(p), p, timeout): p for p in problems}
        for _ in tqdm(concurrent.futures.as_completed(futures), total=len(futures), desc="calibrate",
                      disable=not progress):
            pass
    refs = {}
    for future, p in futures.items():
        r = future.result()
        refs[p.task_id] = {"digest": _task_digest(p), "category": r.category, "official": r.official,
                           "detail": r.detail, "seconds": round(r.seconds, 3)}
    cal = Calibration(version, float(timeout), digest, dict(sorted(refs.items())), path)
    if path is not None:
        infra.write_atomic(path, json.dumps(cal.as_dict(), indent=1, sort_keys=True) + "\n")
    return cal


def find_calibration(problems: Sequence[Problem], cache_dir: str | os.PathLike | None) -> Calibration | None:
    """The newest cached calibration in ``cache_dir`` that covers ``problems`` with the current simulator, or None."""
    if cache_dir is None or not Path(cache_dir).is_dir():
        return None
    files = sorted(Path(cache_dir).glob(CALIBRATION_GLOB.format(version=simulator_version())),
                   key=lambda f: f.stat().st_mtime, reverse=True)
    for f in files:
        cal = load_calibration(f)
        if cal.covers(problems):
            return cal
    return None


def score_lines(results, ks: Sequence[int] = (1, 5), calibration: Calibration | None = None) -> list[str]:
    """The printed score: one ``pass@k`` line per k with the simulator version, raw and, given a calibration,
    over the calibrated problems, e.g. ``pass@1: 0.6410 (ceiling 0.9744; 0.6579 over the 152 calibrated
    problems) [iverilog 12.0]``. A version other than the required one adds a warning line."""
    version = simulator_version()
    tasks = sorted(results["task_id"].unique())
    min_n = int(results.groupby("task_id").size().min())
    raw = pass_at_k_table(results, ks)
    ok = None
    if calibration is not None:
        missing = [t for t in tasks if t not in calibration.references]
        if missing:
            raise EvalError(f"the calibration does not cover {missing[:3]}; run `eval --calibrate` on these problems")
        ok = [t for t in tasks if calibration.references[t]["category"] == "pass"]
        over = pass_at_k_table(results[results["task_id"].isin(ok)], ks) if ok else {k: float("nan") for k in ks}
    lines = []
    for k in ks:
        if math.isnan(raw[k]):
            lines.append(f"pass@{k}: n/a (needs >= {k} samples per problem; the fewest is {min_n}) "
                         f"[iverilog {version}]")
            continue
        line = f"pass@{k}: {raw[k]:.4f}"
        if ok is not None:
            line += (f" (ceiling {len(ok) / len(tasks):.4f}; {over[k]:.4f} over the {len(ok)} calibrated problems)"
                     if ok else f" (ceiling 0: no reference passes among these {len(tasks)} problems)")
        lines.append(f"{line} [iverilog {version}]")
    if calibration is not None:
        gone = [t for t in tasks if t not in ok]
        if gone:
            lines.append(f"not counted over the calibrated set (their reference fails with iverilog {version}): "
                         + ", ".join(f"{t} ({calibration.references[t]['category']})" for t in gone))
    letters = results["official"].value_counts() if "official" in results else None
    if letters is not None:
        lines.append("official letters: " + " ".join(f"{l}={int(letters[l])}" for l in OFFICIAL_LETTERS
                                                      if l in letters))
    warning = version_warning(version)
    if warning:
        lines.append(warning)
    return lines


# ---------------------------------------------------------------------------
# Sampling from an OpenAI-compatible server (vLLM)
# ---------------------------------------------------------------------------

def check_server(url: str, model: str | None = None, api_key: str | None = None,
                 connect_timeout: float = 10.0) -> list[str]:
    """The model ids the server lists at ``/v1/models``; a clear :class:`ServerError` within ``connect_timeout``.
    ``url`` is the server's base URL, with or without ``/v1`` (``infra.api_root``)."""
    base = infra.api_root(url)
    try:
        listing = infra.get_json(infra.api_url(base, "models"), api_key, connect_timeout)
    except infra.RequestError as e:
        if e.status is not None:
            raise ServerError(f"The server at {base} answered /v1/models: {e}") from None
        raise ServerError(f"Could not reach an OpenAI-compatible server at {base} within {connect_timeout:g} s "
                          f"({e}). Is vLLM running (notebook 08 starts it)? Check with "
                          f"`curl {base}/v1/models`.") from None
    ids = [m.get("id") for m in listing.get("data", [])]
    if model is not None and ids and model not in ids:
        raise ServerError(f"The server at {base} does not serve model {model!r}; it serves {ids}.")
    return ids


def sample_completions(url: str, model: str, problems: Sequence[Problem], n: int = 1, temperature: float = 0.0,
                       max_tokens: int = 2048, api_key: str | None = None, timeout: float = 600.0,
                       connect_timeout: float = 10.0, top_p: float | None = None, concurrency: int = 8,
                       system_prompt: str | None = SYSTEM_PROMPT, progress: bool = True,
                       stop_token_ids: Sequence[int] | None = None, top_k: int | None = None) -> list[dict]:
    """Ask ``/v1/chat/completions`` for ``n`` answers per problem (one request per problem, ``n`` choices).

    ``top_p``/``top_k``: sent when not None (``top_k`` 0: no top-k); vLLM fills unset ones from the served
    checkpoint's ``generation_config.json`` (Gemma 4: top_k 64, top_p 0.95).

    ``stop_token_ids``: the model's stop ids (``data.stop_token_ids(tokenizer)``: its ``generation_config.json``
    eos ids, ``<eos> <turn|> <|tool_response>`` on Gemma 4); vLLM also reads them from the served checkpoint.

    Returns rows ``task_id, sample_index, completion, finish_reason`` (``finish_reason == "length"``: the answer
    was cut off by ``max_tokens``). The server is checked first, so an unreachable one fails within
    ``connect_timeout`` seconds; ``timeout`` bounds each generation request. ``api_key`` defaults to
    ``$VLLM_API_KEY`` (the variable the vLLM server reads its ``--api-key`` from).
    """
    from tqdm.auto import tqdm

    if n < 1 or max_tokens < 1:
        raise EvalError(f"need n >= 1 and max_tokens >= 1 (got n={n}, max_tokens={max_tokens})")
    if temperature < 0:
        raise EvalError(f"temperature must be >= 0 (got {temperature})")
    api_key = infra.resolve_api_key(api_key)
    check_server(url, model, api_key, connect_timeout)
    endpoint = infra.api_url(url, "chat/completions")

    def one(problem: Problem) -> list[dict]:
        # The server renders the messages with the model's own chat template, thinking off (Gemma 4's default), and
        # keeps special tokens in the answer so a thought channel, if the model opens one, stays recognisable.
        payload = {"model": model, "messages": prompt_messages(problem, system_prompt), "n": n,
                   "temperature": temperature, "max_tokens": max_tokens, "skip_special_tokens": False,
                   "chat_template_kwargs": {"enable_thinking": False}}
        if stop_token_ids:
            payload["stop_token_ids"] = [int(i) for i in stop_token_ids]
        if top_p is not None:
            payload["top_p"] = top_p
        if top_k is not None:
            payload["top_k"] = top_k
        try:
            resp = infra.post_json(endpoint, payload, api_key, timeout)
        except infra.RequestError as e:
            raise ServerError(f"{problem.task_id}: {e}") from None
        choices = sorted(resp.get("choices", []), key=lambda ch: ch.get("index", 0))
        if len(choices) != n:
            raise ServerError(f"{problem.task_id}: asked for n={n} choices, the server returned {len(choices)}")
        return [{"task_id": problem.task_id, "sample_index": i,
                 "completion": (ch.get("message") or {}).get("content") or "",
                 "finish_reason": ch.get("finish_reason")} for i, ch in enumerate(choices)]

    rows: list[dict] = []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, concurrency))
    try:
        futures = [pool.submit(one, p) for p in problems]
        for f in tqdm(concurrent.futures.as_completed(futures), total=len(futures), desc="sample",
                      disable=not progress):
            rows.extend(f.result())
    finally:  # on the first error, drop queued requests and do not wait for the ones in flight
        pool.shutdown(wait=False, cancel_futures=True)
    rows.sort(key=lambda r: (r["task_id"], r["sample_index"]))
    return rows


# ---------------------------------------------------------------------------
# Files and the CLI
# ---------------------------------------------------------------------------

def read_completions(path: str | os.PathLike) -> list[dict]:
    """Rows from a JSONL file with ``task_id`` and ``completion`` per line (a results file works too)."""
    path = Path(path)
    if path.is_dir():
        raise EvalError(f"completions file {path} is a directory; --completions takes a JSONL file (one "
                        f"{{\"task_id\", \"completion\"}} object per line)")
    if not path.is_file():
        raise EvalError(f"completions file {path} does not exist")
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise EvalError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or "task_id" not in row or "completion" not in row:
            raise EvalError(f"{path}:{lineno}: each line needs 'task_id' and 'completion'")
        rows.append(row)
    if not rows:
        raise EvalError(f"{path} holds no completions")
    return rows


def write_jsonl_atomic(path: str | os.PathLike, rows: Iterable[dict], overwrite: bool = False) -> Path:
    """Rows as JSONL, written atomically (``infra.write_lines_atomic``); refuses to replace a file unless asked."""
    return infra.write_lines_atomic(
        path, (json.dumps(row, default=_json_default, allow_nan=False) + "\n" for row in rows), overwrite=overwrite)


def _json_default(o):
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _parse_ks(text) -> list[int]:
    if isinstance(text, (list, tuple)):
        return [int(k) for k in text]
    try:
        ks = [int(k) for k in str(text).split(",") if k.strip()]
    except ValueError:
        raise EvalError(f"--k takes comma-separated integers such as 1,5 (got {text!r})") from None
    if not ks or any(k < 1 for k in ks):
        raise EvalError(f"--k takes positive integers such as 1,5 (got {text!r})")
    return ks


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``eval`` sub-command's arguments."""
    p.add_argument("--problems", type=infra.cli_path, default=None,
                   help="folder in the VerilogEval v2 layout (default: the 28 shipped problems)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000 (vLLM)")
    src.add_argument("--completions", type=infra.cli_path, help="JSONL with task_id and completion per line (a results file works too)")
    src.add_argument("--calibrate", action="store_true",
                     help="score every reference as a completion: the toolchain's ceiling on --problems, cached in "
                          "RUN_DIR/eval per (problems, iverilog version) and used by later scores on them")
    p.add_argument("--model", help="model name on the server (with --url)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
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
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help="seconds per simulation, as VerilogEval's `timeout 30` (the compile gets as long again)")
    p.add_argument("--workers", type=int, default=2, help="parallel simulations")
    p.add_argument("--out", type=infra.cli_path, default=None, help="write per-sample results here (JSONL)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out file; with --calibrate, redo a cached calibration")
    p.add_argument("--run-dir", type=infra.cli_path, default=None,
                   help="run directory whose eval/ holds the calibrations (the course's default: runs/<profile>)")
    return p


def _sampling(args) -> dict:
    """n, temperature, top_p and top_k from --preset and the explicit flags (a flag may not contradict the
    preset). Without a preset: greedy, n 1, no top-k, top_p unset."""
    chosen = dict(PRESETS[args.preset]) if getattr(args, "preset", None) else {"n": 1, "temperature": 0.0,
                                                                                "top_p": None, "top_k": NO_TOP_K}
    for key in ("n", "temperature", "top_p", "top_k"):
        given = getattr(args, key, None)
        if given is None:
            continue
        if getattr(args, "preset", None) and given != chosen[key]:
            flag = "--" + key.replace("_", "-")
            raise EvalError(f"--preset {args.preset} sets {flag} {chosen[key]}; drop {flag} {given} or the preset")
        chosen[key] = given
    return chosen


def _calibration_dir(args) -> Path | None:
    """RUN_DIR/eval, where calibrations are kept (None without --run-dir: nothing cached)."""
    return Path(args.run_dir) / "eval" if getattr(args, "run_dir", None) else None


def main_eval(args) -> int:
    """``eval``: sample (``--url``) or read (``--completions``) answers, simulate them, print pass@k with the
    simulator version, raw and over the calibrated problems; or ``--calibrate`` the problem set first."""
    ks = _parse_ks(args.k or ("1" if getattr(args, "preset", None) else "1,5"))
    if args.out and Path(args.out).exists() and not args.overwrite:
        raise EvalError(f"{args.out} exists; pass --overwrite to replace it")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if getattr(args, "tasks", None) else None
    problems = load_problems(args.problems, tasks=tasks)
    simulator_tools()
    version = simulator_version()
    print(f"simulator: Icarus Verilog {version} ({simulator_tools()[0]})")
    cache_dir = _calibration_dir(args)
    if getattr(args, "calibrate", False):
        if cache_dir is None:
            raise EvalError("--calibrate keeps its result in RUN_DIR/eval: pass --run-dir DIR")
        cal = calibrate(problems, cache_dir, timeout=args.timeout, workers=args.workers, refresh=args.overwrite)
        print(cal.summary())
        for row in cal.table().itertuples():
            print(f"  {row.task_id}: {row.category} [{row.official}] {row.detail}")
        print(f"cached in {cal.path}")
        warning = version_warning(version)
        if warning:
            print(warning, file=sys.stderr)
        return 0
    if args.url:
        if not args.model:
            raise EvalError("--url needs --model (the name the server serves; see `curl URL/v1/models`)")
        sampling = _sampling(args)
        completions = sample_completions(args.url, args.model, problems, n=sampling["n"],
                                         temperature=sampling["temperature"], max_tokens=args.max_tokens,
                                         api_key=args.api_key, timeout=args.request_timeout,
                                         top_p=sampling["top_p"], top_k=sampling["top_k"])
    else:
        completions = read_completions(args.completions)
    results, _ = score_completions(problems, completions, ks=ks, timeout=args.timeout, workers=args.workers)
    scored = [p for p in problems if p.task_id in set(results["task_id"])]
    calibration = find_calibration(scored, cache_dir)
    lines = score_lines(results, ks, calibration)
    if args.out:
        write_jsonl_atomic(args.out, records(results), overwrite=args.overwrite)
        print(f"wrote {len(results)} results to {args.out}")
    counts = category_counts(results)
    n_tasks = results["task_id"].nunique()
    print(f"scored {len(results)} samples on {n_tasks} of {len(problems)} problems: "
          + ", ".join(f"{c}={int(v)}" for c, v in counts.items()))
    for line in lines:
        print(line, file=sys.stderr if line.startswith("warning:") else sys.stdout)
    if calibration is None:
        where = f" --problems {args.problems}" if args.problems else ""
        print(f"no calibration for these problems with iverilog {version} in {cache_dir or '(no --run-dir)'}: run "
              f"`eval --calibrate{where}` once to see which problems a correct design cannot pass here")
    else:
        print(f"calibration: {calibration.path}")
    return 0


def main(argv=None) -> int:
    p = add_arguments(argparse.ArgumentParser(prog="python -m gemma_tpu_helpers.fixes.evaluate",
                                              description=main_eval.__doc__))
    return run_cli(main_eval, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
