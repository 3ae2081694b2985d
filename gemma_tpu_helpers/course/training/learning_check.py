"""The learning check (notebooks 06 and 09, ``python -m gemma_tpu_helpers learn``): does the whole chain turn
training into a better model? A LoRA is trained on K eval problems exactly as the eval sends them, merged, served
with vLLM and sampled greedily; iverilog scores pass@1 before and after.

This is memorisation on purpose (the problems scored are those trained on): a chain that cannot learn four examples
by heart has a broken link. Held-out problems, scored beside them, show it says nothing about generalisation.
``broken=`` breaks one link (:data:`BROKEN`) to show that the check can fail.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np

from ...fixes.core.errors import GemmaTpuError
from ...fixes.core.file_io import write_atomic
from ...fixes.eval import eval_problems, eval_sample, eval_score
from ...fixes.export.merge import merge_lora
from ...fixes.model.chat_format import GEMMA3_CHAT_TEMPLATE
from ...fixes.serve import vllm_server
from ...fixes.train import chat_tokens, packing
from ...fixes.train import data as data_lib
from ..config import base_model, paths, profiles
from . import train

# One link broken each: what it breaks, and what it does instead.
BROKEN = {
    "gemma3-template": "the answers are trained under Gemma 3's chat template (<start_of_turn>...<end_of_turn>) and "
                       "served under Gemma 4's: the paper's trap",
    "prompt-mask": "the loss is on the prompt's tokens instead of the answer's",
    "lora-dropped": "the merge drops the LoRA: the 'merged' model is the base's tensors",
    "base-served": "the base model is served instead of the merged one",
}
GENERATORS = ("vllm", "transformers")
RESULT = "learn.json"  # the scores
TRAINED = "trained.json"  # the trained and merged model


class LearnError(GemmaTpuError, ValueError):
    pass


def check_profile(profile) -> None:
    if profile.learn is None:
        names = ", ".join(p.name for p in _profiles_with_learn())
        raise LearnError(f"Profile {profile.name!r} has no learning check (its `learn` spec is None); {names} have "
                         f"one: --profile {names.split(', ')[0]}.")


def _profiles_with_learn():
    return [p for p in profiles.PROFILES.values() if p.learn is not None]


def by_length(problems=None) -> list[str]:
    """Task ids, the shortest reference first (the quickest to learn; ties by id): the shipped problems by default."""
    problems = problems if problems is not None else eval_problems.load_problems(paths.SHIPPED_EVAL)
    return [p.task_id for p in sorted(problems, key=lambda p: (len(eval_problems.reference_code(p)), p.task_id))]


def default_tasks(k: int, held_out: int, problems=None) -> tuple[list[str], list[str]]:
    """The ``k`` problems with the shortest references (the quickest to learn), and the ``held_out`` next shortest."""
    ids = by_length(problems)
    if k + held_out > len(ids):
        raise LearnError(f"{k} trained + {held_out} held-out problems: the problem set has only {len(ids)}.")
    return sorted(ids[:k]), sorted(ids[k:k + held_out])  # in task-id order, as load_problems returns them


def answer(problem) -> str:
    """What the model is taught to answer: the reference, renamed TopModule, in the ```verilog fence the eval asks
    for."""
    return f"```verilog\n{eval_problems.reference_code(problem).strip()}\n```"


def example(tokenizer, problem, broken: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, loss mask) of one problem: the eval's messages and the answer, under the checkpoint's chat template.

    ``broken="prompt-mask"`` flips the mask onto the prompt. ``broken="gemma3-template"`` renders the conversation
    with Gemma 3's template instead, built by hand: ``chat_tokens.split_answer`` refuses that template on a Gemma 4
    tokenizer (its end-of-turn token is not Gemma 4's), which is the check that catches the paper's trap.
    """
    messages = eval_problems.prompt_messages(problem) + [{"role": "assistant", "content": answer(problem)}]
    if broken == "gemma3-template":
        prompt = tokenizer.apply_chat_template(messages[:-1], chat_template=GEMMA3_CHAT_TEMPLATE, tokenize=False,
                                               add_generation_prompt=True)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tokenizer(answer(problem) + "<end_of_turn>\n", add_special_tokens=False)["input_ids"]
        return np.array(p_ids + a_ids, np.int32), np.array([0] * len(p_ids) + [1] * len(a_ids), np.int8)
    ids, mask = chat_tokens.tokenize_example(tokenizer, messages)
    return (ids, 1 - mask) if broken == "prompt-mask" else (ids, mask)


def training_rows(tokenizer, problems, fsdp: int, broken: str | None = None):
    """The rows of one optimizer step: every problem once, one per row (no packing), cycled up to a multiple of the
    fsdp axis (which splits the batch), padded to the longest rounded up to 64 tokens. Returns the
    ``data.Prepared`` that ``train.train`` takes, the number of rows (the micro-batch) and the sequence length."""
    examples = [example(tokenizer, p, broken) for p in problems]
    rows = math.ceil(len(examples) / fsdp) * fsdp
    examples = [examples[i % len(examples)] for i in range(rows)]
    seq = math.ceil(max(len(ids) for ids, _ in examples) / 64) * 64
    packed = packing.pad_to_max(examples, seq, pad_id=tokenizer.pad_token_id or 0)
    return data_lib.Prepared(packed, None, np.array([len(ids) for ids, _ in examples])), rows, seq


def learn_profile(profile, micro_batch: int, seq: int):
    """The profile with the learning check's LoRA and training settings (its ``learn`` spec): one optimizer step
    per pass over the problems, ``steps`` passes, cosine decay from the first step, a checkpoint at the end only."""
    spec = profile.learn
    t = dataclasses.replace(profile.train, learning_rate=spec.learning_rate, warmup_steps=0, weight_decay=0.0,
                            micro_batch=micro_batch, grad_accum=1, max_seq_len=seq, epochs=spec.steps,
                            max_steps=spec.steps, eval_every=spec.steps + 1, checkpoint_every=spec.steps,
                            keep_checkpoints=1)
    lora = dataclasses.replace(profile.lora, rank=spec.rank, alpha=spec.alpha, dropout=0.0)
    return dataclasses.replace(profile, train=t, lora=lora)


# ---------------------------------------------------------------------------------------------------------------
# Answers: vLLM (what the course serves) or transformers (the same greedy answers in-process, for quick checks)

def vllm_answers(target, model_dir, problems, max_tokens: int, progress: bool = True) -> tuple[list[dict], float]:
    """Serve ``model_dir`` with vLLM, ask for one greedy answer per problem, stop. Returns the rows and the seconds
    the server took to start."""
    paths.serve_python(check=True)  # the course's venv: say `make serve-venv` when it is missing
    with vllm_server.start(target, model_dir, progress=progress) as server:
        rows = eval_sample.sample_completions(server.base_url, server.served_name, problems, n=1, temperature=0.0,
                                           top_k=eval_sample.NO_TOP_K, max_tokens=max_tokens, progress=progress)
        return rows, server.start_s


def transformers_answers(model_dir, problems, max_tokens: int) -> list[dict]:
    """The greedy answers transformers gives on the same prompt vLLM's chat endpoint renders (the checkpoint's chat
    template, thinking off), up to the first stop token of its generation config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stops = set(chat_tokens.stop_token_ids(tokenizer))
    rows = []
    with torch.no_grad():
        for p in problems:
            inputs = tokenizer.apply_chat_template(eval_problems.prompt_messages(p), add_generation_prompt=True,
                                                   enable_thinking=False, return_tensors="pt", return_dict=True)
            out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, top_k=None, top_p=None)
            new = out[0, inputs["input_ids"].shape[1]:].tolist()
            ended = next((i for i, t in enumerate(new) if t in stops), None)
            rows.append({"task_id": p.task_id, "sample_index": 0,
                         "completion": tokenizer.decode(new[:ended], skip_special_tokens=False),
                         "finish_reason": "stop" if ended is not None else "length"})
    return rows


# ---------------------------------------------------------------------------------------------------------------
# The check

@dataclasses.dataclass
class LearnResult:
    profile: str
    tasks: list[str]  # trained on, and scored
    held_out: list[str]  # scored, never trained on
    broken: str | None
    generator: str
    before: "object"  # eval_score.score_completions results of the base model (a DataFrame)
    after: "object"  # ... of the model that was served after training
    losses: list[float]  # the training loss per step
    settings: dict
    seconds: dict  # per stage

    def rows(self, which: str, held_out: bool = False):
        """The ``before`` or ``after`` results of the trained problems, or of the held-out ones."""
        res = getattr(self, which)
        return res[res["task_id"].isin(self.held_out if held_out else self.tasks)]

    def pass_at_1(self, which: str, held_out: bool = False) -> float:
        sel = self.rows(which, held_out)
        return eval_score.pass_at_k_table(sel, (1,))[1] if len(sel) else float("nan")

    def line(self) -> str:
        """``pass@1 before X after Y``, then the held-out problems' figures."""
        out = f"pass@1 before {self.pass_at_1('before'):.2f} after {self.pass_at_1('after'):.2f}"
        if self.held_out:
            out += (f" ({len(self.tasks)} trained problems; {len(self.held_out)} held out: before "
                    f"{self.pass_at_1('before', True):.2f} after {self.pass_at_1('after', True):.2f})")
        return out

    def table(self):
        """One row per problem: trained or held out, and its category before and after."""
        import pandas as pd

        rows = []
        for group, ids in (("trained", self.tasks), ("held out", self.held_out)):
            for t in ids:
                b = self.before[self.before["task_id"] == t].iloc[0]
                a = self.after[self.after["task_id"] == t].iloc[0]
                rows.append({"task_id": t, "set": group, "before": b["category"], "after": a["category"]})
        return pd.DataFrame(rows)

    def to_json(self) -> dict:
        return {"profile": self.profile, "tasks": self.tasks, "held_out": self.held_out, "broken": self.broken,
                "generator": self.generator, "before": eval_score.records(self.before),
                "after": eval_score.records(self.after), "losses": self.losses, "settings": self.settings,
                "seconds": self.seconds}

    @classmethod
    def from_json(cls, d: dict) -> LearnResult:
        import pandas as pd

        return cls(**{**d, "before": pd.DataFrame(d["before"]), "after": pd.DataFrame(d["after"])})


def settings(profile, tasks, broken) -> dict:
    """What the trained and merged model depends on: the learn spec, the LoRA targets, the base model, the problems
    trained on, the seed (the LoRA's initial A and the rows' order) and the broken link."""
    return {"learn": dataclasses.asdict(profile.learn), "lora_targets": list(profile.lora.targets),
            "model": dataclasses.asdict(profile.model), "tasks": list(tasks), "seed": profile.train.seed,
            "broken": broken}


def with_seed(profile, seed: int | None):
    """The profile with its training seed set to ``seed`` (``None``: unchanged)."""
    if seed is None:
        return profile
    return dataclasses.replace(profile, train=dataclasses.replace(profile.train, seed=seed))


def learn_dir(profile, run_dir=None, broken: str | None = None) -> Path:
    """``runs/<profile>/learn`` (``learn-<broken>`` for a broken variant), in the run's local directory."""
    return profiles.resolve_run(profile, run_dir).local / ("learn" if broken is None else f"learn-{broken}")


def score(problems, rows):
    """``eval_score.score_completions`` of the answers: one result row per problem (pass@1 from one greedy answer)."""
    results, _ = eval_score.score_completions(problems, rows, ks=(1,), progress=False, iverilog=paths.iverilog())
    return results


def _cached(path: Path, wanted: dict) -> dict | None:
    if path.is_file():
        found = json.loads(path.read_text())
        if found.get("settings") == wanted:
            return found
    return None


@dataclasses.dataclass
class Trained:
    model_dir: Path  # what is served after training: the merged model (the base, for broken="base-served")
    losses: list[float]  # per step; empty where the broken link skips training
    seconds: dict


def _problems(profile, tasks, held_out):
    spec = profile.learn
    if tasks is None or held_out is None:
        default_trained, default_held = default_tasks(spec.tasks, spec.held_out)
        tasks = default_trained if tasks is None else tasks
        held_out = [t for t in default_held if t not in tasks] if held_out is None else held_out
    tasks, held_out = list(dict.fromkeys(tasks)), list(dict.fromkeys(held_out))
    if not tasks:
        raise LearnError("No problem to train on: give at least one task id.")
    both = sorted(set(tasks) & set(held_out))
    if both:
        raise LearnError(f"{', '.join(both)} cannot be both trained on and held out.")
    return (eval_problems.load_problems(paths.SHIPPED_EVAL, tasks=tasks),
            eval_problems.load_problems(paths.SHIPPED_EVAL, tasks=held_out) if held_out else [])


def _check_args(profile, broken, generator="vllm") -> None:
    check_profile(profile)
    if broken is not None and broken not in BROKEN:
        raise LearnError(f"broken must be one of {', '.join(BROKEN)}, not {broken!r}.")
    if generator not in GENERATORS:
        raise LearnError(f"generator must be one of {', '.join(GENERATORS)}, not {generator!r}.")


def train_check(profile, tasks=None, run_dir=None, broken: str | None = None, progress: bool = True,
                log=print) -> Trained:
    """The training half of the check (notebook 06): train the LoRA on ``tasks`` (default: the profile's
    ``learn.tasks`` problems with the shortest references) and merge it into the base. Cached in
    :func:`learn_dir`: a finished run with the same settings is read back (delete the directory to redo it).

    ``broken="lora-dropped"`` and ``"base-served"`` never read the trained LoRA, so they skip the training."""
    _check_args(profile, broken)
    trained, _ = _problems(profile, tasks, [])
    run_dir = profiles.resolve_run(profile, run_dir)
    out = learn_dir(profile, run_dir, broken)
    wanted = settings(profile, [p.task_id for p in trained], broken)
    found = _cached(out / TRAINED, wanted)
    if found:
        return Trained(Path(found["model_dir"]), found["losses"], found["seconds"])
    shutil.rmtree(out, ignore_errors=True)  # a check with other settings, or one that did not finish: start over
    out.mkdir(parents=True)
    spec = profile.learn
    base = base_model.ensure_base(profile, run_dir)
    seconds, losses = {}, []
    if broken not in ("lora-dropped", "base-served"):
        from transformers import AutoTokenizer

        fsdp = dict(profile.hardware.mesh).get("fsdp", 1)
        prepared, rows, seq = training_rows(AutoTokenizer.from_pretrained(base), trained, fsdp, broken)
        log(f"training the LoRA (r{spec.rank}) on {len(trained)} problems: {spec.steps} steps of {rows} rows x "
            f"{seq} tokens at lr {spec.learning_rate:g}" + (f"; broken: {BROKEN[broken]}" if broken else ""))
        t0 = time.perf_counter()
        result = train.train(learn_profile(profile, rows, seq), run_dir=out, base_dir=base, prepared=prepared,
                             progress=progress)
        seconds["train"] = round(time.perf_counter() - t0, 1)
        losses = [float(x) for x in result.metrics["loss"].dropna()]
        log(f"trained in {seconds['train']:.0f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    model_dir = out / "merged"
    t0 = time.perf_counter()
    if broken == "base-served":
        model_dir = base
    elif broken == "lora-dropped":  # what a merge that matches no LoRA writes: the base's tensors
        shutil.copytree(base, model_dir)
    else:
        merge_lora(base, result.checkpoint_dir, model_dir, overwrite=True, progress=progress)
    seconds["merge"] = round(time.perf_counter() - t0, 1)
    write_atomic(out / TRAINED, json.dumps({"settings": wanted, "model_dir": str(model_dir), "losses": losses,
                                            "seconds": seconds}, indent=1))
    return Trained(model_dir, losses, seconds)


def learn(profile, tasks=None, held_out=None, run_dir=None, broken: str | None = None, generator: str = "vllm",
          before=None, progress: bool = True, log=print) -> LearnResult:
    """The whole check (notebook 09, ``learn``): :func:`train_check` (cached), then the base model and the trained
    one answer the problems greedily, and iverilog scores them: pass@1 before and after. ``held_out`` problems are
    scored and never trained on (default: the next ``learn.held_out`` shortest; ``[]`` for none). ``before``: the
    base model's results from an earlier check on the same problems, instead of scoring it again.

    ``generator``: ``"vllm"`` (the course's server, as notebook 08 starts it) or ``"transformers"`` (the same greedy
    answers in-process, no server: quicker, for the broken variants' tests). ``broken``: a key of :data:`BROKEN`.
    The result is kept in ``learn.json`` under :func:`learn_dir` and read back for the same settings.
    """
    _check_args(profile, broken, generator)
    trained, kept_out = _problems(profile, tasks, held_out)
    problems = trained + kept_out
    run_dir = profiles.resolve_run(profile, run_dir)  # once: train_check and the base take the Run
    out = learn_dir(profile, run_dir, broken)
    wanted = {**settings(profile, [p.task_id for p in trained], broken),
              "held_out": [p.task_id for p in kept_out], "generator": generator}
    found = _cached(out / RESULT, wanted) if before is None else None
    if found:
        log(f"learning check: reading the result in {out / RESULT} (same settings; delete {out} to redo it)")
        return LearnResult.from_json(found)
    spec = profile.learn
    seconds = {}

    def answers(model_dir, name):
        t0 = time.perf_counter()
        if generator == "vllm":
            target = dataclasses.replace(profile.serving, log_dir=out / f"serve-{name}")
            rows, start_s = vllm_answers(target, model_dir, problems, spec.max_tokens, progress)
            seconds[f"serve start ({name})"] = round(start_s, 1)
        else:
            rows = transformers_answers(model_dir, problems, spec.max_tokens)
        seconds[f"answers ({name})"] = round(time.perf_counter() - t0, 1)
        return score(problems, rows)

    done = train_check(profile, [p.task_id for p in trained], run_dir, broken, progress, log)
    if before is None:
        log(f"scoring the base model on {len(trained)} trained and {len(kept_out)} held-out problems")
        before = answers(base_model.ensure_base(profile, run_dir), "base")
    log(f"scoring the model served after training ({done.model_dir})")
    after = answers(done.model_dir, "after")
    res = LearnResult(profile.name, [p.task_id for p in trained], [p.task_id for p in kept_out], broken, generator,
                      before, after, done.losses, wanted, {**done.seconds, **seconds})
    write_atomic(out / RESULT, json.dumps(res.to_json(), indent=1, default=str))
    return res


def plot_losses(trained: Trained, ax=None):
    """The check's training loss per step (log scale: it falls by orders of magnitude when it memorises)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3))
    ax.plot(range(1, len(trained.losses) + 1), trained.losses, marker=".")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("The learning check: loss on the trained problems")
    ax.figure.tight_layout()
    return ax


def chart(result: LearnResult, ax=None):
    """Bars of pass@1 before and after, for the trained and the held-out problems, with each outcome's count."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.4))
    groups = [("trained", False)] + ([("held out", True)] if result.held_out else [])
    width = 0.38
    for j, (which, color) in enumerate((("before", "#bbbbbb"), ("after", "#2a9d8f"))):
        xs = [i + (j - 0.5) * width for i in range(len(groups))]
        vals = [result.pass_at_1(which, held) for _, held in groups]
        bars = ax.bar(xs, vals, width, color=color, label=f"{which} training")
        labels = [", ".join(f"{n} {c}" for c, n in eval_score.category_counts(result.rows(which, held)).items() if n)
                  for _, held in groups]
        ax.bar_label(bars, labels=[f"{v:.2f}\n{lab}" for v, lab in zip(vals, labels)], fontsize=8)
    ax.set_xticks(range(len(groups)), [f"{g} ({len(result.held_out if h else result.tasks)})" for g, h in groups])
    ax.set_ylim(0, 1.35)
    ax.set_ylabel("pass@1")
    ax.set_title(f"The learning check ({result.profile}): pass@1 before and after training"
                 + (f"\nbroken: {result.broken}" if result.broken else ""))
    ax.legend(loc="upper right", fontsize=8)
    ax.figure.tight_layout()
    return ax
