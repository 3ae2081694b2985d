"""Examples packed into fixed-length rows (:func:`pack`, best-fit decreasing) or one a row (:func:`pad_to_max`), with
the segment ids and positions the block-diagonal mask needs, and their batches for training (:func:`batches`).
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from ..core.errors import DataError
from ..model.forward_inputs import BATCH_DTYPES


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
