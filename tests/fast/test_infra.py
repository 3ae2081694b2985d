"""infra: atomic writes, the HTTP client's URL / proxy / key rules, process-group supervision and the Makefile's JAX
cache setting, each against the real thing (files on disk, a local http.server, real processes, JAX's own cache)."""

import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from gemma_tpu_helpers.fixes.core import errors, file_io, http_client, process_groups
from support import REPO

# ------------------------------------------------------------------------------------------------ atomic writes


def test_atomic_write_keeps_the_old_file_when_the_writer_fails_midway(tmp_path):
    path = tmp_path / "results.jsonl"
    file_io.write_atomic(path, "old\n")

    def chunks():
        yield "new line 1\n"
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError, match="writer died"):
        file_io.write_lines_atomic(path, chunks())
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl"], "no temp file may stay behind"


_HOLD = """
import sys, time

from gemma_tpu_helpers.fixes.core import file_io

with file_io.locked(sys.argv[1]):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    open(sys.argv[1], "w").write("first")
"""


def test_locked_makes_a_second_process_wait_for_the_first(tmp_path, capsys):
    path = tmp_path / "artifact"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(path), "1.5"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with file_io.locked(path, "the artifact"):
            waited = time.monotonic() - t0
            assert path.read_text() == "first", "the lock was granted while the other process still held it"
    finally:
        holder.kill()
        holder.wait()
    assert waited > 0.5
    assert f"waiting for another process that is writing {path} (the artifact)" in capsys.readouterr().out
    with file_io.locked(path):  # free again once released, and the lock file stays beside the artifact, hidden
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == [".artifact.lock", "artifact"]


def test_locked_is_freed_when_its_holder_is_killed(tmp_path):
    path = tmp_path / "artifact"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(path), "60"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    t0 = time.monotonic()
    with file_io.locked(path):
        assert time.monotonic() - t0 < 5
    assert not path.exists(), "the killed holder never wrote"


def test_atomic_write_refuses_to_clobber_without_overwrite(tmp_path):
    path = tmp_path / "a.txt"
    file_io.write_lines_atomic(path, ["1"], overwrite=False)
    with pytest.raises(FileExistsError, match="overwrite"):
        file_io.write_lines_atomic(path, ["2"], overwrite=False)
    assert path.read_text() == "1"
    file_io.write_lines_atomic(path, ["2"])
    assert path.read_text() == "2"


def test_install_dir_replaces_the_old_directory_by_renames(tmp_path):
    out = tmp_path / "site"
    out.mkdir()
    (out / "old.html").write_text("old")
    tmp = file_io.temp_dir_beside(out)
    (tmp / "new.html").write_text("new")
    file_io.install_dir(tmp, out)
    assert [p.name for p in out.iterdir()] == ["new.html"]
    assert [p.name for p in tmp_path.iterdir()] == ["site"], "the temp and the old directory are gone"


def test_log_tail(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert file_io.log_tail(log, 3) == "line 97\nline 98\nline 99"
    assert "no log at" in file_io.log_tail(tmp_path / "missing.log")


# ------------------------------------------------------------------------------------------------ the HTTP client


@pytest.mark.parametrize("given", ["http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/",
                                   "http://h:1/v1/models", " http://h:1/v1/chat/completions "])
def test_url_rule_gives_one_root_and_the_same_endpoints(given):
    assert http_client.api_root(given) == "http://h:1"
    assert http_client.api_url(given, "models") == "http://h:1/v1/models"
    assert http_client.api_url(given, "/chat/completions") == "http://h:1/v1/chat/completions"
    assert http_client.health_url(given) == "http://h:1/health"


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list = []

    def _answer(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append({"path": self.path, "method": self.command, "auth": self.headers.get("Authorization"),
                          "flavor": self.headers.get("Metadata-Flavor"),
                          "body": json.loads(body) if body else None})
        if self.path == "/v1/secret" and self.headers.get("Authorization") != "Bearer right":
            self.send_response(401)
            self.end_headers()
            return
        if self.path == "/health":
            self.send_response(200)
            self.end_headers()
            return
        out = json.dumps({"data": [{"id": "gemma"}], "path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def local_server():
    _Recorder.seen = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", _Recorder.seen
    srv.shutdown()
    srv.server_close()


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_client_bypasses_a_proxy_for_127_0_0_1(local_server, monkeypatch):
    url, seen = local_server
    dead = f"http://127.0.0.1:{_dead_port()}"
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(var, dead)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv(http_client.API_KEY_ENV, raising=False)
    # the environment really sends other requests to the dead proxy: plain urllib fails
    import urllib.request

    with pytest.raises(OSError):
        urllib.request.urlopen(http_client.api_url(url, "models"), timeout=5)
    assert seen == []
    # the client goes straight to the server
    assert http_client.get_json(http_client.api_url(url + "/v1/", "models"), timeout=5)["data"][0]["id"] == "gemma"
    assert http_client.health_ok(url, timeout=5)
    assert [s["path"] for s in seen] == ["/v1/models", "/health"]


def test_client_sends_the_key_from_the_argument_and_from_vllm_api_key(local_server, monkeypatch):
    url, seen = local_server
    monkeypatch.delenv(http_client.API_KEY_ENV, raising=False)
    http_client.post_json(http_client.api_url(url, "completions"), {"prompt": "x"}, api_key="from-arg", timeout=5)
    monkeypatch.setenv(http_client.API_KEY_ENV, "from-env")
    http_client.get_json(http_client.api_url(url, "models"), timeout=5)
    http_client.get_json(http_client.api_url(url, "models"), api_key="arg-wins", timeout=5)
    http_client.get_json(http_client.api_url(url, "models"), api_key="", timeout=5)  # "" sends none
    assert [s["auth"] for s in seen] == ["Bearer from-arg", "Bearer from-env", "Bearer arg-wins", None]
    assert seen[0]["method"] == "POST" and seen[0]["body"] == {"prompt": "x"} and seen[1]["method"] == "GET"


def test_get_text_sends_its_headers_and_never_the_api_key(local_server, monkeypatch):
    url, seen = local_server
    monkeypatch.setenv(http_client.API_KEY_ENV, "not-for-a-metadata-server")
    assert json.loads(http_client.get_text(url + "/computeMetadata", {"Metadata-Flavor": "Google"},
                                           timeout=5))["path"] == "/computeMetadata"
    assert seen[0]["auth"] is None and seen[0]["flavor"] == "Google"


def test_client_errors_say_what_is_wrong_and_how_to_fix_it(local_server, monkeypatch):
    url, _ = local_server
    monkeypatch.delenv(http_client.API_KEY_ENV, raising=False)
    with pytest.raises(http_client.RequestError, match="401.*key is missing.*VLLM_API_KEY") as e:
        http_client.get_json(url + "/v1/secret", timeout=5)
    assert e.value.status == 401 and isinstance(e.value, errors.GemmaTpuError)
    with pytest.raises(http_client.RequestError, match="key was refused"):
        http_client.get_json(url + "/v1/secret", api_key="wrong", timeout=5)
    assert http_client.get_json(url + "/v1/secret", api_key="right", timeout=5)["path"] == "/v1/secret"

    nothing = f"http://127.0.0.1:{_dead_port()}"
    with pytest.raises(http_client.RequestError, match="connection refused: is the server running") as e:
        http_client.get_json(http_client.api_url(nothing, "models"), timeout=5)
    assert e.value.status is None and nothing in str(e.value)
    assert not http_client.health_ok(nothing, timeout=2)

    class Custom(RuntimeError):
        pass

    with pytest.raises(Custom, match="connection refused"):
        http_client.get_json(http_client.api_url(nothing, "models"), timeout=5, error=Custom)


def test_client_timeout_is_a_clear_error():
    with socket.socket() as s:  # accepts the connection, never answers
        s.bind(("127.0.0.1", 0))
        s.listen()
        t0 = time.perf_counter()
        with pytest.raises(http_client.RequestError, match="timed out after 1.5 s"):
            http_client.post_json(f"http://127.0.0.1:{s.getsockname()[1]}/v1/completions", {}, timeout=1.5)
        assert time.perf_counter() - t0 < 10


# ------------------------------------------------------------------------------------------------ process groups


def test_stop_group_kills_the_whole_group_including_a_grandchild(tmp_path):
    log = tmp_path / "sh.log"
    proc = process_groups.start_group(["sh", "-c", "echo started; sleep 600 & sleep 600"], log, header="# sh\n")
    deadline = time.monotonic() + 10
    while len(process_groups.group_members(proc.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    members = process_groups.group_members(proc.pid)
    assert len(members) == 3, members  # sh, its background sleep (a grandchild of ours) and the foreground sleep
    assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0), "the child leads its own group"
    t0 = time.monotonic()
    process_groups.stop_group(proc, grace=5)
    assert time.monotonic() - t0 < 5, "sh and sleep die on SIGTERM: no need to wait for SIGKILL"
    assert proc.returncode is not None
    assert not process_groups.group_exists(proc.pid)
    assert not any(process_groups.pid_running(p) for p in members)
    assert file_io.log_tail(log) == "# sh\nstarted"
    process_groups.stop_group(proc, grace=1)  # idempotent


def test_stop_group_sigkills_what_ignores_sigterm(tmp_path):
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(600)")
    proc = process_groups.start_group([sys.executable, "-c", code], tmp_path / "py.log")
    deadline = time.monotonic() + 20
    while "ready" not in file_io.log_tail(tmp_path / "py.log") and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    process_groups.stop_group(proc, grace=1.0)
    assert 0.9 < time.monotonic() - t0 < 10
    assert proc.returncode == -9 and not process_groups.group_exists(proc.pid)


def test_start_group_passes_env_and_cwd(tmp_path):
    proc = process_groups.start_group(["sh", "-c", "echo $FOO; pwd"], tmp_path / "l.log",
                             env={**os.environ, "FOO": "bar"}, cwd=tmp_path)
    assert proc.wait(timeout=10) == 0
    assert file_io.log_tail(tmp_path / "l.log").splitlines() == ["bar", str(tmp_path)]


# ------------------------------------------------------------------------------------------------ the JAX cache

def test_the_makefiles_cache_setting_keeps_a_program_that_compiles_in_milliseconds(tmp_path):
    """make check and make test set JAX_CACHE_ALL: without it JAX keeps only programs that took a second or more to
    compile, and every process compiles the small ones again (a renamed variable would go unnoticed but for this)."""
    name, value = re.search(r"^JAX_CACHE_ALL := (\w+)=(\S+)$", (REPO / "Makefile").read_text(), re.M).groups()
    code = "import jax, jax.numpy as jnp; jax.jit(lambda x: x * 2 + 1)(jnp.arange(3.0)).block_until_ready()"

    def entries(setting: dict) -> int:
        """How many programs JAX wrote to an empty cache, with ``setting`` as the only cache variable besides it."""
        cache = tmp_path / f"cache{len(setting)}"
        env = {k: v for k, v in os.environ.items() if k != name}
        env.update(setting, JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PLATFORMS="cpu")
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
        return len(list(cache.iterdir())) if cache.is_dir() else 0

    with_it, without = entries({name: value}), entries({})
    assert with_it >= 1 and without == 0, (with_it, without)
