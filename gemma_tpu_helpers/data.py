"""Instruction data in the CodeV-R1 SFT schema (``prompt``, ``response`` with a fenced Verilog block).

One path for every source: the shipped self-written rows, a local .jsonl/.json/.parquet file or directory, or a
Hugging Face dataset id (the real ``zhuyaoyu/CodeV-R1-dataset`` on TPU) all go through ``datasets.load_dataset``.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
SHIPPED_SFT = DATA_DIR / "verilog_sft.jsonl"
SHIPPED_EVAL = DATA_DIR / "eval"
REQUIRED = ("prompt", "response")
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(ValueError):
    pass


def _load_dataset_args(source: str) -> tuple[tuple, dict]:
    if source == "shipped":
        return ("json",), {"data_files": str(SHIPPED_SFT)}
    path = Path(source)
    if path.is_file():
        builder = _FILE_BUILDERS.get(path.suffix)
        if builder is None:
            raise DataError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(_FILE_BUILDERS)}.")
        return (builder,), {"data_files": str(path)}
    # A dataset id on the Hub, or a local dataset directory: the same call either way.
    return (source,), {}


def load_rows(source: str = "shipped", split: str = "train", columns: dict[str, str] | None = None):
    """A ``datasets.Dataset`` with ``prompt`` and ``response`` columns.

    ``columns`` renames a source's columns to the schema, e.g. ``{"instruction": "prompt", "output": "response"}``.
    """
    import datasets

    args, kwargs = _load_dataset_args(source)
    try:
        ds = datasets.load_dataset(*args, split=split, **kwargs)
    except FileNotFoundError as e:
        raise DataError(f"Could not find data source {source!r}: {e}. Give 'shipped', a local file, or a dataset id.") from e
    if columns:
        ds = ds.rename_columns(columns)
    missing = [c for c in REQUIRED if c not in ds.column_names]
    if missing:
        raise DataError(
            f"Data source {source!r} lacks column(s) {missing}; it has {ds.column_names}. The CodeV-R1 SFT schema "
            f"needs {list(REQUIRED)}; map yours with columns={{'your_name': 'prompt', ...}}."
        )
    if len(ds) == 0:
        raise DataError(f"Data source {source!r} (split {split!r}) has no rows.")
    return ds


# ---------------------------------------------------------------------------------------------------------------
# Chat format, loss mask, packing (notebook 05)

import bisect  # noqa: E402
import dataclasses  # noqa: E402
import re  # noqa: E402

import numpy as np  # noqa: E402

THINK_RE = re.compile(r"<think>.*?</think>\s*", re.S)
END_OF_TURN = "<end_of_turn>"


def to_messages(row: dict, strip_think: bool = True, system_prompt: str | None = None) -> list[dict]:
    """A row as chat messages. A ``system`` field (or ``system_prompt``) becomes a system message, which Gemma's
    chat template folds into the user turn (Gemma has no system role). ``strip_think`` drops ``<think>`` reasoning."""
    response = THINK_RE.sub("", row["response"]) if strip_think else row["response"]
    system = row.get("system") or system_prompt
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": response}]


def _chat_ids(tokenizer, messages, **kw) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def end_of_turn_id(tokenizer) -> int:
    tid = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    return tid if tid is not None and tid != tokenizer.unk_token_id else tokenizer.eos_token_id


def tokenize_example(tokenizer, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and an assistant-only loss mask (1 on the assistant's tokens and its ``<end_of_turn>``).

    The mask is found from the chat template itself: the prompt rendered with ``add_generation_prompt=True`` is a
    prefix of the whole conversation, and the answer runs from there to the first end-of-turn token.
    """
    prompt = _chat_ids(tokenizer, messages[:-1], add_generation_prompt=True)
    full = _chat_ids(tokenizer, messages)
    if full[: len(prompt)] != prompt:
        raise DataError("The chat template does not render the prompt as a prefix of the conversation; "
                        "cannot locate the assistant's tokens for the loss mask.")
    eot = end_of_turn_id(tokenizer)
    try:
        end = full.index(eot, len(prompt)) + 1
    except ValueError:
        raise DataError(f"No end-of-turn token ({END_OF_TURN}) after the assistant's answer.") from None
    mask = np.zeros(len(full), np.int8)
    mask[len(prompt):end] = 1
    return np.asarray(full, np.int32), mask


def tokenize_rows(rows, tokenizer, strip_think: bool = True, progress: bool = True,
                  system_prompt: str | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    from tqdm.auto import tqdm

    return [tokenize_example(tokenizer, to_messages(r, strip_think, system_prompt))
            for r in tqdm(rows, desc="tokenizing", disable=not progress)]


@dataclasses.dataclass
class Packed:
    """Fixed-length rows holding one or more examples each.

    ``segment_ids`` numbers the examples in a row from 1 (0 is padding); ``positions`` restart at 0 for each
    example. Together they give each example its own positions and a block-diagonal causal mask.
    """

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
    tokens = np.full(shape, pad_id, np.int32)
    loss_mask = np.zeros(shape, np.int8)
    segment_ids = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
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


def attention_mask_from_segments(segment_ids):
    """Block-diagonal causal mask [B, T, T]: a token sees earlier tokens of its own example only.

    A numpy input gives a numpy mask (no JAX op: what the multi-process input path needs); anything else, a jax array.
    """
    if isinstance(segment_ids, np.ndarray):
        xp, seg = np, segment_ids
    else:
        import jax.numpy as xp

        seg = xp.asarray(segment_ids)
    t = seg.shape[-1]
    causal = xp.tril(xp.ones((t, t), bool))
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    return same & causal[None]


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


def prepare(profile, tokenizer, source: str | None = None, progress: bool = True) -> Prepared:
    """Load, split, normalise, tokenise and pack the profile's data (the whole notebook-05 pipeline)."""
    spec, train_spec = profile.data, profile.train
    rows = load_rows(source or spec.source, split=spec.split, columns=dict(spec.columns) or None)
    train_rows, eval_rows = split_rows(rows, spec.eval_fraction, train_spec.seed)
    layout = pack if spec.pack else pad_to_max
    train_ex = tokenize_rows(train_rows, tokenizer, spec.strip_think, progress, spec.system_prompt)
    eval_ex = tokenize_rows(eval_rows, tokenizer, spec.strip_think, progress, spec.system_prompt)
    pad = tokenizer.pad_token_id or 0
    return Prepared(layout(train_ex, train_spec.max_seq_len, spec.overlong, pad),
                    layout(eval_ex, train_spec.max_seq_len, spec.overlong, pad) if eval_ex else None,
                    np.array([len(ids) for ids, _ in train_ex]))


def batches(packed: Packed, global_batch: int, seed: int, epochs: int = 1, shuffle: bool = True,
            rows: slice | None = None):
    """A grain ``MapDataset`` of this process's share of each global batch (deterministic for a seed).

    Every process shuffles and batches the same way, then keeps ``rows`` of each global batch: the rows its own
    devices hold (``multihost.process_rows(mesh, global_batch)``; ``slice(None)`` for the whole batch). By default
    process ``i`` of ``n`` keeps the ``i``-th of ``n`` contiguous blocks, which is what a mesh with the batch axis
    across the processes holds. ``train`` assembles the global arrays from the pieces. Re-iterable, so it also
    serves as an eval set.
    """
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


def length_histogram(lengths, max_seq_len: int):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.hist(lengths, bins=40, color="tab:blue")
    ax.axvline(max_seq_len, color="tab:red", linestyle="--", label=f"max_seq_len = {max_seq_len}")
    ax.set_xlabel("tokens per example")
    ax.set_ylabel("examples")
    ax.set_title(f"example lengths (mean {np.mean(lengths):.0f}, max {np.max(lengths)})")
    ax.legend()
    fig.tight_layout()
    return fig


def token_use_table(prepared: Prepared, max_seq_len: int, codev_max_seq_len: int = 3072):
    """Packed vs pad-to-max token use: on this profile's data, and on a CodeV-R1-like length distribution."""
    import pandas as pd

    ours = token_use_for_lengths(prepared.lengths, max_seq_len)
    codev = token_use_for_lengths(codev_like_lengths(), codev_max_seq_len)
    return pd.DataFrame([
        {"data": "this profile's data", "max_seq_len": max_seq_len, "packed token use": ours["packed"],
         "pad-to-max token use": ours["pad_to_max"], "rows packed": ours["packed_rows"],
         "rows padded": ours["padded_rows"]},
        {"data": "CodeV-R1-like (mean 922, p99 2553)", "max_seq_len": codev_max_seq_len,
         "packed token use": codev["packed"], "pad-to-max token use": codev["pad_to_max"],
         "rows packed": codev["packed_rows"], "rows padded": codev["padded_rows"]},
    ])
