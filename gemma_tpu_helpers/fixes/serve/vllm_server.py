"""Run a vLLM server (:func:`start`): its own process group on 127.0.0.1, wait for ``/health``, stop the whole
group afterwards (:class:`Server` is a context manager)."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

from ..core import file_io, http_client, process_groups
from ..core.process_groups import tpu_device_files, tpu_holders, tpu_visible
from .vllm_client import Client
from .vllm_command import (
    DEFAULT_PORT,
    HOST,
    SERVED_NAME,
    ServeError,
    ServeTarget,
    check_model_dir,
    environment,
    is_hub_id,
    route,
    serve_command,
    tpu_pip_instructions,
)

START_TIMEOUT_S = 600.0  # CPU start is ~40-100 s here; a 31B on TPU loads and compiles for minutes


STOP_GRACE_S = process_groups.STOP_GRACE_S  # SIGTERM, then SIGKILL the whole process group after this


LOG_TAIL_LINES = file_io.LOG_TAIL_LINES


def tpu_held_by_this_process() -> list[str]:
    """The TPU device files this Python process has open: non-empty once JAX has run on the TPU here (training,
    parity), and then no other process can use the chip until this one exits (libtpu admits one process)."""
    wanted = {os.path.realpath(p) for p in tpu_device_files()}
    held = set()
    for fd in os.listdir("/proc/self/fd") if wanted and os.path.isdir("/proc/self/fd") else ():
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target in wanted:
            held.add(target)
    return sorted(held)


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(port: int, host: str = HOST) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise ServeError(f"Port {port} on {host} is busy ({e.strerror}): another server is listening there. "
                             f"Stop it (`ss -ltnp | grep :{port}` shows which process), or pick another port "
                             f"(port=None picks a free one).", params=("port",)) from None


class Server(Client):
    """A running vLLM server in its own process group. ``.stop()`` it, or use ``with start(...) as server:``."""

    def __init__(self, proc: subprocess.Popen, argv: list[str], port: int, host: str, log_path: Path,
                 served_name: str, api_key: str | None):
        super().__init__(f"http://{host}:{port}", served_name, api_key)
        self.proc, self.argv, self.port, self.host, self.log_path = proc, argv, port, host, log_path
        self.pid = proc.pid
        self.pgid = proc.pid  # process_groups.start_group: the server leads its own group
        self.start_s: float | None = None
        self.processes_at_start: list[int] = []  # the server and its workers (engine core, ...), once healthy
        # stop the group if the object is dropped or the interpreter exits (a notebook kernel restart included)
        self._finalizer = weakref.finalize(self, process_groups.stop_group, proc, STOP_GRACE_S)

    # -- lifecycle
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        return file_io.log_tail(self.log_path, n)

    def wait_ready(self, timeout: float = START_TIMEOUT_S, progress: bool = True) -> float:
        """Poll ``/health`` until 200; returns the seconds it took. Raises ServeError (with the log tail) if the
        process exits or ``timeout`` passes; the server is stopped in both cases."""
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        bar = tqdm(total=int(timeout), desc="vLLM starting", disable=not progress, leave=False,
                   bar_format="{desc}: {n_fmt} s of at most {total_fmt} s |{bar}|")
        try:
            while True:
                elapsed = time.perf_counter() - t0
                bar.n = min(int(elapsed), int(timeout))
                bar.refresh()
                if self.proc.poll() is not None:
                    code = self.proc.returncode
                    self.stop()
                    raise ServeError(f"The vLLM server exited with code {code} during start-up. Last lines of "
                                     f"{self.log_path}:\n{self.log_tail()}")
                if http_client.health_ok(self.base_url, timeout=2.0):
                    self.start_s = time.perf_counter() - t0
                    self.processes_at_start = process_groups.group_members(self.pgid)
                    return self.start_s
                if elapsed > timeout:
                    self.stop()
                    raise ServeError(f"The vLLM server did not answer {self.base_url}/health within {timeout:.0f} s "
                                     f"(stopped it). Last lines of {self.log_path}:\n{self.log_tail()}")
                time.sleep(0.25)  # a refused connection costs nothing; the server is ready up to 0.25 s sooner
        finally:
            bar.close()

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM the whole process group, SIGKILL it after ``grace`` seconds; idempotent."""
        if self._finalizer.alive:
            self._finalizer.detach()
            process_groups.stop_group(self.proc, grace)

    def leftover_processes(self) -> list[int]:
        """Processes of this server still running: members of its group, or any it had once healthy."""
        alive = [pid for pid in self.processes_at_start if process_groups.pid_running(pid)]
        return sorted(set(alive + process_groups.group_members(self.pgid)))

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.alive() else f"stopped ({self.proc.returncode})"
        return f"<vLLM server {self.base_url} model={self.served_name!r} pid={self.pid} {state}, log {self.log_path}>"


def start(target: ServeTarget, model_dir: str | os.PathLike, port: int | None = None, api_key: str | None = None,
          served_name: str = SERVED_NAME, lora_modules: dict[str, str | os.PathLike] | None = None,
          log_path: str | os.PathLike | None = None, timeout: float = START_TIMEOUT_S, progress: bool = True,
          extra_args: list[str] | None = None) -> Server:
    """Launch vLLM on 127.0.0.1 (the cpu and pip routes; a free port unless ``port`` is given), wait until
    ``/health`` answers, and return the :class:`Server`. ``extra_args`` are appended to the vLLM argv.

    Raises ServeError before launching (a docker target, a bad model directory, a busy port, no free TPU here) and,
    with the log's last lines, when the server exits or is not healthy within ``timeout`` (it is stopped then).
    """
    how = route(target)
    if how == "docker":
        raise ServeError(f"Profile {target.name!r} serves from the {target.spec.image} Docker image on its TPU VM: "
                         f"run vllm_command.shell_line(target, DIR) there, "
                         f"then vllm_client.connect('http://127.0.0.1:{DEFAULT_PORT}'). "
                         f"Rehearse here with a CPU target.")
    if how == "pip":
        _check_pip_route(target)
    model_dir = check_model_dir(model_dir) if how == "cpu" or not is_hub_id(model_dir) else model_dir
    for name, path in (lora_modules or {}).items():
        if not (Path(path) / "adapter_config.json").is_file():
            raise ServeError(f"LoRA module {name!r}: {path} has no adapter_config.json (save it with PEFT's "
                             f"save_pretrained, or adapters.make_test_adapter).")
    if port is None:
        port = free_port()
    else:
        check_port_free(port)
    argv = serve_command(target, model_dir, port=port, api_key=api_key, served_name=served_name,
                   lora_modules=lora_modules) + list(extra_args or [])
    log_path = file_io.absolute_path(
        log_path or Path(target.log_dir or tempfile.mkdtemp(prefix="vllm-")) / "server.log", "log path")
    env = {**os.environ, **environment(target, api_key, lora=bool(lora_modules))}
    proc = process_groups.start_group(argv, log_path, env=env, cwd=log_path.parent, header=f"# {shlex.join(argv)}\n")
    server = Server(proc, argv, port, HOST, log_path, served_name, api_key)
    try:
        server.wait_ready(timeout=timeout, progress=progress)
    except BaseException:
        server.stop()
        raise
    return server


def _check_pip_route(target: ServeTarget) -> None:
    """What the pip route needs before it launches: a TPU here, held by no process (this one or another), and
    vllm-tpu installed."""
    if not tpu_visible():
        raise ServeError(f"Profile {target.name!r} serves vllm-tpu on this machine's TPU, and no TPU is visible here "
                         f"(no TPU device files). On Colab pick a TPU runtime (Runtime > Change "
                         f"runtime type); on a CPU, rehearse with a CPU target.")
    held = tpu_held_by_this_process()
    if held:
        raise ServeError(f"This Python process holds the TPU ({', '.join(held)}): JAX ran on it here (training, "
                         f"parity, a plan), and libtpu admits one process, so vLLM could not open the chip. Restart "
                         f"the runtime (Colab: Runtime > Restart session) and start the server before anything runs "
                         f"JAX on the TPU; evaluate through the server, and run JAX checks after server.stop() in a "
                         f"fresh process.")
    others = tpu_holders()  # another process (the training kernel of an earlier runtime, an old server)
    if others:
        who = "; ".join(f"pid {pid} ({cmd})" for pid, cmd in sorted(others.items()))
        raise ServeError(f"vLLM cannot open the TPU: it is in use by {who}, and libtpu admits one process. Stop it "
                         f"(kill {' '.join(map(str, sorted(others)))}; a notebook kernel: restart or shut it down) "
                         f"and retry.")
    vllm = Path(target.python).parent / "vllm"
    if not vllm.is_file():
        raise ServeError(f"vllm-tpu is not installed: {vllm} does not exist. Install it into the serving venv "
                         f"(a few minutes; no Docker needed):\n{tpu_pip_instructions(target)}")

