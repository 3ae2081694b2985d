"""Run one answer through VerilogEval's harness with Icarus Verilog (``iverilog -g2012 -s tb``, then ``vvp``) and
sort the outcome: pass, mismatch, compile_error, runtime_error, timeout or no_code, and VerilogEval's own letter.
Icarus is found on PATH (or pass its path): VerilogEval v2 requires version 12."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from ..core import process_groups
from .eval_problems import EvalError, Problem

IVERILOG_FLAGS = ("-Wall", "-Winfloop", "-Wno-timescale", "-g2012", "-s", "tb")


CATEGORIES = ("pass", "mismatch", "compile_error", "runtime_error", "timeout", "no_code")


DEFAULT_TIMEOUT = 30.0  # seconds for the simulation (VerilogEval's `timeout 30 vvp`), and again for the compile


LOG_TAIL_CHARS = 2000


MAX_LOG_BYTES = 8 * 1024 * 1024  # a sample that floods stdout is stopped here


# VerilogEval v2 requires Icarus Verilog 12 (its README; 13, the development branch, is unsupported).
REQUIRED_IVERILOG = "12"


BUILD_HINT = ("build Icarus Verilog 12.0 from its source (github.com/steveicarus/iverilog, tag v12_0: ./configure, "
              "make, make install), or `conda install -c conda-forge iverilog=12`")
INSTALL_HINT = (f"Install Icarus Verilog 12 and put it first on PATH: {BUILD_HINT} (`apt-get install iverilog` gives "
                f"11 on Debian 12 / Ubuntu 22.04; `brew install icarus-verilog`).")


_MISMATCH_RE = re.compile(r"^Mismatches: (\d+) in (\d+) samples\s*$", re.M)


class IverilogNotFoundError(EvalError):
    pass


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


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def simulator_tools(iverilog: str | os.PathLike | None = None) -> tuple[str, str]:
    """``(iverilog, vvp)`` from one installation: ``iverilog`` if given, else the first on PATH.

    vvp is taken from beside iverilog when it is there: a vvp of another version cannot run iverilog's output.
    """
    if iverilog is not None:
        if not _executable(Path(iverilog)):
            raise IverilogNotFoundError(f"{str(iverilog)!r} is not an executable file: give the path of an iverilog "
                                        f"binary. {INSTALL_HINT}")
        iverilog = str(iverilog)
    else:
        iverilog = shutil.which("iverilog")
    if iverilog is None:
        raise IverilogNotFoundError(f"`iverilog` is not on PATH; the VerilogEval harness needs Icarus Verilog. "
                                    f"{INSTALL_HINT}")
    beside = Path(iverilog).parent / "vvp"
    vvp = str(beside) if _executable(beside) else shutil.which("vvp")
    if vvp is None:
        raise IverilogNotFoundError(f"`vvp` (Icarus Verilog's simulator) was not found beside {iverilog} nor on "
                                    f"PATH. {INSTALL_HINT}")
    return iverilog, vvp


_VERSIONS: dict[tuple[str, float], str] = {}


def simulator_version(iverilog: str | os.PathLike | None = None) -> str:
    """The version of ``iverilog`` (default: the first on PATH), e.g. ``"12.0"`` (from ``iverilog -V``)."""
    iverilog, _ = simulator_tools(iverilog)
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


def version_warning(version: str | None = None, iverilog: str | os.PathLike | None = None) -> str | None:
    """A warning when ``version`` (default: ``iverilog``'s) is not the one VerilogEval v2 requires (12), else None."""
    version = version or simulator_version(iverilog)
    if version.split(".")[0] == REQUIRED_IVERILOG:
        return None
    return (f"warning: scored with Icarus Verilog {version}, but VerilogEval v2 requires version "
            f"{REQUIRED_IVERILOG} (13 is unsupported). Scores on the real benchmark differ between versions: of its "
            f"156 references, 151 pass with 11.0 and 152 with 12.0. Fix: {BUILD_HINT}.")


def _run(cmd: list[str], cwd: str, deadline: float, log_path: Path) -> tuple[int | None, str]:
    """Run ``cmd`` in its own process group with output to a file; None as exit code on timeout or flood."""
    proc = process_groups.start_group(cmd, log_path, cwd=cwd)
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
                process_groups.stop_group(proc, grace=0)  # no grace: a runaway simulation has nothing to save
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
    lines = [line for line in log.splitlines() if line.strip()]
    return lines[0].strip() if lines else ""


def simulate(sample_code: str | None, problem: Problem, timeout: float = DEFAULT_TIMEOUT,
             iverilog: str | os.PathLike | None = None) -> SimResult:
    """Run one sample through the official VerilogEval harness and classify it (``official``: VerilogEval's letter).
    ``sample_code`` must define ``module TopModule``; ``timeout`` bounds the simulation (VerilogEval's ``timeout 30``)
    and the compile separately, killing the process group on expiry. ``iverilog``: its path (vvp beside it), default
    the first on PATH."""
    result, full_log = _simulate(sample_code, problem, timeout, iverilog)
    # No code: VerilogEval compiles an empty sample, and its testbench then finds no TopModule ('m').
    result.official = "m" if result.category == "no_code" else official_letter(full_log, sample_code)
    return result


def _simulate(sample_code: str | None, problem: Problem, timeout: float, iverilog=None) -> tuple[SimResult, str]:
    """:func:`simulate`'s result and the whole iverilog + vvp log (with TIMEOUT appended when it was killed)."""
    start = time.monotonic()
    if sample_code is None or not sample_code.strip():
        return SimResult("no_code", detail="no Verilog module in the completion"), ""
    iverilog, vvp = simulator_tools(iverilog)
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

