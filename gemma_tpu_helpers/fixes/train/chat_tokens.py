"""Chat rows to token ids with an assistant-only loss mask: what is trained on of a CodeV-R1 response
(:func:`training_target`), the row as chat messages (:func:`to_messages`), the prompt and answer as the chat template
renders them (:func:`split_answer`: never a guess), and their ids with the mask (:func:`tokenize_example`,
:func:`tokenize_rows` for a dataset).
"""

from __future__ import annotations

import itertools
import re

import numpy as np

from ..core.errors import DataError

THINK_RE = re.compile(r"<think>.*?</think>\s*", re.S)
ANSWER_RE = re.compile(r"<answer>(.*?)(?:</answer>|\Z)", re.S)  # an unclosed <answer> runs to the end
VERILOG_FENCE_RE = re.compile(r"```(?:verilog|systemverilog)[^\n]*\n(.*?)```", re.S | re.I)
TARGETS = ("full", "answer", "verilog")
SYSTEM_SOURCES = ("none", "fixed", "row")


def training_target(response: str, target: str = "answer") -> str:
    """What is trained on from a CodeV-R1 response (``<think>...</think>`` then ``<answer>...</answer>``).

    ``"full"``: all of it; ``"answer"``: the first ``<answer>`` block's content (else what follows the reasoning),
    prose included; ``"verilog"``: the answer's fenced Verilog blocks only, all of them (an answer without one stays
    as it is). Reasoning cut off before ``</think>`` leaves ``""`` (:func:`prepare` drops such rows)."""
    if target not in TARGETS:
        raise DataError(f"target must be one of {TARGETS}, not {target!r}.")
    if target == "full":
        return response
    text = THINK_RE.sub("", response)
    text = text.split("<think>", 1)[0]  # an unclosed <think>: the rest is reasoning
    found = ANSWER_RE.search(text)
    answer = (found.group(1) if found else text).strip()
    if target == "verilog":
        blocks = [b.strip("\n") for b in VERILOG_FENCE_RE.findall(answer)]
        if blocks:
            return "\n\n".join(f"```verilog\n{b}\n```" for b in blocks)
    return answer


def to_messages(row: dict, strip_think: bool = True, system_prompt: str | None = None, system: str = "fixed",
                target: str | None = None) -> list[dict]:
    """A row as chat messages: an optional system turn, the user's prompt, the assistant's training target.
    ``system``: "none", "fixed" (``system_prompt``, when given) or "row" (the row's ``system``, else
    ``system_prompt``). ``target``: see :func:`training_target`; default "answer" ("full" without ``strip_think``)."""
    if system not in SYSTEM_SOURCES:
        raise DataError(f"system must be one of {SYSTEM_SOURCES}, not {system!r}.")
    response = training_target(row["response"], target or ("answer" if strip_think else "full"))
    content = {"none": None, "fixed": system_prompt, "row": row.get("system") or system_prompt}[system]
    messages = [{"role": "system", "content": content}] if content else []
    return messages + [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": response}]


def spec_messages(row: dict, spec) -> list[dict]:
    """:func:`to_messages` with a :class:`DataSpec`'s settings."""
    return to_messages(row, system_prompt=spec.system_prompt, system=spec.system, target=spec.target)


def stop_token_ids(tokenizer) -> list[int]:
    """The ids that end a generation: ``generation_config.json``'s ``eos_token_id`` beside the tokenizer's files
    (Gemma 4 -it: ``<eos>``, ``<turn|>``, ``<|tool_response>``), else the tokenizer's eos and end-of-turn."""
    import json
    from pathlib import Path

    path = Path(getattr(tokenizer, "name_or_path", "") or ".") / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is not None:
            return [int(i) for i in (eos if isinstance(eos, list) else [eos])]
    named = getattr(tokenizer, "eot_token", None)
    ids = [tokenizer.eos_token_id] + ([tokenizer.convert_tokens_to_ids(named)] if named else [])
    return list(dict.fromkeys(i for i in ids if i is not None))


def end_of_turn(tokenizer) -> tuple[str, int]:
    """The token that closes a turn, as ``(token, id)``: the tokenizer's named ``eot_token`` (Gemma 4: ``<turn|>``),
    else the first stop id of the generation config that is not ``<eos>`` (Gemma 3: ``<end_of_turn>``), else eos."""
    named = getattr(tokenizer, "eot_token", None)
    if named:
        return named, tokenizer.convert_tokens_to_ids(named)
    for tid in stop_token_ids(tokenizer):
        if tid != tokenizer.eos_token_id:
            return tokenizer.convert_ids_to_tokens(tid), tid
    return tokenizer.eos_token, tokenizer.eos_token_id


def end_of_turn_id(tokenizer) -> int:
    return end_of_turn(tokenizer)[1]


def _template_name(tokenizer, chat_template) -> str:
    if chat_template is not None:
        return "the chat template passed in"
    return f"the chat template of {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__}"


def split_answer(tokenizer, messages: list[dict], chat_template: str | None = None) -> tuple[str, str, str]:
    """``(prompt, answer, end_of_turn)`` as the chat template renders a conversation ending in the answer: ``prompt``
    as the model sees it at inference, ``answer`` as the template writes it. Raises :class:`DataError` naming the
    template when the answer cannot be located: never a guess."""
    import os

    if not messages or messages[-1].get("role") != "assistant":
        raise DataError("The last message must be the assistant's answer (role 'assistant'): it is what is trained.")
    kw = {} if chat_template is None else {"chat_template": chat_template}
    where = _template_name(tokenizer, chat_template)
    history = tokenizer.apply_chat_template(messages[:-1], tokenize=False, **kw)
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True, **kw)
    full = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    if not (prompt.startswith(history) and full.startswith(history)):
        raise DataError(f"{where} renders the earlier turns differently once the answer or the generation prompt is "
                        f"added, so the answer cannot be located for the loss mask.")
    gen, turn = prompt[len(history):], full[len(history):]
    if turn.startswith(gen):  # Gemma 3, Gemma 4 E2B/E4B: the generation prompt opens the answer's turn
        header = gen
    else:  # Gemma 4 26B/31B: the answer's turn shares the turn header, not the empty thought channel
        common = os.path.commonprefix([gen, turn])
        header = common[: common.rfind("\n") + 1]
    eot, _ = end_of_turn(tokenizer)
    end = turn.find(eot, len(header)) if header else -1
    if end < 0:
        raise DataError(
            f"{where} does not close the answer with the tokenizer's end-of-turn token {eot!r} (its rendered answer "
            f"turn starts {turn[:40]!r}). Is the template for another model family? A Gemma 3 template "
            f"(<start_of_turn>/<end_of_turn>) on a Gemma 4 tokenizer is the classic case.")
    answer = turn[len(header):end]
    if not answer.strip():
        raise DataError(f"{where} renders the assistant's answer as empty; nothing would be trained.")
    return prompt, answer, eot


def tokenize_example(tokenizer, messages: list[dict],
                     chat_template: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and an assistant-only loss mask (1 on the answer and its end-of-turn token) of the prompt as at
    inference, then the answer, each tokenised on its own, with one ``<bos>``. ``chat_template`` overrides the
    tokenizer's."""
    prompt, answer, eot = split_answer(tokenizer, messages, chat_template)
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    a_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    return _join_example(tokenizer, p_ids, a_ids, eot, chat_template)


def _join_example(tokenizer, p_ids: list[int], a_ids: list[int], eot: str, chat_template: str | None = None):
    """The ids of one example from its tokenised prompt and answer (:func:`tokenize_example`), and its loss mask."""
    bos = tokenizer.bos_token_id
    if bos is not None and bos not in p_ids:
        p_ids = [bos] + p_ids  # a template that leaves <bos> to the tokenizer
    n = len(p_ids) + len(a_ids) + 1
    ids = np.fromiter(itertools.chain(p_ids, a_ids, (tokenizer.convert_tokens_to_ids(eot),)), np.int32, n)
    if bos is not None and np.count_nonzero(ids == bos) != 1:
        raise DataError(f"{_template_name(tokenizer, chat_template)} gives {np.count_nonzero(ids == bos)} <bos> tokens "
                        f"in one example; there must be exactly one.")
    mask = np.zeros(n, np.int8)
    mask[len(p_ids):] = 1
    return ids, mask


TRAINED_MARKS = ("\u27e6", "\u27e7")  # ⟦ ⟧ around the tokens the loss is computed on


def show_example(tokenizer, messages: list[dict], chat_template: str | None = None) -> dict:
    """One example as it is trained: the decoded sequence with the trained-on spans inside ⟦ ⟧, and counts."""
    ids, mask = tokenize_example(tokenizer, messages, chat_template)
    pieces, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = tokenizer.decode(ids[start:i].tolist(), skip_special_tokens=False)
            pieces.append(f"{TRAINED_MARKS[0]}{text}{TRAINED_MARKS[1]}" if mask[start] else text)
            start = i
    return {"text": "".join(pieces), "tokens": len(ids), "trained_tokens": int(mask.sum()),
            "prompt_tokens": int(len(ids) - mask.sum())}


TOKENIZE_BATCH = 256  # rows per batched tokenizer call in tokenize_rows


def _encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """``tokenizer(text, add_special_tokens=False)["input_ids"]`` for each text, in one batched call: through
    ``encode_batch_fast`` where that gives the same ids (a plain Rust-backed tokenizer), which skips the character
    offsets a plain call computes and drops (about a quarter of the tokenising time)."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    rust = getattr(tokenizer, "backend_tokenizer", None)
    if (isinstance(tokenizer, TokenizersBackend) and type(tokenizer)._encode_plus is TokenizersBackend._encode_plus
            and rust.truncation is None and rust.padding is None
            and rust.encode_special_tokens == tokenizer.split_special_tokens):
        return [e.ids for e in rust.encode_batch_fast(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def tokenize_rows(rows, tokenizer, strip_think: bool = True, progress: bool = True,
                  system_prompt: str | None = None, spec=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, mask) per row, as :func:`tokenize_example` gives them; ``spec`` (a DataSpec) sets the system turn and
    target. Batches are tokenised on a second thread while the template renders the next (the Rust tokenizer
    releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    def messages(r):
        return spec_messages(r, spec) if spec is not None else to_messages(r, strip_think, system_prompt)

    def encode(batch):
        ids = _encode_texts(tokenizer, [p for p, _, _ in batch] + [a for _, a, _ in batch])
        return [_join_example(tokenizer, p, a, eot)
                for p, a, (_, _, eot) in zip(ids[:len(batch)], ids[len(batch):], batch)]

    out = []
    with tqdm(total=len(rows), desc="tokenizing", disable=not progress) as bar, ThreadPoolExecutor(1) as pool:
        pending, batch = None, []
        for i, r in enumerate(rows):  # any sequence of rows (a list, a datasets.Dataset)
            batch.append(split_answer(tokenizer, messages(r)))
            if len(batch) == TOKENIZE_BATCH or i == len(rows) - 1:
                if pending is not None:
                    out += pending.result()
                    bar.update(len(out) - bar.n)
                pending, batch = pool.submit(encode, batch), []
        if pending is not None:
            out += pending.result()
            bar.update(len(out) - bar.n)
    return out
