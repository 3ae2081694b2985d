"""Instruction data in the CodeV-R1 SFT schema (``system``, ``prompt``, ``response``), made into packed rows.

Every source (a local file, a local copy of a dataset repository, a Hub id) loads through ``datasets.load_dataset``.
:func:`prepare` is the whole pipeline: load, split, pick what is trained on (:func:`training_target`), tokenise with
an assistant-only loss mask, pack. :func:`batches` then feeds the packed rows to training.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import os
import re
import tempfile
from pathlib import Path

import numpy as np

from .errors import GemmaTpuError
from .file_io import is_remote, local_copy
from .forward_inputs import BATCH_DTYPES


@dataclasses.dataclass(frozen=True)
class DataSpec:
    # A local .jsonl/.json/.parquet file, a local dataset directory, a HF dataset id or a gs:// copy of one of those.
    source: str
    config: str | None = None  # the dataset's config: CodeV-R1 declares "sft" and "rl" and has no default
    split: str = "train"
    max_rows: int | None = None  # keep the first rows only (None: all)
    # What is trained on from a response (training_target): "answer", "verilog" or "full".
    target: str = "answer"
    # The system turn: "none", "fixed" (system_prompt) or "row" (the row's own `system` field, else system_prompt).
    system: str = "none"
    system_prompt: str | None = None
    overlong: str = "drop"  # "drop" or "trim" examples longer than max_seq_len
    eval_fraction: float = 0.05
    pack: bool = True
    columns: tuple[tuple[str, str], ...] = ()  # source column -> schema column, e.g. (("question", "prompt"),)
    cache_dir: str | None = None  # where a gs:// source's local copy goes (None: DEFAULT_GS_COPIES)

    @property
    def strip_think(self) -> bool:
        """True when the <think> reasoning is not trained on."""
        return self.target != "full"

REQUIRED = ("prompt", "response")
DEFAULT_GS_COPIES = Path(tempfile.gettempdir()) / "gs-data"  # a gs:// source's local copy, unless cache_dir says
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(GemmaTpuError, ValueError):
    pass


def load_dataset_args(source: str, config: str | None = None, cache_dir: str | os.PathLike | None = None
                      ) -> tuple[tuple, dict]:
    """``datasets.load_dataset`` arguments for a source: ``(path[, config]), kwargs``."""
    if is_remote(source):  # datasets reads a repository's configs from local files only: a synced local copy
        source = str(local_copy(source, cache_dir or DEFAULT_GS_COPIES))
    path = Path(os.path.abspath(os.path.expanduser(source)))  # a local file or folder, relative to the current dir
    if path.is_file():
        builder = _FILE_BUILDERS.get(path.suffix)
        if builder is None:
            raise DataError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(_FILE_BUILDERS)}.")
        if config:
            raise DataError(f"{path} is a single file: it has no configs, so drop config={config!r}.",
                            params=("config",))
        if path.stat().st_size == 0:  # datasets' json builder fails on it with a bare StopIteration
            raise DataError(f"{path} is empty: a data file needs at least one row.")
        return (builder,), {"data_files": str(path)}
    if path.is_dir():  # a local dataset directory
        source = str(path)
    # A dataset id on the Hub, or a local dataset directory: the same call either way.
    return ((source, config) if config else (source,)), {}


def _where(source: str, config: str | None, split: str) -> str:
    return f"{source!r}" + (f" (config {config!r}, split {split!r})" if config else f" (split {split!r})")


def load_rows(source: str, split: str = "train", columns: dict[str, str] | None = None,
              config: str | None = None, max_rows: int | None = None, cache_dir: str | os.PathLike | None = None):
    """A ``datasets.Dataset`` with ``prompt`` and ``response`` columns (and ``system`` where the source has it).

    - ``config``: the dataset's config, for repositories that declare several (``zhuyaoyu/CodeV-R1-dataset`` has
      ``sft`` and ``rl`` and no default).
    - ``columns`` renames a source's columns to the schema, e.g. ``{"instruction": "prompt", "output": "response"}``.
    - ``max_rows`` keeps the first rows only (the paper trained on the first 10,000 of the 87K).
    - ``cache_dir``: where a ``gs://`` source is copied to (``datasets`` reads a repository's configs locally).

    A missing config, split or column is a :class:`DataError` that lists the ones that exist.
    """
    import datasets

    if max_rows is not None and max_rows < 1:
        raise DataError(f"max_rows must be a positive number of rows (or None for all), got {max_rows}.")
    args, kwargs = load_dataset_args(source, config, cache_dir)
    where = _where(source, args[1] if len(args) > 1 else None, split)
    try:
        ds = datasets.load_dataset(*args, split=split, **kwargs)
    except FileNotFoundError as e:
        raise DataError(f"Could not find data source {source!r}: {e}. Give a local file or folder, "
                        f"or a dataset id.") from e
    except datasets.exceptions.DatasetGenerationError as e:
        cause = e.__cause__ or e
        raise DataError(f"Could not read the files of {where}: {type(cause).__name__}: {cause}. datasets picks one "
                        f"builder for a whole repository from its file types, so a config whose files are of another "
                        f"type fails this way; read those files directly, e.g. "
                        f"load_rows('path/to/file.parquet').") from e
    except ValueError as e:  # datasets: "Config name is missing", "BuilderConfig ... not found", "Unknown split"
        said = " ".join(str(e).split())
        raise DataError(f"Could not load {where}: {said} Use a config and split that exist, as listed "
                        f"(DataSpec.config / DataSpec.split, or load_rows(..., config=..., split=...); "
                        f"config=None for a source without configs).", params=("config", "split")) from e
    if columns:
        absent = [c for c in columns if c not in ds.column_names]
        if absent:
            raise DataError(f"Data source {where} has no column(s) {absent} to rename; its columns are "
                            f"{ds.column_names}. Fix DataSpec.columns (the real CodeV-R1 SFT rows need none).")
        ds = ds.rename_columns(columns)
    missing = [c for c in REQUIRED if c not in ds.column_names]
    if missing:
        raise DataError(
            f"Data source {where} lacks column(s) {missing}; it has {ds.column_names}. The CodeV-R1 SFT schema "
            f"needs {list(REQUIRED)}; map yours with columns={{'your_name': 'prompt', ...}}."
        )
    if len(ds) == 0:
        raise DataError(f"Data source {where} has no rows.")
    if max_rows is not None and max_rows < len(ds):
        ds = ds.select(range(max_rows))
    return ds


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


def load_call(spec) -> str:
    """The ``datasets.load_dataset`` call a DataSpec makes, as text (and the row limit it applies)."""
    args, kwargs = load_dataset_args(spec.source, spec.config, spec.cache_dir)
    parts = [repr(a) for a in args] + [f"split={spec.split!r}"] + [f"{k}={v!r}" for k, v in kwargs.items()]
    limit = f", then the first {spec.max_rows:,} rows" if spec.max_rows else ""
    return f"datasets.load_dataset({', '.join(parts)}){limit}"


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


@dataclasses.dataclass
class Packed:
    """Fixed-length rows holding one or more examples each: ``segment_ids`` number them from 1 (0 is padding),
    ``positions`` restart at 0 for each; together they give the block-diagonal causal mask."""

    tokens: np.ndarray  # [rows, max_seq_len] int32
    loss_mask: np.ndarray  # [rows, max_seq_len] int8: 1 where the token is an assistant target
    segment_ids: np.ndarray  # [rows, max_seq_len] int32
    positions: np.ndarray  # [rows, max_seq_len] int32
    stats: dict

    def __len__(self) -> int:
        return len(self.tokens)


def _fit(examples, max_seq_len: int, overlong: str):
    if overlong not in ("drop", "trim"):
        raise DataError(f"overlong must be 'drop' or 'trim', not {overlong!r}.")
    kept, dropped, trimmed = [], 0, 0
    for ids, mask in examples:
        if len(ids) > max_seq_len:
            if overlong == "drop":
                dropped += 1
                continue
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
            trimmed += 1
        kept.append((ids, mask))
    if not kept:
        shortest = min(len(ids) for ids, _ in examples) if examples else 0
        raise DataError(f"No example fits max_seq_len={max_seq_len}: the shortest has {shortest} tokens. "
                        f"Raise max_seq_len or set overlong='trim'.")
    return kept, dropped, trimmed


def pack(examples, max_seq_len: int, overlong: str = "drop", pad_id: int = 0) -> Packed:
    """Best-fit-decreasing packing of (ids, mask) examples into rows of ``max_seq_len`` tokens (deterministic)."""
    kept, dropped, trimmed = _fit(examples, max_seq_len, overlong)
    order = sorted(range(len(kept)), key=lambda i: (-len(kept[i][0]), i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (remaining space, row index), sorted
    for i in order:
        n = len(kept[i][0])
        j = bisect.bisect_left(free, (n, -1))
        if j == len(free):
            rows.append([i])
            bisect.insort(free, (max_seq_len - n, len(rows) - 1))
        else:
            space, r = free.pop(j)
            rows[r].append(i)
            bisect.insort(free, (space - n, r))
    return _layout([[kept[i] for i in row] for row in rows], max_seq_len, pad_id,
                   dict(examples=len(examples), kept=len(kept), dropped=dropped, trimmed=trimmed))


def pad_to_max(examples, max_seq_len: int, overlong: str = "drop", pad_id: int = 0) -> Packed:
    """One example per row, padded to ``max_seq_len`` (what the paper's pipeline did)."""
    kept, dropped, trimmed = _fit(examples, max_seq_len, overlong)
    return _layout([[e] for e in kept], max_seq_len, pad_id,
                   dict(examples=len(examples), kept=len(kept), dropped=dropped, trimmed=trimmed))


def _layout(rows, max_seq_len, pad_id, stats) -> Packed:
    shape = (len(rows), max_seq_len)
    tokens = np.full(shape, pad_id, BATCH_DTYPES["tokens"])
    loss_mask = np.zeros(shape, BATCH_DTYPES["loss_mask"])
    segment_ids = np.zeros(shape, BATCH_DTYPES["segment_ids"])
    positions = np.zeros(shape, BATCH_DTYPES["positions"])
    for r, row in enumerate(rows):
        at = 0
        for s, (ids, mask) in enumerate(row, start=1):
            n = len(ids)
            tokens[r, at:at + n], loss_mask[r, at:at + n] = ids, mask
            segment_ids[r, at:at + n], positions[r, at:at + n] = s, np.arange(n)
            at += n
    real = int((segment_ids > 0).sum())
    stats = dict(stats, rows=len(rows), max_seq_len=max_seq_len, real_tokens=real,
                 target_tokens=int(loss_mask.sum()), token_use=real / max(1, tokens.size))
    return Packed(tokens, loss_mask, segment_ids, positions, stats)


def token_use_for_lengths(lengths, max_seq_len: int) -> dict:
    """Token use of packing vs pad-to-max for a list of example lengths (no tokenizer needed)."""
    fake = [(np.zeros(n, np.int32), np.zeros(n, np.int8)) for n in lengths]
    packed, padded = pack(fake, max_seq_len), pad_to_max(fake, max_seq_len)
    return {"packed": packed.stats["token_use"], "pad_to_max": padded.stats["token_use"],
            "packed_rows": packed.stats["rows"], "padded_rows": padded.stats["rows"],
            "dropped": packed.stats["dropped"]}


def codev_like_lengths(n: int = 20000, mean: float = 922, p99: float = 2553, seed: int = 0) -> np.ndarray:
    """Example lengths from a log-normal with CodeV-R1's reported mean and 99th percentile (for what-if tables)."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.99)
    # mean = exp(mu + s^2/2), p99 = exp(mu + z s)  =>  s^2/2 - z s + ln(p99/mean) = 0
    s = z - np.sqrt(z * z - 2 * np.log(p99 / mean))
    mu = np.log(mean) - s * s / 2
    return np.maximum(8, np.random.RandomState(seed).lognormal(mu, s, n).round().astype(int))


def split_rows(rows, eval_fraction: float, seed: int):
    """A deterministic train/eval split of a ``datasets.Dataset`` (at least one eval row when asked for any)."""
    if not 0 <= eval_fraction < 1:
        raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction}.")
    n_eval = max(1, round(len(rows) * eval_fraction)) if eval_fraction > 0 else 0
    perm = np.random.RandomState(seed).permutation(len(rows))
    return rows.select(np.sort(perm[n_eval:])), rows.select(np.sort(perm[:n_eval]))


@dataclasses.dataclass
class Prepared:
    train: Packed
    eval: Packed
    lengths: np.ndarray  # tokens per training example, before fitting
    empty_targets: int = 0  # rows dropped before the split: no answer left (e.g. reasoning cut off)


NO_CONFIG = "none"  # with_source's config for a source without configs


def with_source(spec: DataSpec, source: str | None = None, config: str | None = None) -> DataSpec:
    """``spec`` reading from ``source`` (a copy of the repository, another dataset id, or a file) and/or with another
    ``config`` (``"none"``: no configs). Without a ``config`` a file drops the spec's, anything else keeps it."""
    if source is None and config is None:
        return spec
    if config is None:
        local = source is not None and (
            Path(source).suffix in _FILE_BUILDERS if is_remote(source) else os.path.isfile(os.path.expanduser(source)))
        config = None if local else spec.config
    elif config == NO_CONFIG:
        config = None
    return dataclasses.replace(spec, source=source or spec.source, config=config)


def load_profile_rows(spec):
    """The rows a profile's DataSpec names: its source, config, split, column mapping and row limit (another copy of
    the data: :func:`with_source`)."""
    return load_rows(spec.source, split=spec.split, columns=dict(spec.columns) or None, config=spec.config,
                     max_rows=spec.max_rows, cache_dir=spec.cache_dir)


def prepare(spec: DataSpec, tokenizer, max_seq_len: int, seed: int = 0, progress: bool = True) -> Prepared:
    """Load, split (``seed``), normalise, tokenise and pack to ``max_seq_len`` the data ``spec`` names."""
    rows = load_profile_rows(spec)
    kept = rows.filter(lambda r: bool(training_target(r["response"], spec.target).strip()))
    train_rows, eval_rows = split_rows(kept, spec.eval_fraction, seed)
    layout = pack if spec.pack else pad_to_max
    train_ex = tokenize_rows(train_rows, tokenizer, progress=progress, spec=spec)
    eval_ex = tokenize_rows(eval_rows, tokenizer, progress=progress, spec=spec)
    pad = tokenizer.pad_token_id or 0
    return Prepared(layout(train_ex, max_seq_len, spec.overlong, pad),
                    layout(eval_ex, max_seq_len, spec.overlong, pad) if eval_ex else None,
                    np.array([len(ids) for ids, _ in train_ex]), len(rows) - len(kept))


def batches(packed: Packed, global_batch: int, seed: int, epochs: int = 1, shuffle: bool = True,
            rows: slice | None = None):
    """A re-iterable grain ``MapDataset`` of this process's share of each global batch (deterministic for a seed).

    Every process shuffles and batches alike, then keeps ``rows`` of each batch: those its devices hold
    (``multihost.process_rows``); by default process ``i`` of ``n`` keeps the ``i``-th of ``n`` contiguous blocks."""
    import grain
    import jax

    if rows is None:
        procs, me = jax.process_count(), jax.process_index()
        if global_batch % procs:
            raise DataError(f"Global batch {global_batch} does not divide across {procs} processes: each process "
                            f"feeds an equal share. Use a global batch (micro_batch) that is a multiple of {procs}.")
        share = global_batch // procs
        rows = slice(me * share, (me + 1) * share)
    ds = grain.MapDataset.source(list(range(len(packed))))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(epochs).batch(global_batch, drop_remainder=True)
    ds = ds.map(lambda idx: idx[rows])
    return ds.map(lambda idx: {"tokens": packed.tokens[idx], "loss_mask": packed.loss_mask[idx],
                               "segment_ids": packed.segment_ids[idx], "positions": packed.positions[idx]})
