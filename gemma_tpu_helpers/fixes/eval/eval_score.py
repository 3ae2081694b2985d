"""Score answers: the unbiased pass@k, one row per simulated sample, and the simulator's ceiling (a calibration:
which references pass as answers), printed beside each pass@k."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Iterable, Sequence

from ..core import file_io
from .eval_problems import EvalError, Problem, extract_verilog, problems_digest, reference_code, task_digest
from .eval_simulate import (
    CATEGORIES,
    DEFAULT_TIMEOUT,
    OFFICIAL_LETTERS,
    simulate,
    simulator_tools,
    simulator_version,
    version_warning,
)


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


SAMPLING_KEYS = ("temperature", "top_p", "top_k")  # kept with each result when the completions carry them


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
                     "finish_reason": row.get("finish_reason"), **{k: row[k] for k in SAMPLING_KEYS if k in row}})
    return rows


def _score_one(row: dict, problem: Problem, timeout: float, iverilog) -> dict:
    code = extract_verilog(row["completion"])
    res = simulate(code, problem, timeout=timeout, iverilog=iverilog)
    return {"task_id": row["task_id"], "sample_index": row["sample_index"], **res.as_dict(),
            "finish_reason": row["finish_reason"], **{k: row[k] for k in SAMPLING_KEYS if k in row},
            "completion": row["completion"]}


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
                      timeout: float = DEFAULT_TIMEOUT, workers: int = 2, progress: bool = True,
                      iverilog: str | os.PathLike | None = None):
    """Simulate every completion; return ``(results, {k: pass@k})``: one row per sample, and the mean over the tasks
    (NaN where a task has fewer than k samples). ``completions``: rows (dicts or a DataFrame) with ``task_id`` and
    ``completion``; several rows per task are its n samples. ``iverilog``: its path (default: the first on PATH)."""
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
    simulator_tools(iverilog)  # fail once, clearly, before starting the pool
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(_score_one, r, by_id[r["task_id"]], timeout, iverilog) for r in rows]
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


def category_counts(results):
    """How many samples fell in each category (all categories, in a fixed order)."""
    return results["category"].value_counts().reindex(list(CATEGORIES), fill_value=0)


CALIBRATION_GLOB = "calibration-*-iverilog-{version}.json"


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
        return all(self.references.get(p.task_id, {}).get("digest") == task_digest(p) for p in problems)

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
        raise EvalError(f"{path} is not a readable calibration file ({type(e).__name__}: {e}); delete it and "
                        f"calibrate again (calibrate(problems, cache_dir=...))", params=("calibrate",),
                        path=path) from None


def calibrate(problems: Sequence[Problem], cache_dir: str | os.PathLike | None = None,
              timeout: float = DEFAULT_TIMEOUT, workers: int = 2, refresh: bool = False,
              progress: bool = True, iverilog: str | os.PathLike | None = None) -> Calibration:
    """Score every problem's reference as a completion: a failing one marks a problem no model can pass with this
    toolchain (``iverilog``: its path, default the first on PATH). With ``cache_dir`` the result is cached per
    problem set, simulator version and timeout, and reused unless ``refresh``."""
    from tqdm.auto import tqdm

    if not problems:
        raise EvalError("no problems to calibrate")
    version = simulator_version(iverilog)
    digest = problems_digest(problems)
    path = (Path(cache_dir) / CALIBRATION_GLOB.format(version=version).replace("*", digest[:16])
            if cache_dir is not None else None)
    if path is not None and path.is_file() and not refresh:
        cached = load_calibration(path)
        if cached.digest == digest and cached.simulator == version and cached.timeout == timeout:
            return cached
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = {pool.submit(simulate, reference_code(p), p, timeout, iverilog): p for p in problems}
        for _ in tqdm(concurrent.futures.as_completed(futures), total=len(futures), desc="calibrate",
                      disable=not progress):
            pass
    refs = {}
    for future, p in futures.items():
        r = future.result()
        refs[p.task_id] = {"digest": task_digest(p), "category": r.category, "official": r.official,
                           "detail": r.detail, "seconds": round(r.seconds, 3)}
    cal = Calibration(version, float(timeout), digest, dict(sorted(refs.items())), path)
    if path is not None:
        file_io.write_atomic(path, json.dumps(cal.as_dict(), indent=1, sort_keys=True) + "\n")
    return cal


def find_calibration(problems: Sequence[Problem], cache_dir: str | os.PathLike | None,
                     iverilog: str | os.PathLike | None = None) -> Calibration | None:
    """The newest cached calibration in ``cache_dir`` that covers ``problems`` with ``iverilog``'s version (default:
    the first on PATH), or None."""
    if cache_dir is None or not Path(cache_dir).is_dir():
        return None
    files = sorted(Path(cache_dir).glob(CALIBRATION_GLOB.format(version=simulator_version(iverilog))),
                   key=lambda f: f.stat().st_mtime, reverse=True)
    for f in files:
        cal = load_calibration(f)
        if cal.covers(problems):
            return cal
    return None


def score_lines(results, ks: Sequence[int] = (1, 5), calibration: Calibration | None = None,
                iverilog: str | os.PathLike | None = None) -> list[str]:
    """The printed score: one ``pass@k`` line per k, raw and, given a calibration, over the calibrated problems,
    with ``iverilog``'s version (default: the first on PATH's; a warning line for another version than 12)."""
    version = simulator_version(iverilog)
    tasks = sorted(results["task_id"].unique())
    min_n = int(results.groupby("task_id").size().min())
    raw = pass_at_k_table(results, ks)
    ok = None
    if calibration is not None:
        missing = [t for t in tasks if t not in calibration.references]
        if missing:
            raise EvalError(f"the calibration does not cover {missing[:3]}; calibrate these problems first "
                            f"(calibrate(problems, cache_dir=...))", params=("calibrate",))
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
        lines.append("official letters: " + " ".join(f"{c}={int(letters[c])}" for c in OFFICIAL_LETTERS
                                                      if c in letters))
    warning = version_warning(version)
    if warning:
        lines.append(warning)
    return lines
