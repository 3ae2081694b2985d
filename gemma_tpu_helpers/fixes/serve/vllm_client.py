"""A client for a running vLLM server's OpenAI-compatible API: chat, streamed chat, completions from token ids,
and the prompt text and ids the chat template gives."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

from ..core import http_client
from .vllm_command import DEFAULT_PORT, HOST, SERVED_NAME, ServeError

REQUEST_TIMEOUT_S = http_client.REQUEST_TIMEOUT_S


class Client:
    """The client side of a server: :func:`connect` to one already running (e.g. the TPU docker), or :func:`start`."""

    def __init__(self, base_url: str, served_name: str = SERVED_NAME, api_key: str | None = None):
        self.base_url, self.served_name, self.api_key = http_client.api_root(base_url), served_name, api_key

    def healthy(self, timeout: float = 5.0) -> bool:
        return http_client.health_ok(self.base_url, timeout)

    def chat(self, messages, **kw) -> dict:
        return chat(self.base_url, messages, model=kw.pop("model", self.served_name), api_key=self.api_key, **kw)

    def stream_chat(self, messages, **kw) -> Iterator[str]:
        return stream_chat(self.base_url, messages, model=kw.pop("model", self.served_name), api_key=self.api_key,
                           **kw)

    def complete_ids(self, token_ids, n: int, **kw) -> dict:
        return complete_ids(self.base_url, token_ids, n, model=kw.pop("model", self.served_name),
                            api_key=self.api_key, **kw)

    def models(self) -> list[str]:
        return [m["id"] for m in http_client.get_json(http_client.api_url(self.base_url, "models"), self.api_key,
                                                 error=ServeError)["data"]]


def connect(base_url: str = f"http://{HOST}:{DEFAULT_PORT}", served_name: str = SERVED_NAME,
            api_key: str | None = None) -> Client:
    """A client for a server started elsewhere (the docker line on a TPU VM); checks ``/health`` first."""
    client = Client(base_url, served_name, api_key)
    if not client.healthy():
        raise ServeError(f"No healthy vLLM server at {http_client.health_url(base_url)}. Start it first "
                         f"(the command from vllm_command.serve_command(target, model_dir)); on TPU the first start "
                         f"compiles for minutes.")
    return client


def chat(base_url: str, messages, model: str = SERVED_NAME, api_key: str | None = None, max_tokens: int = 64,
         temperature: float = 0.0, timeout: float = REQUEST_TIMEOUT_S, **extra) -> dict:
    """One OpenAI-style chat completion; the server applies the checkpoint's chat template.

    ``messages`` is a list of ``{"role", "content"}`` dicts or a string (one user turn). Returns
    ``{"text", "finish_reason", "usage", "latency_s"}``.
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    payload = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature, **extra}
    t0 = time.perf_counter()
    out = http_client.post_json(http_client.api_url(base_url, "chat/completions"), payload, api_key, timeout,
                                error=ServeError)
    latency = time.perf_counter() - t0
    choice = out["choices"][0]
    return {"text": choice["message"]["content"], "finish_reason": choice["finish_reason"],
            "usage": out.get("usage"), "latency_s": latency}


def stream_chat(base_url: str, messages, model: str = SERVED_NAME, api_key: str | None = None, max_tokens: int = 64,
                temperature: float = 0.0, timeout: float = REQUEST_TIMEOUT_S, **extra) -> Iterator[str]:
    """The same request with ``"stream": true``: yields the text deltas as the server-sent events arrive."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    payload = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
               "stream": True, **extra}
    url = http_client.api_url(base_url, "chat/completions")
    resp = http_client.open_request("POST", url, payload, api_key, timeout, error=ServeError)
    try:
        for raw in resp:  # server-sent events: "data: {json}" lines, blank lines between, "data: [DONE]" at the end
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise ServeError(f"stream error: {event['error']}")
            for choice in event.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    yield delta
    except OSError as e:
        if http_client.is_timeout(e):
            raise ServeError(f"the stream from {url} stalled for more than {timeout} s") from None
        raise
    finally:
        resp.close()


def complete_ids(base_url: str, token_ids: list[int], n: int, model: str = SERVED_NAME, api_key: str | None = None,
                 top: int = 2, timeout: float = REQUEST_TIMEOUT_S) -> dict:
    """Greedy continuation of a token-id prompt via ``/v1/completions``, with the exact ids back:
    ``{"token_ids", "top" (per position: [(id, logprob), ...] best first), "latency_s"}``.

    The ids go as the prompt (no tokenizer round trip), with ``ignore_eos`` (no end token cuts it short) and the
    ``top`` logprobs keyed by token id (two tokens that decode to the same text stay apart; vLLM >= 0.11).
    """
    payload = {"model": model, "prompt": [int(t) for t in token_ids], "max_tokens": n, "temperature": 0.0,
               "ignore_eos": True, "return_token_ids": True, "logprobs": top, "return_tokens_as_token_ids": True}
    t0 = time.perf_counter()
    out = http_client.post_json(http_client.api_url(base_url, "completions"), payload, api_key, timeout,
                                error=ServeError)
    latency = time.perf_counter() - t0
    choice = out["choices"][0]
    top_lp = [sorted(((int(k.split(":", 1)[1]), v) for k, v in d.items()), key=lambda kv: -kv[1])
              for d in choice["logprobs"]["top_logprobs"]]
    return {"token_ids": list(choice["token_ids"]), "top": top_lp, "latency_s": latency}


def prompt_ids(model_dir, text: str, chat_template: bool = True) -> list[int]:
    """The checkpoint tokenizer's ids for ``text``: one chat turn ready for the model's answer (the generation prompt
    as the server renders it), or with ``chat_template=False`` the raw text after one ``<bos>`` (Gemma 4's tokenizer
    adds none itself: its template writes it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if chat_template:
        return tok(rendered_prompt(model_dir, text, tokenizer=tok), add_special_tokens=False)["input_ids"]
    return [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]


def rendered_prompt(model_dir, messages, tokenizer=None, enable_thinking: bool = False) -> str:
    """The text the server feeds the model for ``messages`` (a string: one user turn): the checkpoint's own chat
    template with the generation prompt, thinking off as in every request sent here. On Gemma 4 31B it
    ends in ``<|turn>model\n<|channel>thought\n<channel|>``."""
    from transformers import AutoTokenizer

    tok = tokenizer or AutoTokenizer.from_pretrained(str(model_dir))
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=enable_thinking)

