"""Self-checking exercises ("Your turn") for notebooks 01-10.

A learner writes an answer in a marked cell and calls ``exercises.check("02.regex", answer)``: *right*, or *wrong*
with why and a hint (never the solution), judged with the course's own helpers where it can. ``answer = None`` (the
cell as shipped) is *not attempted*, so an unanswered notebook still runs. Teachers: :func:`format_solutions`
(``python -m gemma_tpu_helpers solutions 02``). Nothing heavy is imported at import time.

Each exercise's texts (title, task, hints) are data, in ``data/exercises.toml`` under its key; this module holds its
code (judge, solution, typical wrong answers, the figures its task shows) and builds the :class:`Exercise` from both.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import re
import string
import tomllib
from typing import Any, Callable

from ...fixes.core.errors import GemmaTpuError
from ...fixes.eval.eval_score import pass_at_k
from ...fixes.export.merge_plan import plan_merge
from ...fixes.model.gemma4 import GEMMA4_31B_TEXT_CONFIG, head_divisibility_problems, valid_tp_sizes
from ...fixes.model.hf_checkpoint import layer_kinds
from ...fixes.model.layout import synthetic_lora
from ...fixes.model.partition_specs import bytes_per_device, divisible_spec, indivisible_dims
from ...fixes.serve.vllm_command import ServeError
from ...fixes.train.lora import HF_TARGETS, regex_for, tunix_module
from ...fixes.train.packing import codev_like_lengths, token_use_for_lengths
from ...fixes.train.remat import POLICIES, UnknownPolicyError, check_policy
from ..budget.cost import cost_per_million_output_tokens, price, training_comparison
from ..budget.serving_bench import PAPER_TRAINING_HOURS
from ..config import paths
from ..config.profiles import GPU_RECIPE, get_profile
from ..config.tiny import tiny_text_config
from ..training.profile_steps import hbm_per_chip

RIGHT, WRONG, NOT_ATTEMPTED = "right", "wrong", "not attempted"
REL_TOL = 1e-3  # numeric answers: relative tolerance (enough for hand-rounded figures to 3 significant digits)
MAX_CHIPS = 8  # the slices of this course (v5p-8, v6e-8) have at most 8 chips
V5P_CHIPS_PER_HOST = 4  # a v5p TPU VM host drives 4 chips


@dataclasses.dataclass(frozen=True)
class Exercise:
    key: str  # "<notebook number>.<name>", e.g. "02.regex"
    title: str
    task: str  # markdown: what to write into `answer`
    answer_hint: str  # the comment on the `answer = None` line: the answer's form
    hint: str  # shown with a wrong answer
    solution: Any  # a value, or a function (shown by its source)
    judge: Callable[[Any], str | None]  # None when right, else why it is wrong (must not reveal the solution)
    wrong: tuple = ()  # typical wrong answers: CI checks that each is rejected
    right_note: str = ""  # shown with a right answer: what it means

    @property
    def notebook(self) -> str:
        return self.key.split(".", 1)[0]


@dataclasses.dataclass(frozen=True)
class Feedback:
    key: str
    status: str  # RIGHT | WRONG | NOT_ATTEMPTED
    why: str = ""
    hint: str = ""

    @property
    def ok(self) -> bool:
        return self.status == RIGHT

    def __str__(self) -> str:
        if self.status == RIGHT:
            return f"[right] {self.key}: {self.why}".rstrip(": ")
        if self.status == NOT_ATTEMPTED:
            return f"[not attempted] {self.key}: {self.why}"
        return f"[wrong] {self.key}: {self.why}\n  hint: {self.hint}"

    __repr__ = __str__

    def _repr_markdown_(self) -> str:
        label = {RIGHT: "**Right.**", WRONG: "**Not yet.**", NOT_ATTEMPTED: "**Not attempted.**"}[self.status]
        out = f"`{self.key}` {label} {self.why}"
        if self.status == WRONG and self.hint:
            out += f"\n\n*Hint:* {self.hint}"
        return out


# ---------------------------------------------------------------------------------------------- small judges


def _int(answer, what: str = "an integer") -> int:
    """An int (numpy integers and whole floats too)."""
    if isinstance(answer, bool) or not isinstance(answer, numbers.Real) or int(answer) != answer:
        raise _Wrong(f"give {what}, not {answer!r}")
    return int(answer)


def _number(answer) -> float:
    if isinstance(answer, bool) or not isinstance(answer, numbers.Real) or not math.isfinite(answer):
        raise _Wrong(f"give a finite number, not {answer!r}")
    return float(answer)


def _close(a: float, b: float, rel: float = REL_TOL) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


class ExerciseError(GemmaTpuError, LookupError):
    """No exercise of that name or notebook."""


class _Wrong(Exception):
    """Raised inside a judge: the message is the reason."""


def _choice(answer, choices: dict[str, str]) -> str:
    """A multiple-choice answer as its letter: accepts "a" or the choice's text."""
    if isinstance(answer, str):
        a = answer.strip().rstrip(")").lower()
        if a in choices:
            return a
        for letter, text in choices.items():
            if answer.strip().lower() == text.lower():
                return letter
    raise _Wrong(f"answer with one of the letters {', '.join(map(repr, choices))}, not {answer!r}")


# ---------------------------------------------------------------------------------------------- 01 mesh


def _cfg31b() -> dict:
    return GEMMA4_31B_TEXT_CONFIG


def _judge_01_tp(answer):
    tp = _int(answer, "an integer tp size")
    if not 1 <= tp <= MAX_CHIPS:
        return f"tp={tp} does not fit on a slice of {MAX_CHIPS} chips (tp counts chips: 1..{MAX_CHIPS})"
    problems = head_divisibility_problems(_cfg31b(), {"tp": tp})
    if problems:
        return f"tp={tp} cannot shard the 31B: " + "; ".join(problems)
    if tp != max(valid_tp_sizes(_cfg31b(), MAX_CHIPS)):
        return f"tp={tp} divides every head count, but it is not the largest tp that does"
    return None


_CONTEXT_CHOICES = {"a": "with mesh:", "b": "with jax.set_mesh(mesh):", "c": "both, one inside the other"}


def _judge_01_context(answer):
    letter = _choice(answer, _CONTEXT_CHOICES)
    if letter == "b":
        return ("under jax.set_mesh alone the step still runs, but tunix 0.1.7's PeftTrainer never sees the mesh: "
                "every batch is replicated on every device and the optimizer state is not sharded (the probe above "
                "shows the batch spec inside the step)")
    if letter == "c":
        return "both contexts at once crash in tunix's optimizer-sharding step"
    return None


# ---------------------------------------------------------------------------------------------- 02 LoRA names


def module_paths(text_config: dict) -> tuple[list[str], list[str]]:
    """(every projection module path that should get LoRA, module paths that should not), as tunix names them."""
    k_eq_v = bool(text_config.get("attention_k_eq_v"))
    targets, others = [], ["embedder", "final_norm"]
    for i, kind in enumerate(layer_kinds(text_config)):
        mods = []
        for t in HF_TARGETS:
            m = tunix_module(t, kind, k_eq_v)
            if m and m not in mods:
                mods.append(m)
        targets += [f"layers/{i}/{m}" for m in mods]
        others += [f"layers/{i}/{m}" for m in ("attn", "mlp", "attn/_query_norm", "attn/_key_norm",
                                                 "pre_attention_norm", "post_attention_norm", "pre_ffw_norm",
                                                 "post_ffw_norm")]
    return targets, others


def _judge_02_regex(answer):
    if not isinstance(answer, str) or not answer.strip():
        return f"give the regex as a string, not {answer!r}"
    try:
        rx = re.compile(answer)
    except re.error as e:
        return f"Python cannot compile it as a regex: {e}"
    targets, others = module_paths(_cfg31b())
    missed = [p for p in targets if not rx.fullmatch(p)]  # qwix matches module_path with re.fullmatch
    extra = [p for p in others if rx.fullmatch(p)]
    if len(missed) == len(targets):
        return ("it matches none of tunix's module paths (qwix full-matches paths such as layers/0/mlp/up_proj; "
                "Hugging Face names such as q_proj do not occur in them)")
    if missed:
        by_module: dict[str, list[str]] = {}
        for p in missed:
            layer, module = p.split("/", 2)[1:]
            by_module.setdefault(module, []).append(layer)
        parts = [f"{m} on {len(ls)} layer(s) ({', '.join(ls[:4])}{', ...' if len(ls) > 4 else ''})"
                 for m, ls in by_module.items()]
        return "it leaves out " + "; ".join(parts)
    if extra:
        return (f"it covers every projection, but also matches {len(extra)} module(s) that are not projections, "
                f"e.g. {', '.join(extra[:3])}: select exactly the seven projections, so that the coverage report "
                f"and the LoRA parameter count mean what you think")
    return None


def _solution_02_regex() -> str:
    return regex_for(HF_TARGETS)


def _judge_02_module(answer):
    c = _cfg31b()
    kinds = layer_kinds(c)
    if not isinstance(answer, dict) or set(answer) != {0, 5}:
        return "give a dict with the keys 0 and 5 (layer numbers), each a dict {'k_proj': ..., 'v_proj': ...}"
    for layer in (0, 5):
        got = answer[layer]
        if not isinstance(got, dict) or set(got) != {"k_proj", "v_proj"}:
            return f"answer[{layer}] must be a dict with the keys 'k_proj' and 'v_proj'"
        for target in ("k_proj", "v_proj"):
            want = tunix_module(target, kinds[layer], bool(c.get("attention_k_eq_v")))
            mine = got[target]
            if isinstance(mine, str):
                mine = mine.strip().strip("/")
                mine = mine if mine.startswith(("attn/", "mlp/")) else f"attn/{mine}"
            if mine != want:
                return (f"layer {layer} is a {kinds[layer]} layer, and {got[target]!r} is not where its {target} "
                        f"lives in tunix")
    return None


# ---------------------------------------------------------------------------------------------- 03 sharding

# The 31B's global k_einsum weight (K, D, H) on a v6e-8-sized mesh, as tunix annotates it.
_SPEC_SHAPE = (4, 5376, 512)
_SPEC_GIVEN = ("tp", "fsdp", None)
_SPEC_MESH = {"fsdp": 1, "tp": 8}


def _judge_03_spec(answer):
    if not isinstance(answer, (tuple, list)) or len(answer) != len(_SPEC_SHAPE):
        return f"give a tuple of {len(_SPEC_SHAPE)} entries (a mesh axis name or None per dim of {_SPEC_SHAPE})"
    spec = tuple(answer)
    for entry in spec:
        if entry is not None and entry not in _SPEC_MESH:
            return f"{entry!r} is not a mesh axis; the mesh has {', '.join(_SPEC_MESH)} (or None: replicated)"
    used = [e for e in spec if e is not None]
    if len(used) != len(set(used)):
        return "a mesh axis can shard only one dim of an array"
    bad = indivisible_dims(_SPEC_SHAPE, spec, _SPEC_MESH)
    if bad:
        return "the mesh still cannot divide it: " + "; ".join(bad)
    ref = divisible_spec(_SPEC_SHAPE, _SPEC_GIVEN, _SPEC_MESH)
    mine_b = bytes_per_device(_SPEC_SHAPE, "bfloat16", spec, _SPEC_MESH)
    ref_b = bytes_per_device(_SPEC_SHAPE, "bfloat16", ref, _SPEC_MESH)
    if mine_b > ref_b:
        return (f"it divides, but replicates more than it must: {mine_b / 2**20:.0f} MiB per device where "
                f"{ref_b / 2**20:.0f} MiB is possible")
    if spec != ref:
        return ("it divides, but it moves an axis to a dim tunix does not shard that way: change only what the mesh "
                "cannot divide, keep the rest of tunix's annotation")
    return None


# ---------------------------------------------------------------------------------------------- 04 remat

_STEPS = ("load_model", "apply_lora", "set_remat", "train")


def _judge_04_order(answer):
    if not isinstance(answer, (list, tuple)) or sorted(answer) != sorted(_STEPS):
        return f"give a list holding each of {', '.join(map(repr, _STEPS))} once, in the order you would run them"
    a = list(answer)
    if a[0] != "load_model" or a[-1] != "train":
        return "a step needs the model it works on: what must come first, and what last?"
    if a.index("set_remat") < a.index("apply_lora"):
        return ("remat before LoRA: qwix creates the LoRA params while it runs the model once, and tunix's "
                "nnx.remat(..., graph_updates=False) drops variables created inside it, so the model gets no LoRA "
                "params (the trap table above shows 0)")
    return None


def _judge_04_policy(answer):
    if not isinstance(answer, str):
        return "give a policy name as a string (a key of remat.POLICIES)"
    try:
        name = check_policy(answer)
    except UnknownPolicyError:
        return f"{answer!r} is not a policy of this course: the names are the keys of remat.POLICIES"
    if name != "decoder":
        return f"{name!r} is: {POLICIES[name]}; that is not the policy asked for"
    return None


# ---------------------------------------------------------------------------------------------- 05 data

# Gemma 4 chat format (pieces as its tokenizer splits them: control tokens and the role on their own).
BOS, SOT, EOT = "<bos>", "<|turn>", "<turn|>"
THOUGHT = ["<|channel>", "thought", "\n", "<channel|>"]  # the 31B's empty thought channel (thinking off)


def gemma4_pieces(messages: list[dict], thought_channel: bool = False) -> list[str]:
    """A chat rendered the way Gemma 4's template renders it (native system turn, assistant -> ``model``), as
    pieces: ``<bos>``, ``<|turn>``, the role, ``"\\n"``, the content's words, ``<turn|>``, ``"\\n"`` per turn.

    ``thought_channel=True``: the last model turn opens with the empty thought channel that the 31B's generation
    prompt adds (so a training sequence is what the model sees at inference, then the answer)."""
    out = [BOS]
    for i, m in enumerate(messages):
        role = "model" if m["role"] == "assistant" else m["role"]
        thought = THOUGHT if thought_channel and role == "model" and i == len(messages) - 1 else []
        out += [SOT, role, "\n", *thought, *re.findall(r"\s*\S+", m["content"].strip()), EOT, "\n"]
    return out


_MASK_CHATS = (
    [{"role": "user", "content": "Write a 2-to-1 mux."},
     {"role": "assistant", "content": "module mux(input a, b, s, output y); assign y = s ? b : a; endmodule"}],
    [{"role": "system", "content": "You write Verilog."},
     {"role": "user", "content": "Write an inverter."},
     {"role": "assistant", "content": "module inv(input a, output y); assign y = ~a; endmodule"}],
    [{"role": "user", "content": "Which model of flip-flop? Answer as the user asked."},
     {"role": "assistant", "content": "A D flip-flop: the user model and the model user agree."}],
    [{"role": "user", "content": "Write a buffer."},
     {"role": "assistant", "content": "module buf1(input a, output y); assign y = a; endmodule"},
     {"role": "user", "content": "Now with an enable."},
     {"role": "assistant", "content": "module buf2(input a, en, output y); assign y = en ? a : 1'bz; endmodule"}],
)


def _mask_reference(pieces: list[str]) -> list[int]:
    """1 on the last model turn's content and its ``<turn|>``; 0 elsewhere (what chat_tokens.tokenize_example does)."""
    start = max(i for i in range(len(pieces) - 2) if pieces[i:i + 3] == [SOT, "model", "\n"]) + 3
    if pieces[start:start + len(THOUGHT)] == THOUGHT:
        start += len(THOUGHT)
    end = pieces.index(EOT, start) + 1
    return [1 if start <= i < end else 0 for i in range(len(pieces))]


def _judge_05_mask(answer):
    if not callable(answer):
        return "give a function: mask(pieces) -> a list of 0/1, one per piece"
    for chat, thought in [(c, False) for c in _MASK_CHATS] + [(_MASK_CHATS[0], True)]:
        pieces = gemma4_pieces(chat, thought_channel=thought)
        try:
            got = answer(list(pieces))
        except Exception as e:  # the learner's code: report, do not raise
            return f"your function raised {type(e).__name__}: {e} on the chat {pieces!r}"
        try:
            got = [int(x) for x in got]
        except (TypeError, ValueError):
            return f"your function must return a list of 0/1, it returned {got!r}"
        want = _mask_reference(pieces)
        if len(got) != len(want):
            return f"the mask has {len(got)} entries for {len(pieces)} pieces"
        if got == want:
            continue
        wrong_on = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        on_eot = [i for i in wrong_on if pieces[i] == EOT and want[i]]
        header = [i for i in wrong_on if got[i] and i < want.index(1)]
        if header:
            return (f"the loss includes pieces before the model's last answer, e.g. {[pieces[i] for i in header[:5]]}: "
                    f"train on that answer only (chat: {''.join(pieces)!r})")
        if on_eot:
            return ("the answer's closing <turn|> is not in the loss, so the model never learns to end its turn "
                    f"(chat: {''.join(pieces)!r})")
        return (f"it differs on {len(wrong_on)} piece(s), e.g. {[pieces[i] for i in wrong_on[:5]]} "
                f"(chat: {''.join(pieces)!r})")
    return None


def solution_05_mask(pieces):
    """1 from after the last ``<|turn>model\\n`` up to and including the ``<turn|>`` that closes it."""
    start = max(i for i in range(len(pieces) - 2) if pieces[i:i + 3] == ["<|turn>", "model", "\n"]) + 3
    if pieces[start:start + 4] == ["<|channel>", "thought", "\n", "<channel|>"]:
        start += 4  # the 31B's empty thought channel is part of the prompt
    end = pieces.index("<turn|>", start) + 1
    return [1 if start <= i < end else 0 for i in range(len(pieces))]


def _wrong_05_all(pieces):
    return [1] * len(pieces)


def _wrong_05_no_eot(pieces):
    return [m if p != "<turn|>" else 0 for p, m in zip(pieces, solution_05_mask(pieces))]


def _wrong_05_first_turn(pieces):  # the first model turn, as a plain search finds it
    start = pieces.index("model") + 2
    end = pieces.index("<turn|>", start) + 1
    return [1 if start <= i < end else 0 for i in range(len(pieces))]


_USE_LENGTHS = (900, 1200, 300, 2000, 650)
_USE_MAX_LEN = 3072


def _judge_05_use(answer):
    x = _number(answer)
    use = token_use_for_lengths(list(_USE_LENGTHS), _USE_MAX_LEN)
    if _close(x, use["pad_to_max"]):
        return None
    if _close(x, 100 * use["pad_to_max"]):
        return "give a fraction between 0 and 1, not a percentage"
    if _close(x, use["packed"]):
        return "that is the token use of packing; the question asks about padding every example to max_seq_len"
    if _close(x, 1 - use["pad_to_max"]):
        return "that is the share of padding; the question asks for the share of real tokens"
    return "not the share of computed tokens that are real under pad-to-max"


# ---------------------------------------------------------------------------------------------- 06 training


def _judge_06_accum(answer):
    accum = _int(answer, "an integer grad_accum")
    gpu = GPU_RECIPE["world_size"] * GPU_RECIPE["per_device_batch"] * GPU_RECIPE["grad_accum"]
    micro = get_profile("v5p-8").train.micro_batch
    if accum == GPU_RECIPE["grad_accum"]:
        return (f"that is the GPU recipe's own grad_accum, but it runs {GPU_RECIPE['world_size']} GPUs with "
                f"{GPU_RECIPE['per_device_batch']} example each per micro-step; the v5p-8 takes {micro} global "
                f"row(s) per micro-step")
    if accum * micro != gpu:
        return f"{micro} row(s) x {accum} = {accum * micro} examples per update, but the GPU recipe updates on {gpu}"
    return None


_STEPS_EXAMPLES, _STEPS_MAX_LEN = 10_000, 3072


def _steps_reference() -> tuple[int, int]:
    t = get_profile("v5p-8").train
    rows = token_use_for_lengths(codev_like_lengths(_STEPS_EXAMPLES), _STEPS_MAX_LEN)["packed_rows"]
    return rows, t.micro_batch * t.grad_accum


def _judge_06_steps(answer):
    steps = _int(answer, "an integer number of optimizer steps")
    rows, per_update = _steps_reference()
    if steps in (rows // per_update, -(-rows // per_update)):
        return None
    if steps in (_STEPS_EXAMPLES // per_update, -(-_STEPS_EXAMPLES // per_update)):
        return "that counts examples per update; with packing an update takes rows, each holding several examples"
    return "not the number of optimizer updates one pass over the packed rows makes"


# ---------------------------------------------------------------------------------------------- 07 merge

_MERGE_RANK, _MERGE_ALPHA = 4, 8.0


def _merge_case(target: str):
    """(A, B, scale, reference ΔW) for layer 0's ``target`` from a synthetic LoRA, through merge.plan."""
    cfg = tiny_text_config()
    arrays = synthetic_lora(cfg, [target], _MERGE_RANK, seed=1)
    meta = {"rank": _MERGE_RANK, "alpha": _MERGE_ALPHA, "targets": [target]}
    (delta,) = [d for d in plan_merge(arrays, meta, cfg) if d.hf.endswith(f"layers.0.self_attn.{target}.weight")]
    a, b = (arrays[f"{delta.module}/w_lora_{x}"] for x in "ab")
    return a, b, delta.scale, delta.delta()


def _compare_delta(answer, target: str, other: Callable | None = None):
    import numpy as np

    if not callable(answer):
        return "give a function: delta(a, b, scale) -> the HF weight update as a 2-D numpy array [out, in]"
    a, b, scale, want = _merge_case(target)
    try:
        got = np.asarray(answer(a.copy(), b.copy(), scale), dtype=np.float32)
    except Exception as e:  # the learner's code
        return f"your function raised {type(e).__name__}: {e} (a {a.shape}, b {b.shape})"
    tol = dict(rtol=1e-4, atol=1e-6)
    if got.shape != want.shape:
        if got.shape == want.shape[::-1] and np.allclose(got.T, want, **tol):
            return f"right numbers, wrong layout: HF weights are [out, in] = {want.shape}, yours is {got.shape}"
        return f"the update must have the HF weight's shape [out, in] = {want.shape}; yours is {got.shape}"
    if np.allclose(got, want, **tol):
        return None
    if np.allclose(got * scale, want, **tol):
        return "off by the LoRA scale: the update is multiplied by alpha / rank"
    if other is not None and np.allclose(got, other(a, b, scale), **tol):
        return "that is the update of k_proj: the two share A, and B has one slice each"
    return "the values differ from the update merge.plan computes"


def solution_07_q(a, b, scale):
    """q_einsum: A (D, r), B (r, N, H) -> ΔW_q = scale · (A · B.reshape(r, N·H))ᵀ, shape [N·H, D]."""
    r = a.shape[-1]
    return scale * (a @ b.reshape(r, -1)).T


def _wrong_07_q_layout(a, b, scale):
    return scale * (a @ b.reshape(a.shape[-1], -1))


def _wrong_07_q_unscaled(a, b, scale):
    return (a @ b.reshape(a.shape[-1], -1)).T


def solution_07_v(a, b, scale):
    """kv_einsum: A (D, r), B (r, 2, K, H); v takes B[:, 1] -> ΔW_v = scale · (A · B[:, 1].reshape(r, K·H))ᵀ."""
    r = a.shape[-1]
    return scale * (a @ b[:, 1].reshape(r, -1)).T


def _wrong_07_v_is_k(a, b, scale):
    return scale * (a @ b[:, 0].reshape(a.shape[-1], -1)).T


def _judge_07_q(answer):
    return _compare_delta(answer, "q_proj")


def _judge_07_v(answer):
    return _compare_delta(answer, "v_proj", other=_wrong_07_v_is_k)


# ---------------------------------------------------------------------------------------------- 08 serving

_FLAG_KEYS = ("tensor_parallel_size", "max_model_len", "kv_cache_dtype", "gpu_memory_utilization")
_KV_DTYPES = ("auto", "fp8")
_REMOVED_FLAGS = {"disable_log_requests": "removed in vLLM 0.32: passing it is an error"}


def serving_profile(flags: dict):
    """The v6e-8 profile with ``flags`` as its serving settings (what ``vllm_command.hbm_per_chip`` judges)."""
    import dataclasses as dc

    prof = get_profile("v6e-8")
    return dc.replace(prof, serve=dc.replace(
        prof.serve, tensor_parallel=int(flags["tensor_parallel_size"]), max_model_len=int(flags["max_model_len"]),
        kv_cache_dtype=flags["kv_cache_dtype"], gpu_memory_utilization=float(flags["gpu_memory_utilization"])))


def _judge_08_flags(answer):
    if not isinstance(answer, dict):
        return f"give a dict with the keys {', '.join(_FLAG_KEYS)}"
    for k in answer:
        if k in _REMOVED_FLAGS:
            return f"{k}: {_REMOVED_FLAGS[k]}"
    missing = [k for k in _FLAG_KEYS if k not in answer]
    if missing:
        return f"missing key(s): {', '.join(missing)}"
    prof = get_profile("v6e-8")
    chips, heads = prof.hardware.num_devices, _cfg31b()["num_attention_heads"]
    tp = _int(answer["tensor_parallel_size"], "an integer tensor_parallel_size")
    if not 1 <= tp <= chips:
        return f"tensor_parallel_size={tp}: a v6e-8 has {chips} chips"
    if heads % tp:
        return f"tensor_parallel_size={tp} does not divide the 31B's {heads} attention heads"
    if answer["kv_cache_dtype"] not in _KV_DTYPES:
        return f"kv_cache_dtype: one of {', '.join(map(repr, _KV_DTYPES))}"
    util = _number(answer["gpu_memory_utilization"])
    if not 0 < util <= 1:
        return "gpu_memory_utilization is a fraction of each chip's HBM: in (0, 1]"
    need_len = prof.serve.max_model_len
    if _int(answer["max_model_len"], "an integer max_model_len") < need_len:
        return f"max_model_len below {need_len}: the task asks for a {need_len}-token context"
    try:
        m = hbm_per_chip(serving_profile(answer))
    except ServeError as e:  # KV heads neither divided nor replicated
        return str(e)
    if not m["fits"]:
        return (f"per chip: {m['weights_gib']:.1f} GiB of weights leave {m['free_gib']:.1f} GiB of the "
                f"{m['budget_gib']:.1f} GiB budget ({util:g} x {prof.hardware.hbm_gib_per_chip:g} GiB), less than the "
                f"{m['kv_gib_per_sequence']:.2f} GiB KV cache of one {answer['max_model_len']}-token sequence")
    return None


# ---------------------------------------------------------------------------------------------- 09 evaluation

_PASS_N, _PASS_C, _PASS_K = 10, 3, 5
_PASS_COUNTS = ((10, 0), (10, 3), (10, 10), (10, 1))  # (samples, passing) per problem
_PASS_KS = (1, 5)


def _judge_09_pass(answer):
    x = _number(answer)
    want = pass_at_k(_PASS_N, _PASS_C, _PASS_K)
    if _close(x, want):
        return None
    if _close(x, _PASS_C / _PASS_N):
        return f"c / n estimates pass@1, not pass@{_PASS_K}"
    if _close(x, 1 - (1 - _PASS_C / _PASS_N) ** _PASS_K):
        return ("1 - (1 - c/n)^k draws the k samples with replacement; pass@k draws k distinct samples out of the n "
                "(the unbiased estimator)")
    return f"not pass@{_PASS_K} for n={_PASS_N}, c={_PASS_C}"


def _judge_09_mean(answer):
    if not isinstance(answer, dict) or set(answer) != set(_PASS_KS):
        return f"give a dict {{k: pass@k}} with the keys {', '.join(map(str, _PASS_KS))}"
    n_all, c_all = sum(n for n, _ in _PASS_COUNTS), sum(c for _, c in _PASS_COUNTS)
    for k in _PASS_KS:
        x = _number(answer[k])
        want = sum(pass_at_k(n, c, k) for n, c in _PASS_COUNTS) / len(_PASS_COUNTS)
        if _close(x, want):
            continue
        if _close(x, pass_at_k(n_all, c_all, k)):
            return f"pass@{k}: you pooled the samples of all problems; pass@k is computed per problem, then averaged"
        return f"pass@{k} is not the mean over problems of each problem's pass@{k}"
    return None


# ---------------------------------------------------------------------------------------------- 10 cost

_SERVE_TOK_S = 1400.0  # a round output throughput for the exercise (tokens/s)


def _judge_10_ratio(answer):
    x = _number(answer)
    t = training_comparison(PAPER_TRAINING_HOURS["v5p-8"], PAPER_TRAINING_HOURS["2xH100"])
    if _close(x, t.attrs["cost_ratio"], 5e-3):
        return None
    if _close(x, t.attrs["time_ratio"], 5e-3):
        return "that is the time ratio: the GPUs also cost a different price per hour"
    if _close(x, 1 / t.attrs["cost_ratio"], 5e-3):
        return "upside down: how many times the TPU run's cost is the GPU run's?"
    return "not the GPU run's cost divided by the TPU run's"


def _judge_10_per_million(answer):
    x = _number(answer)
    want = cost_per_million_output_tokens(_SERVE_TOK_S, "v6e-8")
    if _close(x, want, 5e-3):
        return None
    if _close(x, price("v6e-8") / _SERVE_TOK_S * 1e6, 5e-3):
        return "the price is per hour and the throughput per second: convert one of them"
    return "not the dollars per million output tokens at that throughput"


# ---------------------------------------------------------------------------------------------- the catalogue

TEXTS_FILE = paths.DATA_DIR / "exercises.toml"  # each exercise's texts (title, task, hints ...), keyed by its key
REQUIRED_TEXTS = ("title", "task", "answer_hint", "hint")
OPTIONAL_TEXTS = ("right_note",)


@dataclasses.dataclass(frozen=True)
class _Code:
    """An exercise's code: its solution, judge and typical wrong answers, and the values its texts show as $name."""
    solution: Any
    judge: Callable[[Any], str | None]
    wrong: tuple
    fill: dict = dataclasses.field(default_factory=dict)


_CODE: dict[str, _Code] = {
    "01.tp": _Code(4, _judge_01_tp, (8, 2)),
    "01.context": _Code("a", _judge_01_context, ("b", "c"), fill={"choices": "; ".join(
        f"**{k}**) `{v}`" if k != "c" else f"**{k}**) {v}" for k, v in _CONTEXT_CHOICES.items())}),
    "02.regex": _Code(_solution_02_regex(), _judge_02_regex, (
        ".*q_proj|.*v_proj", ".*q_einsum|.*kv_einsum|.*attn_vec_einsum|.*gate_proj|.*down_proj|.*up_proj", ".*")),
    "02.module": _Code(
        {0: {"k_proj": "attn/kv_einsum", "v_proj": "attn/kv_einsum"}, 5: {"k_proj": "attn/k_einsum", "v_proj": None}},
        _judge_02_module,
        ({0: {"k_proj": "attn/kv_einsum", "v_proj": "attn/kv_einsum"},
          5: {"k_proj": "attn/kv_einsum", "v_proj": "attn/kv_einsum"}},
         {0: {"k_proj": "attn/kv_einsum", "v_proj": "attn/kv_einsum"},
          5: {"k_proj": "attn/k_einsum", "v_proj": "attn/v_einsum"}})),
    "03.spec": _Code((None, "fsdp", None), _judge_03_spec, (_SPEC_GIVEN, (None, None, None), ("fsdp", "tp", None)),
                     fill={"shape": str(_SPEC_SHAPE), "given": str(_SPEC_GIVEN), "mesh": str(_SPEC_MESH)}),
    "04.order": _Code(["load_model", "apply_lora", "set_remat", "train"], _judge_04_order,
                      (["load_model", "set_remat", "apply_lora", "train"],
                       ["apply_lora", "load_model", "set_remat", "train"]),
                      fill={"steps": ", ".join(map(repr, _STEPS))}),
    "04.policy": _Code("decoder", _judge_04_policy, ("block", "dots", "full")),
    "05.mask": _Code(solution_05_mask, _judge_05_mask, (_wrong_05_all, _wrong_05_no_eot, _wrong_05_first_turn)),
    "05.use": _Code(0.3288, _judge_05_use, (0.822, 32.88, 0.6712),
                    fill={"lengths": ", ".join(map(str, _USE_LENGTHS)), "max_len": str(_USE_MAX_LEN)}),
    "06.accum": _Code(8, _judge_06_accum, (4, 2)),
    "06.steps": _Code(369, _judge_06_steps, (1250, 27), fill={
        "examples": f"{_STEPS_EXAMPLES:,}", "examples_arg": str(_STEPS_EXAMPLES), "max_len": str(_STEPS_MAX_LEN)}),
    "07.delta_q": _Code(solution_07_q, _judge_07_q, (_wrong_07_q_layout, _wrong_07_q_unscaled)),
    "07.delta_v": _Code(solution_07_v, _judge_07_v, (_wrong_07_v_is_k,)),
    "08.flags": _Code(
        {"tensor_parallel_size": 8, "max_model_len": 16384, "kv_cache_dtype": "auto", "gpu_memory_utilization": 0.90},
        _judge_08_flags,
        ({"tensor_parallel_size": 2, "max_model_len": 16384, "kv_cache_dtype": "auto",
          "gpu_memory_utilization": 0.90},
         {"tensor_parallel_size": 8, "max_model_len": 16384, "kv_cache_dtype": "auto",
          "gpu_memory_utilization": 0.25},
         {"tensor_parallel_size": 6, "max_model_len": 16384, "kv_cache_dtype": "auto",
          "gpu_memory_utilization": 0.90},
         {"tensor_parallel_size": 8, "max_model_len": 16384, "kv_cache_dtype": "auto",
          "gpu_memory_utilization": 0.90, "disable_log_requests": True})),
    "09.pass": _Code(1 - math.comb(_PASS_N - _PASS_C, _PASS_K) / math.comb(_PASS_N, _PASS_K), _judge_09_pass,
                     (0.3, 1 - 0.7 ** 5), fill={"n": str(_PASS_N), "c": str(_PASS_C), "k": str(_PASS_K)}),
    "09.mean": _Code({1: 0.35, 5: (0 + (1 - 21 / 252) + 1 + 0.5) / 4}, _judge_09_mean,
                     ({1: 14 / 40, 5: 1 - math.comb(26, 5) / math.comb(40, 5)},),
                     fill={"counts": str(list(_PASS_COUNTS))}),
    "10.ratio": _Code(5.39 * 22.12 / (3.34 * 16.80), _judge_10_ratio,
                      (5.39 / 3.34, 3.34 * 16.80 / (5.39 * 22.12))),
    "10.per_million": _Code(21.52 / (1400 * 3600) * 1e6, _judge_10_per_million, (21.52 / 1400 * 1e6,),
                            fill={"tok_s": f"{_SERVE_TOK_S:g}"}),
}


def _entry_problems(key: str, entry: dict, code: _Code) -> list[str]:
    """How one entry of the data file disagrees with its exercise's code."""
    problems = [f"{key} has no {f}" for f in REQUIRED_TEXTS if f not in entry]
    problems += [f"{key}.{f} is not a text field ({', '.join(REQUIRED_TEXTS + OPTIONAL_TEXTS)})"
                 for f in entry if f not in REQUIRED_TEXTS + OPTIONAL_TEXTS]
    texts = {f: v for f, v in entry.items() if isinstance(v, str)}
    problems += [f"{key}.{f} is not a string" for f in entry if f not in texts]
    problems += [f"{key}.{f} has a $ that is neither $name nor $$" for f, v in texts.items()
                 if not string.Template(v).is_valid()]
    used = {n for v in texts.values() for n in string.Template(v).get_identifiers()}
    problems += [f"{key} shows ${n}, which its code does not fill" for n in sorted(used - set(code.fill))]
    problems += [f"{key}'s code fills ${n}, which none of its texts shows" for n in sorted(set(code.fill) - used)]
    return problems


def text_problems(texts: dict) -> list[str]:
    """How the data file's ``texts`` (its parsed TOML) and the exercises' code disagree; empty when they agree."""
    problems = [f"{k} has texts but no exercise in exercises.py" for k in texts if k not in _CODE]
    for key, code in _CODE.items():
        if key in texts:
            problems += _entry_problems(key, texts[key], code)
        else:
            problems.append(f"{key} is an exercise in exercises.py with no texts")
    return problems


def build_exercises(texts: dict) -> dict[str, Exercise]:
    """Each exercise from its texts (the $names filled in) and its code, in the code's order."""
    problems = text_problems(texts)
    if problems:
        raise ExerciseError(f"{TEXTS_FILE} disagrees with exercises.py: {'; '.join(problems)}.")
    return {key: Exercise(key, solution=code.solution, judge=code.judge, wrong=code.wrong,
                          **{f: string.Template(v).substitute(code.fill) for f, v in texts[key].items()})
            for key, code in _CODE.items()}


EXERCISES: dict[str, Exercise] = build_exercises(tomllib.loads(TEXTS_FILE.read_text(encoding="utf-8")))


# ---------------------------------------------------------------------------------------------- the API


def _get(key: str) -> Exercise:
    if key not in EXERCISES:
        raise KeyError(f"No exercise {key!r}. Exercises: {', '.join(EXERCISES)}.")
    return EXERCISES[key]


def keys(notebook: str | int | None = None) -> list[str]:
    """The exercise keys, all or one notebook's (``"02"``, ``2`` or ``"02_lora_naming"``)."""
    if notebook is None:
        return list(EXERCISES)
    nb = f"{int(str(notebook)[:2]):02d}"
    return [k for k, e in EXERCISES.items() if e.notebook == nb]


def check(key: str, answer) -> Feedback:
    """Judge ``answer`` to exercise ``key``: right, wrong (why + a hint), or not attempted (``answer is None``).

    Never raises on a bad answer (a learner's function that raises is a wrong answer); an unknown key raises
    KeyError, listing the exercises."""
    ex = _get(key)
    if answer is None:
        return Feedback(key, NOT_ATTEMPTED, f"replace `answer = None` with your answer ({ex.answer_hint}) and rerun "
                                            f"the cell. Task: {ex.title}.")
    try:
        why = ex.judge(answer)
    except _Wrong as e:
        why = str(e)
    except Exception as e:  # a malformed answer must not break the notebook
        why = f"checking it raised {type(e).__name__}: {e}"
    if why is None:
        return Feedback(key, RIGHT, ex.right_note or "")
    return Feedback(key, WRONG, why, ex.hint)


def solution(key: str):
    """The solution of exercise ``key`` (a value, or a function); for teachers and the tests."""
    return _get(key).solution


def _show(value) -> str:
    if callable(value):
        return inspect.getsource(value).rstrip()
    return repr(value)


def format_solutions(notebook: str | int | None = None) -> str:
    """Tasks and solutions as text (``python -m gemma_tpu_helpers solutions 02``)."""
    chosen = keys(notebook)
    if not chosen:
        raise ExerciseError(f"No exercises for notebook {notebook!r}; notebooks with exercises: "
                            f"{', '.join(sorted({e.notebook for e in EXERCISES.values()}))}.")
    blocks = []
    for k in chosen:
        ex = EXERCISES[k]
        blocks.append(f"== {k}: {ex.title}\n{ex.task}\n-- solution:\n{_show(solution(k))}"
                      + (f"\n-- why: {ex.right_note}" if ex.right_note else ""))
    return "\n\n".join(blocks)

