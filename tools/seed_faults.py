"""Seeded faults: does the test suite catch real bugs?

Each fault is one exact text edit in one source file of ``gemma_tpu_helpers/``: a mistake a developer could make,
which keeps the package importable. For each, this script copies the working tree (tracked and untracked files that
git does not ignore: uncommitted changes included, no .venv or runs/) to a temporary directory, applies the edit
there, runs pytest in the copy with the venv's python (the copy's package first on the path), records the tests that
failed or errored, and deletes the copy. It prints a markdown table: fault | file | caught by | seconds.

Make the table again (from the repository root; the venv from `make setup`):

    python tools/seed_faults.py --check-anchors                  # each fault's anchor is found exactly once (fast)
    python tools/seed_faults.py --baseline --selection tests/fast  # make check's tier: a clean run, then each fault
    python tools/seed_faults.py --baseline --selection tests       # the full suite (hours)
    python tools/seed_faults.py --only merge-scale-alpha --selection "tests/test_merge.py -m 'not slow'"

A stale fault (its anchor text not found exactly once, because the code moved) stops the script with the fault's
name: update the fault's ``anchor`` and ``replacement`` below. ``--only none`` runs the clean baseline alone; a
baseline that fails stops the script, since a table over a red suite says nothing. Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SKIP_DIRS = (".venv", ".venv-serve", "runs")  # never copied, even where git does not ignore them


@dataclasses.dataclass(frozen=True)
class Fault:
    name: str
    file: str  # relative to the repository root
    anchor: str  # must occur exactly once in the file
    replacement: str
    why: str  # one line: the bug this models


FAULTS: tuple[Fault, ...] = (
    Fault(
        "lora-table-loses-k_einsum",
        "gemma_tpu_helpers/fixes/model/layout.py",
        '    Row("k_proj", "attn/k_einsum", "w", "self_attn.k_proj", lambda L: (L.k, L.d, L.h),\n'
        '        lambda L, r: (L.d, r), lambda L, r: (r, L.k, L.h), lambda L: L.k_eq_v and not L.kv_shared,\n'
        '        note="global k=v layer: K only (it is also V); regexes without k_einsum miss it"),\n',
        "",
        "the layout table has no row for the global k=v layers' attn/k_einsum: their K gets no LoRA (the paper's "
        "regex bug), and nothing raises",
    ),
    Fault(
        "loss-mask-covers-prompt",
        "gemma_tpu_helpers/fixes/train/chat_tokens.py",
        "    mask[len(p_ids):] = 1\n",
        "    mask[:] = 1\n",
        "the assistant-only loss mask is 1 on every token, so the prompt is trained on too",
    ),
    Fault(
        "merge-skips-a-tensor",
        "gemma_tpu_helpers/fixes/export/merge_plan.py",
        "        for row in rows:\n",
        "        for row in rows[:1]:\n",
        "one ΔW per tunix module: kv_einsum's second row (v_proj, B[:, 1]) is silently left out of the merge",
    ),
    Fault(
        "merge-scale-alpha",
        "gemma_tpu_helpers/fixes/export/merge_plan.py",
        "    scale = alpha / rank\n",
        "    scale = alpha\n",
        "the merge scales ΔW by alpha instead of alpha/rank (right only at rank 1)",
    ),
    Fault(
        "serve-base-not-merged",
        "gemma_tpu_helpers/course/training/learning_check.py",
        '    after = answers(done.model_dir, "after")\n',
        '    after = answers(base_model.ensure_base(profile), "after")\n',
        "the learning check serves (and scores) the base model after training instead of the merged one",
    ),
    Fault(
        "sigterm-exits-without-saving",
        "gemma_tpu_helpers/course/training/train.py",
        "        trainer.close()  # the last metrics line, the step's checkpoint if not saved yet, Orbax closed\n",
        "        trainer.checkpoint_manager.close()  # Orbax closed\n",
        "on SIGTERM (preemption) training closes Orbax without saving the step in progress: the work since the "
        "last periodic checkpoint is lost",
    ),
    Fault(
        "template-loses-thought-channel",
        "gemma_tpu_helpers/fixes/model/chat_format.py",
        r"  {%- if not thinking -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}" + "\n",
        "",
        "the 31B chat template (the replica's chat_template.jinja) ends its generation prompt at <|turn>model\\n, "
        "without the empty thought channel of the real 26B/31B template",
    ),
    Fault(
        "eot-id-shifted",
        "gemma_tpu_helpers/fixes/model/chat_format.py",
        '    106: "<turn|>",\n',
        '    107: "<turn|>",\n',
        "the replica's tokenizer puts <turn|> at 107, not 106 (an off-by-one in the special-token table): "
        "generation_config's eos 106 no longer ends a turn",
    ),
)
FAULTS += (
    Fault(
        "expert-lora-on-every-expert",
        "gemma_tpu_helpers/fixes/train/expert_lora.py",
        "            delta = _ops()[0](lhs, lora_a.astype(lhs.dtype), lora_b.astype(lhs.dtype), group_sizes,\n",
        "            delta = _ops()[0](lhs, jax.numpy.broadcast_to(lora_a[:1], lora_a.shape).astype(lhs.dtype),\n"
        "                              lora_b.astype(lhs.dtype), group_sizes,\n",
        "the experts' LoRA A is applied as one shared matrix (expert 0's) to every routed row, not per expert",
    ),
    Fault(
        "expert-lora-weight-grads-untied",
        "gemma_tpu_helpers/fixes/train/expert_lora.py",
        "        return (*jax.lax.optimization_barrier((dx, da, db)), None)\n",
        "        return dx, da, db, None\n",
        "the experts' LoRA backward leaves dA and dB untied from dx: XLA:TPU computes them at the end of the step and "
        "holds every layer's routed rows until then (0.59 GiB a layer on a v6e-4)",
    ),
    Fault(
        "megablox-rows-not-cut-per-shard",
        "gemma_tpu_helpers/fixes/train/expert_lora.py",
        "            gs = (jnp.clip(ends, lo, lo + m) - jnp.clip(ends - gs, lo, lo + m)).astype(jnp.int32)\n",
        "            gs = gs.astype(jnp.int32)\n",
        "each fsdp shard of the TPU's grouped matmul reads the whole step's group sizes for its half of the rows: "
        "rows meet other experts' matrices",
    ),
    Fault(
        "nf4-levels-swapped",
        "gemma_tpu_helpers/fixes/train/expert_lora.py",
        "        levels = [jnp.where(on, hi, lo) for lo, hi in zip(levels[::2], levels[1::2])]\n",
        "        levels = [jnp.where(on, lo, hi) for lo, hi in zip(levels[::2], levels[1::2])]\n",
        "the nf4 experts' dequantisation reads each code's bits the wrong way round: every weight takes a "
        "neighbouring level",
    ),
    Fault(
        "merge-fold-skipped",
        "gemma_tpu_helpers/fixes/export/merge_plan.py",
        '        out[down] = dataclasses.replace(d, fold=s, note=f"{d.note}; per_expert_scale folded in")\n',
        "        out[down] = d\n",
        "the 26B's per_expert_scale is written as ones but never folded into down_proj: tpu-inference and every other "
        "server then lose the learned scales",
    ),
    Fault(
        "fold-scale-wrong-expert",
        "gemma_tpu_helpers/fixes/export/merge_plan.py",
        "        folds = [None] * len(self.a) if self.fold is None else self.fold\n",
        "        folds = [None] * len(self.a) if self.fold is None else self.fold[::-1]\n",
        "each expert's down_proj is scaled by another expert's per_expert_scale",
    ),
    Fault(
        "merge-skips-expert-tensors",
        "gemma_tpu_helpers/fixes/export/merge_plan.py",
        "            deltas.append(_expert_delta(key, modules[key], expected_experts[key], alpha / expert_rank))\n",
        "            pass\n",
        "the merge leaves the 3-D expert tensors as they were: the trained experts' LoRA is lost in the merged model",
    ),
    Fault(
        "peft-expert-factors-transposed",
        "gemma_tpu_helpers/fixes/model/layout.py",
        "    return a.transpose(0, 2, 1).reshape(e * r, d_in), b.transpose(2, 1, 0).reshape(b.shape[2], r * e)\n",
        "    return a.transpose(0, 2, 1).reshape(e * r, d_in), b.transpose(2, 0, 1).reshape(b.shape[2], r * e)\n",
        "the PEFT export groups lora_B's columns by expert instead of by rank: PEFT pairs each expert's A with "
        "other experts' B",
    ),
    Fault(
        "qlora-experts-scale-per-expert-only",
        "gemma_tpu_helpers/fixes/train/expert_lora.py",
        "                                           tiled_axes={row.contracted: tile_size})\n",
        "                                           tiled_axes={row.contracted: w.shape[row.contracted]})\n",
        "QLoRA's nf4 experts get one scale per expert and output channel, not per tile of 64 inputs: coarser than "
        "the bound the tile size promises",
    ),
    Fault(
        "qlora-skips-the-experts",
        "gemma_tpu_helpers/fixes/train/lora.py",
        "    if qlora is not None and _has_experts(lora_model):  # qwix's quantizer never meets them (ragged_dot)\n",
        "    if False:\n",
        "QLoRA leaves the routed experts in bf16 (what qwix alone does): no memory saved on a MoE",
    ),
    Fault(
        "lora-init-eager",
        "gemma_tpu_helpers/fixes/train/lora.py",
        "    return _place_lora(nnx.jit(go)(model))\n",
        "    return _place_lora(go(model))\n",
        "qwix's init forward runs eagerly: per-op collectives on a multi-device CPU mesh, which can deadlock",
    ),
    Fault(
        "lora-left-replicated",
        "gemma_tpu_helpers/fixes/train/lora.py",
        "    return _place_lora(nnx.jit(go)(model))\n",
        "    return nnx.jit(go)(model)\n",
        "the jitted qwix init leaves every LoRA param replicated on every chip, not placed like its base weight",
    ),
    Fault(
        "course-sets-path-on-import",
        "gemma_tpu_helpers/course/__init__.py",
        "plans, benchmarks, cost, preflight, the site, the workshop, the exercises and the CLI's steps.\"\"\"\n",
        "plans, benchmarks, cost, preflight, the site, the workshop, the exercises and the CLI's steps.\"\"\"\n"
        "import os\n\nos.environ[\"PATH\"] = \"/opt/iverilog/bin:\" + os.environ.get(\"PATH\", \"\")\n",
        "importing the course puts a tool first on PATH: every process the user starts afterwards changes",
    ),
    Fault(
        "profiles-reads-runs-env",
        "gemma_tpu_helpers/course/config/profiles.py",
        "        root = root or paths.runs_root()\n",
        "        root = root or os.environ.get(\"GEMMA_TPU_RUNS\") or paths.default_runs_root()\n",
        "a second module reads the runs root from the environment: two places to change when the setting moves",
    ),
    Fault(
        "base-checked-every-time",
        "gemma_tpu_helpers/course/config/base_model.py",
        "    if key not in _CHECKED:\n",
        "    if True:\n",
        "every step that needs the base reads all its shard headers again, three times in one learn",
    ),
)
BY_NAME = {f.name: f for f in FAULTS}
BASELINE = "none"


class StaleFault(Exception):
    pass


def apply(fault: Fault, text: str) -> str:
    """``text`` with the fault's edit; raises StaleFault unless the anchor occurs exactly once."""
    n = text.count(fault.anchor)
    if n != 1:
        raise StaleFault(f"fault {fault.name!r}: its anchor occurs {n} times in {fault.file} (it must occur exactly "
                         f"once; the fault definition is stale):\n{fault.anchor}")
    new = text.replace(fault.anchor, fault.replacement)
    if fault.file.endswith(".py"):
        try:
            compile(new, fault.file, "exec")
        except SyntaxError as e:
            raise StaleFault(f"fault {fault.name!r}: the edited {fault.file} does not compile: {e}") from e
    return new


def check_anchors(repo: Path, faults) -> bool:
    ok = True
    for f in faults:
        path = repo / f.file
        if not path.is_file():
            print(f"STALE  {f.name}: {f.file} does not exist")
            ok = False
            continue
        try:
            apply(f, path.read_text())
            print(f"ok     {f.name}: anchor found once in {f.file}, the edit compiles")
        except StaleFault as e:
            print(f"STALE  {e}")
            ok = False
    return ok


def copy_tree(repo: Path, dst: Path) -> int:
    """Copy the tracked and the untracked-not-ignored files of ``repo`` (as they are on disk) to ``dst``."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-co", "--exclude-standard", "-z"],
                         check=True, capture_output=True).stdout
    n = 0
    for rel in sorted({p for p in out.decode().split("\0") if p}):
        if rel.split("/", 1)[0] in SKIP_DIRS:
            continue
        src, target = repo / rel, dst / rel
        if not os.path.lexists(src):  # a tracked file deleted in the working tree
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir() and not src.is_symlink():  # a submodule (gitlink)
            shutil.copytree(src, target, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        else:
            shutil.copy2(src, target, follow_symlinks=False)
        n += 1
    return n


# FAILED tests/x.py::t[a - b] - msg | ERROR tests/x.py - msg (a parameter id may hold spaces and " - ")
_SUMMARY = re.compile(r"^(?:FAILED|ERROR) (\S+?\[.*?\]|\S+)(?: - .*)?$")


def failed_ids(output: str) -> list[str]:
    """Test ids from pytest's short summary (``-rfE``): ``FAILED tests/x.py::t[p] - msg``, ``ERROR tests/x.py``."""
    ids = []
    for line in output.splitlines():
        m = _SUMMARY.match(line.strip())
        if m and ("::" in m.group(1) or m.group(1).endswith(".py")) and m.group(1) not in ids:
            ids.append(m.group(1))
    return ids


def short(test_id: str) -> str:
    """``tests/fast/test_merge.py::test_x[a]`` -> ``test_merge::test_x[a]``."""
    path, _, rest = test_id.partition("::")
    name = Path(path).name.removesuffix(".py")
    return f"{name}::{rest}" if rest else name


def has_xdist(python: str) -> bool:
    return subprocess.run([python, "-c", "import xdist"], check=False, capture_output=True).returncode == 0


def test_env(copy: Path, repo: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("PYTEST_ADDOPTS", None)
    serve_py = repo / ".venv-serve" / "bin" / "python"  # the tests look for it beside the checkout (the copy)
    if not env.get("GEMMA_TPU_SERVE_PYTHON") and serve_py.exists():
        env["GEMMA_TPU_SERVE_PYTHON"] = str(serve_py)
    return env


def run_one(fault: Fault | None, args, workers: int) -> dict:
    name = fault.name if fault else BASELINE
    tmp = Path(tempfile.mkdtemp(prefix=f"seed-fault-{name}-"))
    copy = tmp / args.repo.name
    started = time.perf_counter()
    result = {"fault": name, "file": fault.file if fault else "", "why": fault.why if fault else "no fault",
              "copy": str(copy)}
    try:
        copy_tree(args.repo, copy)
        if fault:
            path = copy / fault.file
            path.write_text(apply(fault, path.read_text()))
        env = test_env(copy, args.repo)
        where = subprocess.run([args.python, "-c", "import gemma_tpu_helpers; print(gemma_tpu_helpers.__file__)"],
                               check=False, cwd=copy, env=env, capture_output=True, text=True)
        if where.returncode or not Path(where.stdout.strip()).resolve().is_relative_to(copy.resolve()):
            raise RuntimeError(f"{name}: the copy's package is not the one imported ({where.stdout.strip()!r} "
                               f"{where.stderr.strip()[-2000:]})")
        cmd = [args.python, "-m", "pytest", *shlex.split(args.selection), "-q", "-p", "no:cacheprovider", "-rfE",
               f"--basetemp={tmp / 'pytest-tmp'}"] + (["-n", str(workers)] if workers else [])
        print(f"[{name}] {' '.join(shlex.quote(c) for c in cmd)}  (in {copy})", flush=True)
        proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=args.timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # pytest and its xdist workers: the session this script started
            output, _ = proc.communicate()
            rc = None
        (tmp / "pytest.log").write_text(output)
        ids = failed_ids(output)
        result.update(returncode=rc, failed=ids, output_tail=output[-4000:])
        if rc is None:
            result["status"] = "timeout"
        elif ids:
            result["status"] = "caught" if fault else "baseline failed"
        elif rc == 0:
            result["status"] = "not caught" if fault else "passed"
        else:
            result["status"] = f"pytest exit {rc}"
    finally:
        result["seconds"] = round(time.perf_counter() - started, 1)
        if args.keep:
            print(f"[{name}] kept {copy} (log: {tmp / 'pytest.log'})", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    summary = ", ".join(short(i) for i in result.get("failed", [])[:6]) or result.get("status")
    print(f"[{name}] {result.get('status')} in {result['seconds']:.0f} s: {summary}", flush=True)
    return result


def caught_cell(r: dict, limit: int = 6) -> str:
    if r.get("status") == "not caught":
        return "**NOT CAUGHT**"
    if r.get("status") == "passed":
        return "(baseline: all passed)"
    ids = [short(i) for i in r.get("failed", [])]
    if not ids:
        return f"**{(r.get('status') or 'error').upper()}**"
    more = f" (+{len(ids) - limit} more)" if len(ids) > limit else ""
    cell = ", ".join(f"`{i}`" for i in ids[:limit]) + more
    return cell if r.get("status") != "timeout" else f"TIMEOUT; {cell}"


def table(results: list[dict]) -> str:
    lines = ["| fault | file | caught by | seconds |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['fault']} | {r['file'].removeprefix('gemma_tpu_helpers/') or '-'} | {caught_cell(r)} "
                     f"| {r['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1],
                   help="the repository (default: the one holding this script)")
    p.add_argument("--python", default=None, help="the venv's python (default: REPO/.venv/bin/python)")
    p.add_argument("--selection", default="tests",
                   help='what pytest runs, as one string (shlex-split): paths and options, e.g. "tests/fast" or '
                        '"tests -m \'not slow\'" (default: tests)')
    p.add_argument("--only", default=None, metavar="NAME[,NAME]",
                   help=f"these faults only; '{BASELINE}' is the clean baseline (alone: --only {BASELINE})")
    p.add_argument("--baseline", action="store_true", help="run the selection without a fault first; it must pass")
    p.add_argument("--list", action="store_true", help="print the faults and exit")
    p.add_argument("--check-anchors", action="store_true",
                   help="check each fault's anchor occurs exactly once (and the edit compiles); runs no test")
    p.add_argument("--keep", action="store_true", help="keep each copy (and its pytest.log) for debugging")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per fault (default 3600)")
    p.add_argument("--workers", type=int, default=2, help="pytest-xdist workers, -n (default 2; 0: none; dropped "
                                                          "when xdist is not installed)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results as JSON")
    args = p.parse_args(argv)
    args.repo = args.repo.resolve()
    args.python = args.python or str(args.repo / ".venv" / "bin" / "python")

    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only is not None else list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME and n != BASELINE]
    if unknown:
        p.error(f"unknown fault(s) {unknown}; the faults are {', '.join(BY_NAME)} (and '{BASELINE}')")
    faults = [BY_NAME[n] for n in names if n != BASELINE]
    baseline = args.baseline or BASELINE in names

    if args.list:
        for f in FAULTS:
            print(f"{f.name}\n    {f.file}\n    {f.why}")
        return 0
    if args.check_anchors:
        return 0 if check_anchors(args.repo, faults) else 2
    if not check_anchors(args.repo, faults):  # fail before any copy: a stale fault would only waste the run
        return 2
    if not Path(args.python).exists():
        p.error(f"{args.python} does not exist (make setup builds the venv; or give --python)")
    workers = args.workers if args.workers and has_xdist(args.python) else 0

    results = []
    todo = ([None] if baseline else []) + faults
    try:
        for fault in todo:
            r = run_one(fault, args, workers)
            results.append(r)
            if fault is None and r["status"] != "passed":
                print(f"the baseline did not pass ({r['status']}): fix the suite first; no fault was run.\n"
                      f"{r.get('output_tail', '')[-3000:]}", file=sys.stderr)
                break
    finally:
        if args.json:
            args.json.write_text(json.dumps({"repo": str(args.repo), "selection": args.selection,
                                             "python": args.python, "workers": workers, "results": results},
                                            indent=1) + "\n")
    print()
    print(f"selection: `{args.selection}`\n")
    print(table(results))
    good = all(r["status"] == ("passed" if r["fault"] == BASELINE else "caught") for r in results)
    return 0 if good and len(results) == len(todo) else 1


if __name__ == "__main__":
    sys.exit(main())
