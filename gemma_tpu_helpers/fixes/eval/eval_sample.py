"""Ask an OpenAI-compatible server (vLLM) for answers to problems, and read or write them as JSON lines."""

from __future__ import annotations

import concurrent.futures
import json
import os
from pathlib import Path
from typing import Iterable, Sequence

from ..core import file_io, http_client
from ..core.errors import GemmaTpuError
from .eval_problems import SYSTEM_PROMPT, EvalError, Problem, prompt_messages


class ServerError(GemmaTpuError, RuntimeError):
    """The OpenAI-compatible server could not be reached or refused a request."""


# VerilogEval v2's protocol, with no top-k: top_k is sent, as vLLM's "no top-k" (0), because vLLM fills unset fields
# from the checkpoint's generation_config.json (Gemma 4: top_k 64).
NO_TOP_K = 0  # vLLM's "no top-k"
NO_TOP_P = 1.0  # vLLM's "no nucleus"


PRESETS = {
    "official-greedy": {"n": 1, "temperature": 0.0, "top_p": 0.01, "top_k": NO_TOP_K},
    "official-sampled": {"n": 20, "temperature": 0.85, "top_p": 0.95, "top_k": NO_TOP_K},
}


def check_server(url: str, model: str | None = None, api_key: str | None = None,
                 connect_timeout: float = 10.0) -> list[str]:
    """The model ids the server lists at ``/v1/models``; a clear :class:`ServerError` within ``connect_timeout``.
    ``url`` is the server's base URL, with or without ``/v1`` (``http_client.api_root``)."""
    return [e.get("id") for e in http_client.served_models(url, model, api_key, connect_timeout, ServerError)]


def sample_completions(url: str, model: str, problems: Sequence[Problem], n: int = 1, temperature: float = 0.0,
                       max_tokens: int = 2048, api_key: str | None = None, timeout: float = 600.0,
                       connect_timeout: float = 10.0, top_p: float | None = None, concurrency: int = 8,
                       system_prompt: str | None = SYSTEM_PROMPT, progress: bool = True,
                       stop_token_ids: Sequence[int] | None = None, top_k: int | None = None) -> list[dict]:
    """Ask ``/v1/chat/completions`` for ``n`` answers per problem; rows ``task_id, sample_index, completion,
    finish_reason`` ("length": cut off by ``max_tokens``) and the sampling settings sent.

    ``temperature``, ``top_p`` and ``top_k`` are always sent: an unset ``top_p``/``top_k`` means none (1.0 / 0),
    never the checkpoint's generation_config, which vLLM would apply otherwise (Gemma 4: top_p 0.95, top_k 64),
    and each row records the three values. An unreachable server
    fails within ``connect_timeout`` seconds; ``timeout`` bounds each request; ``api_key`` defaults to
    ``$VLLM_API_KEY``. Raises :class:`ServerError` or :class:`EvalError`.
    """
    from tqdm.auto import tqdm

    if n < 1 or max_tokens < 1:
        raise EvalError(f"need n >= 1 and max_tokens >= 1 (got n={n}, max_tokens={max_tokens})")
    if temperature < 0:
        raise EvalError(f"temperature must be >= 0 (got {temperature})")
    api_key = http_client.resolve_api_key(api_key)
    check_server(url, model, api_key, connect_timeout)
    endpoint = http_client.api_url(url, "chat/completions")
    sampling = {"temperature": temperature, "top_p": NO_TOP_P if top_p is None else top_p,
                "top_k": NO_TOP_K if top_k is None else top_k}

    def one(problem: Problem) -> list[dict]:
        # The server renders the messages with the model's own chat template, thinking off (Gemma 4's default), and
        # keeps special tokens in the answer so a thought channel, if the model opens one, stays recognisable.
        payload = {"model": model, "messages": prompt_messages(problem, system_prompt), "n": n, **sampling,
                   "max_tokens": max_tokens, "skip_special_tokens": False,
                   "chat_template_kwargs": {"enable_thinking": False}}
        if stop_token_ids:
            payload["stop_token_ids"] = [int(i) for i in stop_token_ids]
        try:
            resp = http_client.post_json(endpoint, payload, api_key, timeout)
        except http_client.RequestError as e:
            raise ServerError(f"{problem.task_id}: {e}") from None
        choices = sorted(resp.get("choices", []), key=lambda ch: ch.get("index", 0))
        if len(choices) != n:
            raise ServerError(f"{problem.task_id}: asked for n={n} choices, the server returned {len(choices)}")
        return [{"task_id": problem.task_id, "sample_index": i,
                 "completion": (ch.get("message") or {}).get("content") or "",
                 "finish_reason": ch.get("finish_reason"), **sampling} for i, ch in enumerate(choices)]

    rows: list[dict] = []
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, concurrency))
    try:
        futures = [pool.submit(one, p) for p in problems]
        for f in tqdm(concurrent.futures.as_completed(futures), total=len(futures), desc="sample",
                      disable=not progress):
            rows.extend(f.result())
    finally:  # on the first error, drop queued requests and do not wait for the ones in flight
        pool.shutdown(wait=False, cancel_futures=True)
    rows.sort(key=lambda r: (r["task_id"], r["sample_index"]))
    return rows


def read_completions(path: str | os.PathLike) -> list[dict]:
    """Rows from a JSONL file with ``task_id`` and ``completion`` per line (a results file works too)."""
    path = Path(path)
    if path.is_dir():
        raise EvalError(f"completions file {path} is a directory; read_completions takes a JSONL file (one "
                        f"{{\"task_id\", \"completion\"}} object per line)", params=("completions",), path=path)
    if not path.is_file():
        raise EvalError(f"completions file {path} does not exist")
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise EvalError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or "task_id" not in row or "completion" not in row:
            raise EvalError(f"{path}:{lineno}: each line needs 'task_id' and 'completion'")
        rows.append(row)
    if not rows:
        raise EvalError(f"{path} holds no completions")
    return rows


def write_jsonl_atomic(path: str | os.PathLike, rows: Iterable[dict], overwrite: bool = False) -> Path:
    """Rows as JSONL, written atomically (``file_io.write_lines_atomic``); refuses to replace a file unless asked."""
    return file_io.write_lines_atomic(
        path, (json.dumps(row, default=_json_default, allow_nan=False) + "\n" for row in rows), overwrite=overwrite)


def _json_default(o):
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")

