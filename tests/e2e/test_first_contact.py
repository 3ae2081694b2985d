"""First contact on a TPU VM: each environment failure is one line that says what to do, exit code 2, no traceback.

Offline, with what this machine really has: no network reaches the Hub, no token, a small tmpfs as the disk, no TPU.
Where a Hub answer is needed (gated repo, licence, wrong id, file sizes), a local HTTP server answers as the Hub
does (the status codes and X-Error-Code headers huggingface_hub parses), and huggingface_hub's real client talks to it
through HF_ENDPOINT.
"""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import support
from gemma_tpu_helpers.course.config import base_model
from gemma_tpu_helpers.fixes.core import process_groups
from gemma_tpu_helpers.fixes.serve import vllm_command, vllm_server
from support import run_cli

REAL = "google/gemma-4-31B-it"
SHA = "0123456789abcdef0123456789abcdef01234567"


# --- a local stand-in for the Hub's HTTP API ----------------------------------------------------------------------

class FakeHub:
    """Answers /api/models/<id>[/revision/<rev>], /auth-check, /tree/<sha> and /<id>/resolve/<sha>/<file>.

    ``repos``: id -> {"gated": False | "manual", "access": bool, "files": {name: bytes | int}} (an int is a size
    that is listed but never served). ``requests`` records every path asked for."""

    def __init__(self, repos):
        self.repos, self.requests = repos, []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_HEAD(self):
                hub.answer(self, head=True)

            def do_GET(self):
                hub.answer(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()

    @staticmethod
    def _size(v):
        return v if isinstance(v, int) else len(v)

    def answer(self, h, head):
        path = h.path.split("?")[0]
        self.requests.append(path)

        def send(status, body=b"", headers=()):
            h.send_response(status)
            for k, v in headers:
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            if not head:
                h.wfile.write(body)

        m = re.match(r"/api/models/([^/]+/[^/]+)(/.*)?$", path) or re.match(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)$", path)
        repo = self.repos.get(m[1]) if m else None
        if repo is None:
            return send(404, b'{"error":"Repository not found"}', [("X-Error-Code", "RepoNotFound")])
        denied = repo["gated"] and not repo["access"]
        gated = (403, b'{"error":"gated"}', [("X-Error-Code", "GatedRepo")])
        rest = m[2] or ""
        if path.startswith("/api/") and rest.startswith("/auth-check"):
            return send(*gated) if denied else send(200, b"{}")
        if path.startswith("/api/") and rest.startswith("/tree/"):
            items = [{"type": "file", "path": n, "size": self._size(v), "oid": f"{i:040x}"}
                     for i, (n, v) in enumerate(repo["files"].items())]
            return send(200, json.dumps(items).encode(), [("Content-Type", "application/json")])
        if path.startswith("/api/"):
            info = {"id": m[1], "sha": SHA, "gated": repo["gated"],
                    "siblings": [{"rfilename": n, "size": self._size(v)} for n, v in repo["files"].items()]}
            return send(200, json.dumps(info).encode(), [("Content-Type", "application/json")])
        if denied:
            return send(*gated)
        body = repo["files"][rest]
        send(200, body, [("X-Repo-Commit", SHA), ("ETag", f'"{hash(body) & 0xffffffff:08x}"')])


def tokenizer_files(tiny_dir):
    return {p.name: p.read_bytes() for p in Path(tiny_dir).iterdir()
            if p.is_file() and (p.name.startswith("tokenizer") or p.suffix == ".jinja" or p.name == "config.json")}


@pytest.fixture
def fake_hub(tiny_dir):
    """The real repo id, gated, as the Hub lists it: tokenizer files served, 2 x 31 GB of shards listed only."""
    files = {**tokenizer_files(tiny_dir), "model-00001-of-00002.safetensors": 31 * 10**9,
             "model-00002-of-00002.safetensors": 31 * 10**9, "model.safetensors.index.json": b"{}"}
    hub = FakeHub({REAL: {"gated": "manual", "access": True, "files": files}})
    yield hub
    hub.close()


def env_for(tmp_path, **extra):
    """A first-contact environment: no token, a fresh HF_HOME, runs under tmp_path."""
    env = {"HF_HOME": str(tmp_path / "hf_home"), "GEMMA_TPU_RUNS": str(tmp_path / "runs"), "HF_TOKEN": "",
           "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1", **extra}
    return env


def timed_cli(*args, env, budget_s):
    t = time.time()
    r = run_cli(*args, env=env, timeout=budget_s * 4)
    seconds = time.time() - t
    assert seconds < budget_s, f"{args} took {seconds:.1f} s"
    return r


# --- the Hub: mapping huggingface_hub's real exceptions -------------------------------------------------------------

def _response(status, url="https://huggingface.co/api/models/google/gemma-4-31B-it"):
    import httpx

    return httpx.Response(status, request=httpx.Request("GET", url))


def test_explain_maps_each_hub_exception(monkeypatch, tmp_path):
    import httpx
    from huggingface_hub import errors

    from gemma_tpu_helpers.course.config import hub

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(hub, "has_token", lambda: False)  # a token file under the real HF_HOME must not decide
    t = tmp_path / "base"

    def says(exc, *words):
        msg = hub.explain(exc, REAL, t)
        assert msg and "\n" not in msg, msg
        for w in words:
            assert w in msg, (w, msg)
        return msg

    gated = errors.GatedRepoError("403 Client Error", response=_response(403))
    says(gated, "gated and no Hugging Face token is set", "export HF_TOKEN=", "huggingface.co/google/gemma-4-31B-it")
    says(errors.RepositoryNotFoundError("404", response=_response(404)), "does not exist", "answers 404",
         "profiles.py", "If it is private, set HF_TOKEN")
    says(errors.HfHubHTTPError("401", response=_response(401)), "rejected your token (401)")
    says(errors.HfHubHTTPError("503", response=_response(503), server_message="maintenance"),
         "answered 503 for google/gemma-4-31B-it: maintenance", "retry later")
    says(errors.RevisionNotFoundError("404", response=_response(404)), "no such revision")
    says(httpx.ConnectError("[Errno -2] Name or service not known"), "cannot reach the Hugging Face Hub",
         "ConnectError", "HTTPS_PROXY", str(t))
    says(httpx.ReadTimeout("timed out"), "cannot reach the Hugging Face Hub", "ReadTimeout")
    try:  # what snapshot_download raises with no network and nothing cached: the cause is named
        try:
            raise httpx.ConnectError("[Errno 101] Network is unreachable")
        except httpx.ConnectError as e:
            raise errors.LocalEntryNotFoundError("An error happened while trying to locate the files") from e
    except errors.LocalEntryNotFoundError as e:
        says(e, "cannot reach", "Network is unreachable")
    says(errors.OfflineModeIsEnabled("offline"), "HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE")
    assert hub.explain(ValueError("not a hub error"), REAL, t) is None

    monkeypatch.setattr(hub, "has_token", lambda: True)  # with a token: the licence, and no "private" hint
    says(gated, "your Hugging Face token has no access", "accept its licence", "hf auth whoami")
    assert "private" not in says(errors.RepositoryNotFoundError("404", response=_response(404)), "does not exist")


# --- the Hub, end to end through the CLI --------------------------------------------------------------------------

def hub_resolves() -> bool:
    try:
        socket.getaddrinfo("huggingface.co", 443)
        return True
    except OSError:
        return False


def v5p8_base(tmp_path):
    """base_model.ensure_base on the v5p-8 profile: the one place the real checkpoint is downloaded."""
    from gemma_tpu_helpers.course.config import profiles

    return base_model.ensure_base(profiles.get_profile("v5p-8"), tmp_path / "runs" / "v5p-8")


@pytest.fixture
def first_contact(monkeypatch, tmp_path):
    """In this process: no token (env or file), the Hub's own default endpoint."""
    from gemma_tpu_helpers.course.config import hub

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(hub, "has_token", lambda: bool(os.environ.get("HF_TOKEN")))
    return monkeypatch


def use_endpoint(monkeypatch, url):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", url)


@pytest.mark.skipif(hub_resolves(), reason="this machine reaches the Hub; the refused-port test still runs")
def test_no_network_for_real(first_contact, tmp_path):
    """This machine: no DNS for huggingface.co. The checkpoint (ensure_base) and the tokenizer (data-stats, CLI) both
    stop in one line, fast."""
    from gemma_tpu_helpers.course.config import hub

    t = time.time()
    with pytest.raises(hub.HubError, match=f"^cannot reach the Hugging Face Hub to download {REAL} .*check the "
                                           f"network"):
        v5p8_base(tmp_path)
    assert time.time() - t < 30 and not (tmp_path / "runs" / "v5p-8" / "base").exists()
    r = timed_cli("data-stats", "--profile", "v5p-8", env=env_for(tmp_path), budget_s=60)
    support.one_line_error(r, f"cannot reach the Hugging Face Hub to download {REAL}")


def test_refused_connection_and_offline_mode(tmp_path):
    with socket.socket() as s:  # a port nobody listens on: connection refused, wherever the test runs
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = timed_cli("data-stats", "--profile", "v5p-8",
                  env=env_for(tmp_path, HF_ENDPOINT=f"http://127.0.0.1:{port}"), budget_s=60)
    support.one_line_error(r, "cannot reach the Hugging Face Hub")
    r = timed_cli("data-stats", "--profile", "v5p-8", env=env_for(tmp_path, HF_HUB_OFFLINE="1"), budget_s=60)
    support.one_line_error(r, "HF_HUB_OFFLINE is set and")


def test_silent_network_times_out(monkeypatch, tmp_path):
    """A network that swallows packets: huggingface_hub itself would wait forever; the metadata call has a limit."""
    from huggingface_hub import constants

    from gemma_tpu_helpers.course.config import hub, profiles

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections, never answers
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
    monkeypatch.setattr(profiles, "HUB_TIMEOUT_S", 1)
    t = time.time()
    with pytest.raises(hub.HubError, match="cannot reach the Hugging Face Hub .*Timeout"):
        hub.download(REAL, tmp_path / "base", hub.WEIGHT_PATTERNS)
    assert time.time() - t < 30
    silent.close()


def test_gated_repo_without_token_and_without_licence(fake_hub, first_contact, tmp_path):
    from gemma_tpu_helpers.course.config import hub

    use_endpoint(first_contact, fake_hub.url)
    with pytest.raises(hub.HubError, match=f"^{REAL} is gated and no Hugging Face token is set: accept its licence "
                                           f"at {fake_hub.url}/{REAL}"):
        v5p8_base(tmp_path)
    env = env_for(tmp_path, HF_ENDPOINT=fake_hub.url)
    r = timed_cli("data-stats", "--profile", "v5p-8", env=env, budget_s=60)
    support.one_line_error(r, f"{REAL} is gated and no Hugging Face token is set")
    fake_hub.repos[REAL]["access"] = False
    first_contact.setenv("HF_TOKEN", "hf_notaccepted")
    with pytest.raises(hub.HubError, match=f"^your Hugging Face token has no access to the gated {REAL}"):
        v5p8_base(tmp_path)
    r = timed_cli("data-stats", "--profile", "v5p-8", env={**env, "HF_TOKEN": "hf_notaccepted"}, budget_s=60)
    support.one_line_error(r, f"your Hugging Face token has no access to the gated {REAL}: accept its licence")
    assert not any("/resolve/" in p for p in fake_hub.requests), "nothing may be downloaded before the checks pass"


def test_wrong_repo_id(fake_hub, monkeypatch, tmp_path):
    from huggingface_hub import constants

    from gemma_tpu_helpers.course.config import hub

    monkeypatch.setattr(constants, "ENDPOINT", fake_hub.url)
    monkeypatch.setenv("HF_TOKEN", "hf_something")
    with pytest.raises(hub.HubError, match=r"google/gemma-4-31B-itt does not exist on the Hugging Face Hub .*answers "
                                           r"404\): check the id \(the profile's model.source"):
        hub.download("google/gemma-4-31B-itt", tmp_path / "base", hub.WEIGHT_PATTERNS)


@pytest.fixture
def small_disk(tmp_path):
    """A real 16 MB filesystem (tmpfs; needs root)."""
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield d
    subprocess.run(["umount", str(d)], check=True)


def test_disk_too_small_stops_before_downloading(fake_hub, small_disk, first_contact):
    """62 GB of shards (the Hub's sizes) against a 16 MB disk: one line, naming the ways out, nothing downloaded."""
    from gemma_tpu_helpers.course.config import hub, profiles

    use_endpoint(first_contact, fake_hub.url)
    first_contact.setenv("HF_TOKEN", "hf_accepted")
    with pytest.raises(hub.HubError) as e:
        base_model.ensure_base(profiles.get_profile("v5p-8"), small_disk / "v5p-8")
    line = str(e.value)
    assert line.startswith(f"the {REAL} checkpoint needs 62.0 GB in {small_disk}/v5p-8/base, but its filesystem "
                           f"({small_disk}) has 17 MB free"), line
    for way_out in ("--base DIR", "GEMMA_TPU_RUNS", "HF_HOME"):
        assert way_out in line and "\n" not in line
    assert not any("/resolve/" in p for p in fake_hub.requests)


def test_disk_check_counts_what_is_already_there(tmp_path):
    from gemma_tpu_helpers.course.config import hub

    (tmp_path / "a.safetensors").write_bytes(b"x" * 10)
    sizes = {"a.safetensors": 10, "b.safetensors": 5, "c.json": 3}
    assert hub.missing_bytes(sizes, tmp_path, REAL) == 8
    assert hub.missing_bytes({"a.safetensors": None}, tmp_path, REAL) == 63 * 10**9  # no sizes: the documented figure
    on, free = hub.free_bytes(tmp_path / "not" / "yet")
    assert os.path.ismount(on) and free > 0
    with pytest.raises(hub.HubError, match="needs 1000000.0 GB"):
        hub.check_disk("x", tmp_path, 10**15)


def test_disk_message_offers_dev_shm_when_it_fits(small_disk):
    """The paper's way out (RAM as disk) is named only when /dev/shm can hold the download."""
    import shutil

    from gemma_tpu_helpers.course.config import hub

    need = 20 * 10**6  # more than the 16 MB tmpfs holds
    if shutil.disk_usage("/dev/shm").free < need:
        pytest.skip("/dev/shm is too small here")
    with pytest.raises(hub.HubError, match=r"needs 20 MB in .* /dev/shm has .* free \(RAM: fast, lost at reboot; "
                                           r"the paper set TMPDIR=/dev/shm .*--base /dev/shm/base\.$"):
        hub.check_disk("the download", small_disk / "base", need)
    with pytest.raises(hub.HubError) as e:
        hub.check_disk("the download", small_disk / "base", shutil.disk_usage("/dev/shm").free + 10**9)
    assert "/dev/shm" not in str(e.value)


def test_tokenizer_only_fetch_downloads_no_weights(fake_hub, small_disk, tmp_path):
    """data-stats on the 31B profile: the tokenizer files alone come down (into a 16 MB disk), then it tokenizes."""
    env = env_for(tmp_path, HF_ENDPOINT=fake_hub.url, HF_TOKEN="hf_accepted", GEMMA_TPU_RUNS=str(small_disk))
    t = time.time()
    r = run_cli("data-stats", "--profile", "v5p-8", "--source", "shipped", env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "packed token use" in r.stdout, r.stdout
    got = sorted(p.name for p in (small_disk / "v5p-8" / "tokenizer").iterdir() if p.is_file())
    assert got == sorted(tokenizer_files_names(fake_hub)), got
    assert not any(".safetensors" in p for p in fake_hub.requests), fake_hub.requests
    assert not (small_disk / "v5p-8" / "base").exists()
    print(f"data-stats with a tokenizer-only fetch: {time.time() - t:.1f} s")


def tokenizer_files_names(hub):
    return [n for n in hub.repos[REAL]["files"] if not n.startswith("model")]


def test_base_dir_is_used_as_it_is_or_downloaded_into(tiny_dir, fake_hub, small_disk, first_contact, tmp_path):
    """--base DIR: a complete checkpoint there is used untouched, offline; an empty DIR is the download target."""
    from gemma_tpu_helpers.course.config import hub, profiles

    first_contact.setenv("HF_HUB_OFFLINE", "1")  # no Hub needed for a checkpoint that is already there
    first_contact.setattr(__import__("huggingface_hub").constants, "HF_HUB_OFFLINE", True)
    stamp = {p.name: p.stat().st_mtime_ns for p in Path(tiny_dir).iterdir()}
    for name in ("v5p-8", "smoke"):
        assert base_model.ensure_base(profiles.get_profile(name), tmp_path / "r", base=tiny_dir) == Path(tiny_dir)
    assert {p.name: p.stat().st_mtime_ns for p in Path(tiny_dir).iterdir()} == stamp
    assert not (tmp_path / "r").exists()
    with pytest.raises(hub.HubError, match=f"^HF_HUB_OFFLINE is set and {small_disk}/mine holds no downloaded"):
        base_model.ensure_base(profiles.get_profile("v5p-8"), tmp_path / "r", base=small_disk / "mine")
    first_contact.setattr(__import__("huggingface_hub").constants, "HF_HUB_OFFLINE", False)
    use_endpoint(first_contact, fake_hub.url)
    first_contact.setenv("HF_TOKEN", "hf_accepted")
    with pytest.raises(hub.HubError, match=f"needs 62.0 GB in {small_disk}/mine, but"):
        base_model.ensure_base(profiles.get_profile("v5p-8"), tmp_path / "r", base=small_disk / "mine")


def test_ensure_base_resumes_an_incomplete_checkpoint(tmp_path):
    from gemma_tpu_helpers.course.config import hub

    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "s1.safetensors",
                                                                                "b": "s2.safetensors"}}))
    (d / "s1.safetensors").write_bytes(b"")
    assert not hub.complete(d)  # an interrupted download: config.json alone no longer counts as done
    (d / "s2.safetensors").write_bytes(b"")
    assert hub.complete(d)


def test_a_file_as_out_and_a_truncated_shard_from_a_relative_path(tiny_dir, tmp_path):
    """Two of the relative-path report's cases, typed from a working directory (test_user_paths has the rest:
    train, resume, merge, verify and serve with relative paths, and the README's commands run literally)."""
    import shutil

    (tmp_path / "afile").write_text("keep me")
    r = run_cli("tiny-model", "afile", cwd=tmp_path, env=env_for(tmp_path))
    support.one_line_error(r, f"{tmp_path / 'afile'} is a file, not a directory")
    assert (tmp_path / "afile").read_text() == "keep me"  # nothing lost
    shutil.copytree(tiny_dir, tmp_path / "base")
    shard = sorted((tmp_path / "base").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])  # an interrupted copy
    r = run_cli("parity", "base", cwd=tmp_path, env=env_for(tmp_path))
    line = support.one_line_error(r, f"{shard} is truncated: 1,000 bytes")
    assert "tiny-model" in line and "--overwrite" in line, line  # how to get it back


# --- pre-flight for TPU profiles ------------------------------------------------------------------------------------

def test_tpu_profile_without_tpu_is_one_line_without_libtpu_noise(tmp_path):
    """This machine has libtpu (for AOT plans) and no TPU: `mesh --profile v5p-8` used to print libtpu's
    INVALID_ARGUMENT worker-hostname noise first."""
    env = env_for(tmp_path)
    for step in (["mesh"], ["lora"], ["train", "--run-dir", str(tmp_path / "x")]):
        r = timed_cli(*step, "--profile", "v5p-8", env={**env, "JAX_PLATFORMS": ""}, budget_s=30)
        line = support.one_line_error(r, "profile 'v5p-8' needs a TPU v5p host with 4 chips, but this machine has "
                                         "no TPU")
        assert "--profile smoke" in line and "plan --aot --profile v5p-8" in line
        assert r.stderr.strip() == line, r.stderr  # nothing else: no libtpu warnings
        assert "jax" not in r.stdout


def test_setup_reports_every_check_on_a_tpu_profile(tmp_path):
    r = timed_cli("setup", "--profile", "v5p-8", env=env_for(tmp_path), budget_s=30)
    out = r.stdout
    for name in ("versions", "tpu", "hbm", "disk", "ram"):
        assert re.search(rf"^  (OK|WARN|FAIL|SKIP)\s+{name}\s", out, re.M), out
    assert re.search(r"FAIL\s+tpu\s+profile 'v5p-8' needs a TPU", out)
    assert re.search(r"(OK|FAIL)\s+disk\s+.*126.0 GB", out), out  # the checkpoint and its merge, 63 GB each
    support.one_line_error(r, "pre-flight failed (tpu")
    assert "TPU_WORKER_HOSTNAMES" not in r.stderr and "INVALID_ARGUMENT" not in r.stderr


def test_setup_disk_check_on_a_small_disk(small_disk, tmp_path):
    from gemma_tpu_helpers.course.config import profiles
    from gemma_tpu_helpers.course.front import preflight

    c = preflight.check_disk(profiles.get_profile("v5p-8"), small_disk / "v5p-8")
    assert c.status == "fail" and "needs 126.0 GB in" in c.detail and "--base DIR" in c.detail, c.detail
    merged = small_disk / "v5p-8" / "base"  # a downloaded base (complete) leaves the merge alone to plan for
    merged.mkdir(parents=True)
    (merged / "config.json").write_text("{}")
    (merged / "model.safetensors").write_bytes(b"")
    c = preflight.check_disk(profiles.get_profile("v5p-8"), small_disk / "v5p-8")
    assert "needs 63.0 GB" in c.detail and "merged copy" in c.detail and "base checkpoint" not in c.detail, c.detail


def test_smoke_has_no_preflight():
    from gemma_tpu_helpers.course.config import profiles
    from gemma_tpu_helpers.course.front import preflight

    assert preflight.checks(profiles.get_profile("smoke")) == []
    preflight.require(profiles.get_profile("smoke"))  # no TPU needed, nothing raised


def test_tpu_pci_ids_match_jax():
    from jax._src import hardware_utils

    from gemma_tpu_helpers.course.front import preflight

    assert preflight.GOOGLE_PCI_VENDOR == hardware_utils._GOOGLE_PCI_VENDOR_ID
    assert preflight.TPU_PCI_IDS == {k: v.name for k, v in hardware_utils._TPU_PCI_DEVICE_IDS.items()}


def test_tpu_chips_reads_pci_ids(tmp_path):
    from gemma_tpu_helpers.course.front import preflight

    for i, (vendor, device) in enumerate([("0x1ae0", "0x0062")] * 4 + [("0x1ae0", "0x0001"), ("0x8086", "0x0062")]):
        d = tmp_path / f"0000:00:0{i}.0"
        d.mkdir()
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(device + "\n")
    assert preflight.tpu_chips(str(tmp_path)) == (4, "v5p")
    assert preflight.tpu_chips(str(tmp_path / "none")) == (0, None)


def fake_pci(root, chips, device_id):
    for i in range(chips):
        d = root / f"0000:00:{i:02d}.0"
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x1ae0\n")
        (d / "device").write_text(device_id + "\n")
    return str(root)


def test_tpu_type_and_chip_count_against_the_profile(monkeypatch, tmp_path):
    """The TPU's presence is the one thing faked (this machine has none); the PCI ids are files as sysfs has them."""
    from gemma_tpu_helpers.course.config import profiles
    from gemma_tpu_helpers.course.front import preflight

    monkeypatch.setattr(profiles, "tpu_visible", lambda: True)
    v5p8, v5p16 = profiles.get_profile("v5p-8"), profiles.get_profile("v5p-16")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-8")  # what the VM's metadata server would say
    c = preflight.check_tpu(v5p8, fake_pci(tmp_path / "a", 4, "0x0062"))
    assert c.status == "ok" and "4 TPU v5p chips (slice v5p-8)" in c.detail, c.detail
    c = preflight.check_tpu(v5p16, fake_pci(tmp_path / "a2", 4, "0x0062"))  # 4 per host on each of 2 hosts
    assert c.status == "warn" and "this slice is v5p-8, the profile is v5p-16" in c.detail, c.detail
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v6e-8")
    c = preflight.check_tpu(v5p8, fake_pci(tmp_path / "b", 8, "0x006f"))
    assert c.status == "fail" and "8 TPU v6e chips (slice v6e-8), but profile 'v5p-8' is for TPU v5p" in c.detail
    assert "GEMMA_TPU_PROFILE" in c.detail
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-16")
    c = preflight.check_tpu(v5p8, fake_pci(tmp_path / "c", 2, "0x0062"))
    assert c.status == "fail" and "needs 4 per host" in c.detail, c.detail


def test_lock_holder_is_found_by_pid(tmp_path):
    """libtpu holds a POSIX write lock on /tmp/libtpu_lockfile (seen in /proc/locks here); a child holding one on a
    file of ours is found by pid, with its command line, and so is a child holding a file open (the TPU devices)."""
    lock = tmp_path / "libtpu_lockfile"
    lock.write_text("")
    code = ("import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.lockf(f, fcntl.LOCK_EX); "
            "print('locked', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        held = process_groups.lock_holders(str(lock))
        assert list(held) == [child.pid] and "fcntl" in held[child.pid], held
        assert child.pid in process_groups.open_by([str(lock)])
        assert os.getpid() not in process_groups.open_by([str(lock)])
    finally:
        child.kill()
        child.wait()
    assert process_groups.lock_holders(str(lock)) == {}  # the file stays; the lock went with the process
    assert process_groups.lock_holders(str(tmp_path / "absent")) == {}


def test_hbm_check_names_the_process_holding_the_tpu(monkeypatch, tmp_path):
    """A leftover process with the TPU's device file open and libtpu's lock: the check fails naming its pid."""
    from gemma_tpu_helpers.course.config import profiles
    from gemma_tpu_helpers.course.front import preflight

    accel, lock = tmp_path / "accel0", tmp_path / "libtpu_lockfile"
    accel.write_text("")
    lock.write_text("")
    monkeypatch.setattr(profiles, "tpu_visible", lambda: True)
    monkeypatch.setattr(process_groups, "TPU_DEVICE_GLOBS", (str(tmp_path / "accel*"),))
    monkeypatch.setattr(process_groups, "LIBTPU_LOCKFILE", str(lock))
    monkeypatch.setattr(preflight.shutil, "which", lambda name: None)  # no tpu-info here
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-8")  # no metadata-server call
    assert preflight.check_hbm(profiles.get_profile("v5p-8")).status == "ok"
    code = ("import fcntl, sys, time; d = open(sys.argv[1]); f = open(sys.argv[2], 'a'); "
            "fcntl.lockf(f, fcntl.LOCK_EX); print('holding', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(accel), str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "holding"
        c = preflight.check_hbm(profiles.get_profile("v5p-8"))
        assert c.status == "fail" and f"the TPU is in use by pid {child.pid} (" in c.detail, c.detail
        assert f"kill {child.pid}" in c.detail and "does not free the HBM" in c.detail
        with pytest.raises(preflight.PreflightError, match=f"pid {child.pid}"):
            preflight.require(profiles.get_profile("v5p-8"))
    finally:
        child.kill()
        child.wait()


def test_serve_on_colab_names_the_other_process_that_holds_the_tpu(monkeypatch, tmp_path):
    """Colab: the training kernel (another process) still holds the chip when a fresh runtime's vllm_server.start runs
    vllm-tpu. It must refuse before launching anything, naming that process, not fail later in libtpu's log."""
    import dataclasses

    from gemma_tpu_helpers.course.config import profiles
    from gemma_tpu_helpers.course.front import preflight

    accel = tmp_path / "accel0"
    accel.write_text("")
    for module in (profiles, vllm_server):
        monkeypatch.setattr(module, "tpu_visible", lambda: True)
    monkeypatch.setattr(process_groups, "TPU_DEVICE_GLOBS", (str(tmp_path / "accel*"),))
    monkeypatch.setattr(process_groups, "LIBTPU_LOCKFILE", str(tmp_path / "libtpu_lockfile"))
    monkeypatch.setattr(preflight.shutil, "which", lambda name: None)
    colab = profiles.get_profile("colab-v5e-1")
    target = dataclasses.replace(colab.serving, python=tmp_path / "venv" / "bin" / "python")
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; d = open(sys.argv[1]); "
                              "print('holding', flush=True); time.sleep(60)", str(accel)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "holding"
        with pytest.raises(vllm_command.ServeError,
                           match=f"vLLM cannot open the TPU: it is in use by pid {child.pid} ") as e:
            vllm_server.start(target, "google/gemma-4-E2B-it")
        assert f"kill {child.pid}" in str(e.value)
    finally:
        child.kill()
        child.wait()
    with pytest.raises(vllm_command.ServeError, match="vllm-tpu is not installed"):  # the chip is free now: next check
        vllm_server.start(target, "google/gemma-4-E2B-it")


def test_versions_check_reads_the_pins():
    from gemma_tpu_helpers.course.config import profiles
    from gemma_tpu_helpers.course.front import preflight

    c = preflight.check_versions(profiles.get_profile("v5p-8"))
    assert c.status == "ok", c.detail
    assert preflight.pinned_jax() == __import__("jax").__version__
    assert preflight.jax_wants_libtpu().startswith("==")
