"""Several hosts, one program: ``jax.distributed`` set-up, process-0-only writes, and a batch's rows per process.

After :func:`initialize`, ``jax.devices()`` lists every host's devices and a mesh spans them: each process feeds the
rows its devices hold (:func:`process_rows`), all write Orbax checkpoints together to a directory every host reads,
and only process 0 writes files and reports (:func:`is_main`, :func:`main_first`).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import sys
import time

from ..core.errors import GemmaTpuError

DEFAULT_TIMEOUT_S = 120


def cpu_xla_flags(num_devices: int, current: str = "") -> str:
    """``XLA_FLAGS`` for ``num_devices`` virtual CPU devices with patient collectives; other flags in ``current`` stay.

    8 virtual devices share a laptop's few cores; a busy machine can stall one device's thread past XLA's 40 s
    collective rendezvous limit, which aborts the process. So the collectives get more time.
    """
    ours = ("xla_force_host_platform_device_count", "xla_cpu_collective_")
    kept = [f for f in current.split() if not any(o in f for o in ours)]
    return " ".join(kept + [f"--xla_force_host_platform_device_count={num_devices}",
                            "--xla_cpu_collective_call_terminate_timeout_seconds=1200",
                            "--xla_cpu_collective_timeout_seconds=1200"])


class MultihostError(GemmaTpuError, RuntimeError):
    pass


# the parameters of initialize() a failed handshake is about, every process's pair
WHO = ("num_processes", "process_id")


def _split(coordinator: str) -> tuple[str, int]:
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise MultihostError(f"coordinator {coordinator!r} is not HOST:PORT (e.g. 10.0.0.2:8476 or 127.0.0.1:8476).")
    return host, int(port)


def _send(sock, obj) -> None:
    sock.sendall((json.dumps(obj) + "\n").encode())


def _recv(sock, deadline: float):
    buf = b""
    while not buf.endswith(b"\n"):
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return json.loads(buf)


def _coordinator_handshake(port: int, num_processes: int, timeout_s: float) -> None:
    """Process 0: wait for every other process to say hello with the same process count."""
    deadline = time.monotonic() + timeout_s
    seen: dict[int, socket.socket] = {}
    error = None
    try:
        server = socket.create_server(("", port))
    except OSError as e:
        raise MultihostError(f"process 0 cannot listen on port {port} for the handshake ({e}): pick a coordinator "
                             f"port P with P and P+1 free.") from None
    with server:
        while len(seen) < num_processes - 1 and error is None:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, num_processes)) - set(seen))
                error = (f"only {len(seen) + 1} of {num_processes} processes joined within {timeout_s:g} s "
                         f"(missing process ids {missing}). Start every worker with the same "
                         f"num_processes={num_processes} and a distinct process_id, or lower num_processes.")
                break
            server.settimeout(min(left, 1.0))
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            try:
                hello = _recv(conn, time.monotonic() + 10)
            except (OSError, ValueError):
                conn.close()
                continue
            pid, n = hello.get("process_id"), hello.get("num_processes")
            seen_before = pid in seen
            seen[pid] = conn
            if n != num_processes:
                error = (f"process {pid} was started with num_processes={n}, but the coordinator (process 0) "
                         f"with {num_processes}. Start every worker with the same num_processes.")
            elif not isinstance(pid, int) or not 0 < pid < num_processes or seen_before:
                error = (f"process id {pid} is not valid or is used twice: with num_processes={num_processes} "
                         f"the other workers need the distinct process_id values 1..{num_processes - 1}.")
        for conn in seen.values():
            try:
                _send(conn, {"error": error})
            except OSError:
                pass
            conn.close()
    if error:
        raise MultihostError(error, params=WHO)


def _worker_handshake(host: str, port: int, num_processes: int, process_id: int, timeout_s: float) -> None:
    """Process 1..N-1: reach process 0's handshake port and wait for its verdict."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, max(0.1, deadline - time.monotonic()))) as s:
                _send(s, {"process_id": process_id, "num_processes": num_processes})
                reply = _recv(s, deadline + 10)
            break
        except (OSError, ValueError) as e:
            last = e
            if time.monotonic() >= deadline:
                raise MultihostError(
                    f"process {process_id} could not reach the coordinator's handshake at {host}:{port} within "
                    f"{timeout_s:g} s ({type(last).__name__}: {last}). Start process 0 (process_id=0) on {host}, "
                    f"check the address, and open ports {port - 1} and {port} between the hosts.",
                    params=("process_id",)) from None
            time.sleep(0.25)
    if reply.get("error"):
        raise MultihostError(f"the coordinator refused process {process_id}: {reply['error']}", params=WHO)


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               local_devices: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join this process to the others (``jax.distributed.initialize``), raising :class:`MultihostError` within
    ``timeout_s`` where JAX would die with a C++ fatal error: a handshake on the coordinator's port + 1 comes first.

    ``coordinator``: process 0's ``HOST:PORT``, or None / "auto" for JAX's own detection (a pod slice, SLURM; no
    handshake). ``local_devices``: virtual CPU devices of this process, so call this before any JAX computation.
    """
    if coordinator in (None, "auto"):
        import jax

        jax.distributed.initialize()
        return
    host, port = _split(coordinator)
    if not isinstance(num_processes, int) or num_processes < 1:
        raise MultihostError(f"num_processes must be a positive integer, got {num_processes!r}.",
                             params=("num_processes",))
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise MultihostError(f"process_id must be in 0..{num_processes - 1} for {num_processes} processes, "
                             f"got {process_id!r}.", params=("process_id",))
    if local_devices:
        if "jax" in sys.modules:
            from jax._src import xla_bridge

            if xla_bridge.backends_are_initialized():
                raise MultihostError("JAX already created its devices; call multihost.initialize() before any JAX "
                                     "computation (first thing in the script, or restart the kernel).")

        os.environ["XLA_FLAGS"] = cpu_xla_flags(local_devices, os.environ.get("XLA_FLAGS", ""))
    if num_processes > 1:
        if process_id == 0:
            _coordinator_handshake(port + 1, num_processes, timeout_s)
        else:
            _worker_handshake(host, port + 1, num_processes, process_id, timeout_s)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id,
                               initialization_timeout=max(1, int(timeout_s)))
    if jax.process_count() != num_processes:
        raise MultihostError(f"JAX sees {jax.process_count()} processes, expected {num_processes}.")


def is_main() -> bool:
    """True in process 0, and in any single-process program: the one process that writes files and reports.
    Safe before :func:`initialize` (it never starts JAX's backend)."""
    if "jax" not in sys.modules:
        return True
    import jax
    from jax._src import xla_bridge

    if not (jax.distributed.is_initialized() or xla_bridge.backends_are_initialized()):
        return True
    return jax.process_index() == 0


_CALLS = itertools.count()  # every process calls main_first in the same order: the n-th call's keys are its own
MAIN_FIRST_TIMEOUT_S = 24 * 3600  # how long the others wait for process 0 (a 62 GB download on a slow link: hours)


def process_0_says(key: str, decide, what: str, timeout_s: float = MAIN_FIRST_TIMEOUT_S) -> str:
    """Process 0's ``decide()`` (a string) in every process: process 0 runs it and publishes it under ``key`` in the
    distributed runtime's key-value store; the others wait for it (MultihostError after ``timeout_s``, naming
    ``what`` process 0 was doing). If ``decide`` raises in process 0, the others read ``failed: <error>``."""
    import jax
    from jax._src.distributed import global_state

    client = global_state.client
    if jax.process_index() == 0:
        try:
            said = decide()
        except BaseException as e:
            client.key_value_set(key, f"failed: {type(e).__name__}: {e}", allow_overwrite=True)
            raise
        client.key_value_set(key, said)
        return said
    try:
        return client.blocking_key_value_get(key, int(timeout_s * 1000))
    except Exception as e:  # the runtime's timeout (or process 0 gone): one line, not a C++ status dump
        raise MultihostError(f"waited {timeout_s:.0f} s for process 0 to {what} ({type(e).__name__}); check "
                             f"process 0's output.") from None


def main_first(fn, name: str, timeout_s: float = MAIN_FIRST_TIMEOUT_S, directory=None):
    """``fn()`` in process 0 first, then in the others, which find its work done (e.g. one download into a shared
    directory per pod). They wait on the distributed runtime's key-value store, not on files (gcsfuse has no locks),
    and raise MultihostError naming process 0's error if ``fn`` failed there.

    ``directory``: where ``fn`` writes. A process that does not see process 0's copy of it (hosts that share no
    disk, e.g. each host's local cache under a gs:// run directory) runs ``fn`` at once, beside process 0: the hosts
    download in parallel instead of one after the other. Every process must pass the same ``name``."""
    import jax

    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        return fn()
    key = f"main_first/{next(_CALLS)}/" + name.replace(" ", "_")
    if directory is not None and not _sees_process_0(key, directory, timeout_s):
        return fn()
    out = []
    said = process_0_says(key, lambda: (out.append(fn()), "done")[1], name, timeout_s)
    if out:  # process 0
        return out[0]
    if said != "done":
        raise MultihostError(f"process 0 could not {name} ({said}); fix that and run again on every worker.")
    return fn()


def _sees_process_0(key: str, directory, timeout_s: float) -> bool:
    """Whether this process sees the file process 0 just wrote in ``directory`` (True in process 0). Process 0
    removes it once every process has looked (a barrier)."""
    import uuid
    from pathlib import Path

    import jax
    from jax._src.distributed import global_state

    probe = Path(directory) / ".multihost-probe"

    def write() -> str:
        token = uuid.uuid4().hex
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
        return token

    token = process_0_says(key + "/probe", write, f"write {probe}", timeout_s)
    seen = jax.process_index() == 0 or (probe.is_file() and probe.read_text() == token)
    global_state.client.wait_at_barrier(key + "/probed", int(timeout_s * 1000))
    if jax.process_index() == 0:
        probe.unlink(missing_ok=True)
    return seen


def process_rows(mesh, global_batch: int, axis: str = "fsdp") -> slice:
    """The rows of a global batch that this process's devices hold when the batch is sharded over ``axis``.
    Raises MultihostError when the batch does not divide over ``axis`` or the rows are not one block."""
    from jax.sharding import NamedSharding, PartitionSpec

    size = dict(mesh.shape).get(axis, 1)
    if global_batch % size:
        raise MultihostError(f"global batch {global_batch} does not divide the {axis} axis ({size}); use a multiple "
                             f"of {size}.")
    spec = PartitionSpec(axis) if axis in mesh.axis_names else PartitionSpec()
    index = NamedSharding(mesh, spec).addressable_devices_indices_map((global_batch,))
    blocks = sorted({(s[0].start or 0, global_batch if s[0].stop is None else s[0].stop) for s in index.values()})
    start, stop = blocks[0][0], blocks[-1][1]
    covered = sum(b - a for a, b in blocks)
    if covered != stop - start:
        raise MultihostError(f"this process's devices hold rows {blocks} of the batch, not one block: build the mesh "
                             f"with mesh.make_mesh (devices in process order).")
    return slice(start, stop)
