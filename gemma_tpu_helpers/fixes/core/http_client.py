"""One HTTP client for OpenAI-compatible servers (vLLM): one URL rule, one proxy rule, one API key variable, errors
that say what to do. Standard library only."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request

from .errors import GemmaTpuError

API_KEY_ENV = "VLLM_API_KEY"


REQUEST_TIMEOUT_S = 120.0


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


_ENDPOINT_SUFFIXES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1", "/health")


class RequestError(GemmaTpuError, RuntimeError):
    """An HTTP request failed; ``status`` is the HTTP code, or None when no answer came (refused, timed out)."""

    status: int | None = None


def api_root(url: str) -> str:
    """The server's root URL: ``http://h:1``, ``http://h:1/``, ``http://h:1/v1``, ``http://h:1/v1/`` (and a full
    endpoint URL such as ``.../v1/models``) all give ``http://h:1``."""
    url = url.strip().rstrip("/")
    for suffix in _ENDPOINT_SUFFIXES:
        if url.endswith(suffix):
            return url[: -len(suffix)].rstrip("/")
    return url


def api_url(url: str, endpoint: str) -> str:
    """The OpenAI endpoint ``endpoint`` (``"models"``, ``"chat/completions"``, ...) of the server at ``url``."""
    return f"{api_root(url)}/v1/{endpoint.lstrip('/')}"


def health_url(url: str) -> str:
    """vLLM's health check of the server at ``url`` (200 once it serves)."""
    return api_root(url) + "/health"


def resolve_api_key(api_key: str | None = None) -> str | None:
    """The key rule: ``api_key`` if given (``""``: none), else $VLLM_API_KEY, else None."""
    key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
    return key or None


def is_local(url: str) -> bool:
    return urllib.parse.urlsplit(url).hostname in LOCAL_HOSTS


def _opener(url: str) -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(*([urllib.request.ProxyHandler({})] if is_local(url) else []))


def is_timeout(e: BaseException) -> bool:
    """A socket timeout, bare or wrapped in urllib's URLError."""
    return isinstance(e, TimeoutError) or (isinstance(e, urllib.error.URLError) and isinstance(e.reason, TimeoutError))


def _fail(error: type[Exception], message: str, status: int | None = None, params: tuple[str, ...] = ()) -> Exception:
    exc = error(message)
    exc.status = status
    if params:  # the names the message tells the caller to pass (GemmaTpuError.params)
        exc.params = params
    return exc


def timeout_message(method: str, url: str, timeout: float) -> str:
    return (f"{method} {url} timed out after {timeout:g} s: the server is busy or stuck (a CPU server handles a few "
            f"requests at a time; check its log), or raise timeout=.")


def open_request(method: str, url: str, payload: dict | None = None, api_key: str | None = None,
                 timeout: float = REQUEST_TIMEOUT_S, error: type[Exception] = RequestError,
                 headers: dict | None = None):
    """The open response of a JSON request (read it, or iterate it for a stream; close it). Failures raise
    ``error`` (default :class:`RequestError`, with ``.status``) saying what was wrong and how to fix it.
    ``headers`` are added to the request's."""
    key = resolve_api_key(api_key)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
               **(headers or {})}
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    root = api_root(url)
    try:
        return _opener(url).open(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")[:500]
        if e.code == 401:
            why = (f"the key {'was refused' if key else 'is missing'}: the server was started with an API key; pass "
                   f"the same api_key= or set ${API_KEY_ENV}")
        elif e.code == 404:
            why = (f"{url} does not exist on this server; is {root} the server's base URL (such as "
                   f"http://127.0.0.1:8000, with or without /v1)? {body}")
        else:
            why = body
        raise _fail(error, f"{method} {url} failed with HTTP {e.code} {e.reason}: {why}", e.code,
                    ("api_key",) if e.code == 401 else ()) from None
    except OSError as e:  # URLError, refused connections and timeouts are all OSErrors
        if is_timeout(e):
            raise _fail(error, timeout_message(method, url, timeout)) from None
        reason = getattr(e, "reason", e)
        if isinstance(reason, ConnectionRefusedError):
            hint = (f"connection refused: is the server running, and is {root} its URL? (start it with "
                    f"vllm_server.start; `curl {root}/health` checks it)")
        else:
            hint = f"{reason}: check the host and port in {root}, and that the server is running"
        raise _fail(error, f"Cannot reach {url}: {hint}") from None


def request_json(method: str, url: str, payload: dict | None = None, api_key: str | None = None,
                 timeout: float = REQUEST_TIMEOUT_S, error: type[Exception] = RequestError) -> dict:
    """One JSON request (``GET`` with no payload, ``POST`` with one) and its decoded JSON answer."""
    resp = open_request(method, url, payload, api_key, timeout, error)
    try:
        with resp:
            body = resp.read()
    except OSError as e:
        if is_timeout(e):
            raise _fail(error, timeout_message(method, url, timeout)) from None
        raise _fail(error, f"{method} {url}: the connection broke while reading the answer ({e})") from None
    try:
        return json.loads(body)
    except ValueError:
        raise _fail(error, f"{method} {url} answered with something that is not JSON ({body[:200]!r}): is "
                           f"{api_root(url)} an OpenAI-compatible server?", resp.status) from None


def get_json(url: str, api_key: str | None = None, timeout: float = REQUEST_TIMEOUT_S,
             error: type[Exception] = RequestError) -> dict:
    return request_json("GET", url, None, api_key, timeout, error)


def served_models(url: str, model: str | None = None, api_key: str | None = None, timeout: float = 10.0,
                  error: type[Exception] = RequestError) -> list[dict]:
    """``GET /v1/models``: the entries the server lists, raising ``error`` (one line) within ``timeout`` s when
    nothing answers, the server refuses (a wrong key), it lists no model, or ``model`` is not among them."""
    base = api_root(url)
    try:
        listing = get_json(api_url(base, "models"), api_key, timeout)
    except RequestError as e:
        if e.status is not None:
            raise _fail(error, f"The server at {base} answered /v1/models: {e}", e.status) from None
        raise _fail(error, f"No OpenAI-compatible server answered at {base} within {timeout:g} s ({e}): start it "
                           f"(vllm_server.start), or check the URL with `curl {base}/v1/models`.") from None
    entries = listing.get("data") or []
    if not entries:
        raise _fail(error, f"The server at {base} lists no models at /v1/models.")
    if model is not None and model not in [e.get("id") for e in entries]:
        raise _fail(error, f"The server at {base} does not serve model {model!r}; it serves "
                           f"{[e.get('id') for e in entries]}.")
    return entries


def post_json(url: str, payload: dict, api_key: str | None = None, timeout: float = REQUEST_TIMEOUT_S,
              error: type[Exception] = RequestError) -> dict:
    return request_json("POST", url, payload, api_key, timeout, error)


def get_text(url: str, headers: dict | None = None, timeout: float = REQUEST_TIMEOUT_S,
             error: type[Exception] = RequestError) -> str:
    """A plain-text ``GET`` (e.g. a cloud metadata server) with the same proxy rule; never sends an API key."""
    resp = open_request("GET", url, None, "", timeout, error, headers)
    try:
        with resp:
            return resp.read().decode(errors="replace")
    except OSError as e:
        raise _fail(error, f"GET {url}: the connection broke while reading the answer ({e})") from None


def health_ok(url: str, timeout: float = 5.0) -> bool:
    """True when ``GET ROOT/health`` answers 200 (no key needed; never raises)."""
    try:
        with _opener(url).open(health_url(url), timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False

