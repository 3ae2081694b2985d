"""VerilogEval problems (v2 layout: ``<task>_prompt.txt``, ``<task>_ref.sv``, ``<task>_test.sv``): load them, turn
one into a spec-to-RTL chat prompt, and pull the Verilog out of a model's answer."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

from ..core.errors import GemmaTpuError

FILE_SUFFIXES = {"prompt": "_prompt.txt", "ref": "_ref.sv", "test": "_test.sv"}


# VerilogEval's spec-to-rtl system message.
SYSTEM_PROMPT = "You are a Verilog RTL designer that only writes code using correct Verilog syntax."


class EvalError(GemmaTpuError, ValueError):
    """Bad input to the evaluation: a problem folder, a completions file, an argument."""


@dataclasses.dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str  # the spec; the answer must define `module TopModule`
    ref: str  # reference solution, `module RefModule`
    test: str  # testbench `module tb`, prints `Mismatches: N in M samples`
    kind: str | None = None
    description: str | None = None


def load_problems(directory: str | os.PathLike, tasks: Iterable[str] | None = None) -> list[Problem]:
    """Problems of a folder in the VerilogEval v2 layout (e.g. ``dataset_spec-to-rtl``), sorted by task id; an
    optional ``problems.jsonl`` adds ``kind`` and ``description``. ``tasks`` keeps only those ids."""
    directory = Path(directory)
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
    """The chat messages sent for a problem: VerilogEval's system prompt (a native system turn on Gemma 4) and
    :func:`build_prompt` as the user turn."""
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
    for pattern, open_, close in ((r"<think>.*?</think>", "<think>", "</think>"),
                                  (_CHANNEL_RE, "<|channel>", "<channel|>")):
        text = re.sub(pattern, "", text, flags=re.S) if isinstance(pattern, str) else pattern.sub("", text)
        if close in text:  # the template opened the reasoning in the prompt: the answer follows the last close
            text = text.rsplit(close, 1)[1]
        if open_ in text:  # reasoning cut off by max_tokens: nothing after it is an answer
            text = text.split(open_, 1)[0]
    return _LEFTOVER_TOKENS_RE.sub("", text)


def extract_verilog(text: str | None) -> str | None:
    """The Verilog in a model's answer (reasoning removed first), or None when there is none: the first closed
    Verilog fence holding a module (``module TopModule`` wins), else an unterminated one (cut off by max_tokens),
    else bare ``module ... endmodule`` text."""
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


def reference_code(problem: Problem) -> str:
    """The problem's reference renamed ``TopModule``: a correct design by construction."""
    return re.sub(r"\bRefModule\b", "TopModule", problem.ref)


def task_digest(problem: Problem) -> str:
    h = hashlib.sha256()
    for part in (problem.task_id, problem.ref, problem.test):  # the prompt does not change what simulates
        h.update(part.encode("utf-8") + b"\0")
    return h.hexdigest()


def problems_digest(problems: Sequence[Problem]) -> str:
    """SHA-256 over every problem's id, reference and testbench: what a calibration depends on, with the simulator."""
    h = hashlib.sha256()
    for p in sorted(problems, key=lambda p: p.task_id):
        h.update(task_digest(p).encode())
    return h.hexdigest()

