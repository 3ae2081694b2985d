"""Helpers the test modules share (no test module imports another): starting and stopping the CLI in processes of
their own, the kill-and-resume checks, the replicas' CLI walks, the serving venv and the notebooks' copy lines."""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "gemma_tpu_helpers"
# conftest's smoke run: the uninterrupted reference of every kill-and-resume test, on rows of SMOKE_RUN_SEQ tokens
# (the smoke profile's 512 halved: what a resume restores does not depend on the row length)
SMOKE_RUN_STEPS, SMOKE_RUN_EVERY, SMOKE_RUN_SEQ = 4, 2, 256
# (the last --checkpoint-every wins) no periodic save: Orbax saves step 1 (its first) and a preemption its step
NO_PERIODIC = ["--checkpoint-every", 1000]
# The shipped CodeV-R1 replica as load_rows' (source, config): the course's data, a plain folder to the data fix
SHIPPED = {"source": str(REPO / "gemma_tpu_helpers" / "data" / "codev_r1_replica"), "config": "sft"}


def short_rows(profile, seq: int = 256):
    """``profile`` training on rows of ``seq`` tokens instead of its ``max_seq_len`` (smoke: 512), for the tests whose
    subject is not the row length (what a step times, what the helpers add, a bf16 merge). A smoke step on 256-token
    rows takes 1.7-2.0 s here against 4.5 s on 512 (the same 8 rows and 8 devices); 124 of the shipped replica's 256
    examples fit, 252 on 512 rows."""
    import dataclasses

    return dataclasses.replace(profile, train=dataclasses.replace(profile.train, max_seq_len=seq))


def smoke_run_profile():
    """The smoke profile as conftest's smoke run and support.train_args train it: rows of SMOKE_RUN_SEQ tokens."""
    from gemma_tpu_helpers.course.config import profiles

    return short_rows(profiles.get_profile("smoke"), SMOKE_RUN_SEQ)


def serve_python() -> Path:
    """The serving venv's python, as the course finds it ($GEMMA_TPU_SERVE_PYTHON, else .venv-serve)."""
    from gemma_tpu_helpers.course.config import paths

    return paths.serve_python()


SERVE_PY = serve_python()
needs_serve_venv = pytest.mark.skipif(not SERVE_PY.is_file(), reason="no serving venv: run `make serve-venv`")


@contextlib.contextmanager
def vllm(spec, model, log_path, **start_kwargs):
    """A real vLLM server (``vllm_server.start``, 127.0.0.1) for a module's tests, stopped afterwards, also when a CI
    timeout's SIGTERM arrives (it unwinds through ``finally``); the tests skip without the serving venv."""
    from gemma_tpu_helpers.fixes.serve import vllm_server

    if not SERVE_PY.is_file():
        pytest.skip("no serving venv: run `make serve-venv`")

    def on_sigterm(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    srv = vllm_server.start(spec, model, log_path=log_path, progress=False, **start_kwargs)
    try:
        yield srv
    finally:
        srv.stop()
        signal.signal(signal.SIGTERM, previous)


def one_line_error(r, *needles) -> str:
    """The CLI refused bad input as it should: exit 2, no traceback, one stderr line ``error: ...`` naming each of
    ``needles``; returns that line."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def run_cli(*args, env=None, timeout=600, cwd=REPO):
    """``python -m gemma_tpu_helpers ARGS`` in ``cwd`` (default: the checkout), as a user runs it."""
    return subprocess.run([sys.executable, "-m", "gemma_tpu_helpers", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd)


# ------------------------------------------------------------------------------------- processes of their own

def free_port_pair() -> int:
    """A port P with P and P+1 free (jax.distributed's coordinator uses both)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def start(*args, module=True):
    """``python -m gemma_tpu_helpers ARGS`` (or ``python ARGS``) in its own session, output piped."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GEMMA_TPU_PROFILE": "smoke"}
    cmd = [sys.executable, "-m", "gemma_tpu_helpers", *map(str, args)] if module else [sys.executable, *map(str, args)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def kill(procs) -> None:
    """SIGKILL each process's whole session (whatever it started) and reap it."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)


def finish(procs, timeout: float) -> list[tuple[int, str]]:
    """Wait for all (a shared deadline); kill the process groups whatever happens; (returncode, output) each."""
    try:
        deadline = time.monotonic() + timeout
        outs = []
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append((p.returncode, out))
        return outs
    finally:
        kill(procs)


def train_args(run_dir, base, steps=SMOKE_RUN_STEPS, every=SMOKE_RUN_EVERY):
    """The `train` command of conftest's smoke run (its steps, checkpoints and rows)."""
    return ["train", "--run-dir", run_dir, "--base", base, "--max-steps", steps, "--checkpoint-every", every,
            "--max-seq-len", SMOKE_RUN_SEQ]


def losses(metrics):
    """The training losses of a metrics table, by step."""
    return metrics.dropna(subset=["loss"]).set_index("step")["loss"]


def wait_for_step(run_dir, procs, timeout=900) -> None:
    """Until process 0 has written the metrics of step 1 in ``run_dir`` (local or gs://): training runs, compiled."""
    from gemma_tpu_helpers.fixes.core import file_io

    path = file_io.to_path(str(run_dir)) / "train" / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (path.is_file() and '"loss"' in path.read_text()):
        for p in procs:
            assert p.poll() is None, p.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "training did not reach step 1 in time"
        time.sleep(0.2)


def stopped_step(out: str) -> int:
    """The step a preempted training says it stopped after (its one line, with the exit code and how to resume)."""
    from gemma_tpu_helpers.fixes.train.preemption import PREEMPTED_EXIT

    line = next((x for x in out.splitlines() if x.startswith("preempted: SIGTERM: stopped after step ")), None)
    assert line is not None, out[-4000:]
    assert "Run the same command again to resume" in line and f"exit code {PREEMPTED_EXIT}" in line, line
    return int(line.split("stopped after step ")[1].split()[0])


def sigterm_processes(run_dir, procs, to: int = 0) -> tuple[list[tuple[int, str]], float]:
    """A SIGTERM to the session of ``procs[to]`` once step 1 is recorded in ``run_dir`` (as a spot VM's shutdown
    sends it); every process must exit 75. ``([(returncode, output)], seconds from the signal to the last exit)``."""
    from gemma_tpu_helpers.fixes.train.preemption import PREEMPTED_EXIT

    try:
        wait_for_step(run_dir, procs)
        sent = time.monotonic()
        os.killpg(procs[to].pid, signal.SIGTERM)
        outs = finish(procs, timeout=300)
        exit_s = time.monotonic() - sent
    finally:
        kill(procs)
    for i, (rc, out) in enumerate(outs):
        assert rc == PREEMPTED_EXIT, f"process {i}:\n{out[-4000:]}"
    return outs, exit_s


def check_resume(reference, run_dir, after_step: int, steps=SMOKE_RUN_STEPS, every_step=True) -> None:
    """The run in ``run_dir`` recorded steps 1..steps (``every_step``; a SIGKILL may lose the lines it had not
    written yet), and its losses after ``after_step`` (where it was stopped) equal the uninterrupted ``reference``
    run's bit for bit. One process on one machine runs the same compiled program on the same inputs, which a CPU
    computes the same way each time: a resume that restored every bit (parameters, optimizer state, the data's
    position) cannot differ by even one rounding."""
    from gemma_tpu_helpers.course.training import train

    a, b = losses(reference.metrics), losses(train.read_metrics(run_dir))
    want = list(range(1 if every_step else after_step + 1, steps + 1))
    assert (list(b.index) if every_step else [s for s in b.index if s > after_step]) == want, b
    after = [s for s in a.index if s > after_step]
    assert after, f"stopped at step {after_step}: too late to test a resume"
    diff = a[after].to_numpy() - b[after].to_numpy()
    print(f"resume parity after step {after_step}: |dloss| over steps {after} = {np.abs(diff).max():.2e}")
    assert (diff == 0).all(), dict(zip(after, diff))


# ----------------------------------------------------------------------------------- the replicas' CLI walks

# The walk's steps in one Python process, as a notebook's kernel runs them: `python -m gemma_tpu_helpers STEP ...`
# is this main(argv) after the imports, which a process per step would pay again each time (5.7 s here).
WALK_DRIVER = """
import contextlib, io, json, sys, traceback
from gemma_tpu_helpers.__main__ import main

results = {}
for name, argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            rc = 1
    results[name] = [rc or 0, out.getvalue(), err.getvalue()]
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)
    if rc:
        break
"""


def walk(root: Path, profile: str, steps) -> dict:
    """Run CLI steps one after another with GEMMA_TPU_RUNS=root, in one Python process (WALK_DRIVER): ``steps`` is
    ``[(name, argv, timeout)]``. A failed step ends the walk (:func:`walk_step` says which).
    ``{"root", "run" (root/profile), "env", "steps"}``, each step's result a CompletedProcess (its code and output)."""
    env = {"GEMMA_TPU_RUNS": str(root)}
    out = Path(root).parent / f"{Path(root).name}.walk.json"
    argvs = [(name, [str(a) for a in args]) for name, args, _ in steps]
    done = subprocess.run([sys.executable, "-c", WALK_DRIVER, json.dumps(argvs), str(out)], capture_output=True,
                          text=True, timeout=sum(t for *_, t in steps), env={**os.environ, **env}, cwd=REPO)
    recorded = json.loads(out.read_text()) if out.is_file() else {}
    results = {name: subprocess.CompletedProcess(argv, *recorded[name]) for name, argv in argvs if name in recorded}
    if len(results) < len(steps) and all(r.returncode == 0 for r in results.values()):  # the process itself died
        name = argvs[len(results)][0]
        results[name] = subprocess.CompletedProcess(argvs[len(results)][1], done.returncode or 1, done.stdout,
                                                    done.stderr)
    return {"root": root, "run": root / profile, "env": env, "steps": results}


def walk_step(walked: dict, name: str):
    """The result of step ``name`` of a walk; fails naming the step that stopped it."""
    r = walked["steps"].get(name)
    assert r is not None, f"the walk stopped before {name}: {sorted(walked['steps'])} ran"
    assert r.returncode == 0, f"{name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def model_keys(model_dir: Path) -> dict[str, str]:
    """A sharded checkpoint's weight map: tensor name -> shard file."""
    return json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]


def model_tensor(model_dir: Path, key: str):
    from safetensors import safe_open

    with safe_open(model_dir / model_keys(model_dir)[key], framework="np") as f:
        return f.get_tensor(key)


# ----------------------------------------------------------------------------------- the package's source

def path_of(module: str) -> Path:
    """The source file of ``"<tier>.<name>"`` (or a top-level module's name)."""
    return PKG / (module.replace(".", "/") + ".py")


def copy_lines():
    """{notebook: (module as "<tier>.<folder>.<name>", the files its 'Copy into your project' line lists, the same
    way)}."""
    import nbformat

    out = {}
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")
        m = re.search(r"\*\*Copy into your project:\*\* `gemma_tpu_helpers/(fixes|course)/(\w+)/(\w+)\.py` and what "
                      r"it imports from this package: ([^(]*)\(", text)
        assert m, f"{path.name} has no 'Copy into your project' line"
        out[path.stem] = (f"{m.group(1)}.{m.group(2)}.{m.group(3)}",
                          {".".join(f) for f in re.findall(r"`(fixes|course)/(\w+)/(\w+)\.py`", m.group(4))})
    return out


def have_iverilog() -> bool:
    """Whether Icarus Verilog 12 is installed (``make iverilog``): the eval tests score by simulating."""
    from gemma_tpu_helpers.course.config import paths  # noqa: F401  (importing the course puts its Icarus first on PATH)
    from gemma_tpu_helpers.fixes.eval import eval_simulate

    try:
        return bool(eval_simulate.simulator_tools())
    except eval_simulate.IverilogNotFoundError:
        return False


def shard_tensors(path: Path) -> dict:
    """Every tensor of one safetensors file, as numpy arrays."""
    from safetensors import safe_open

    with safe_open(path, framework="np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


# ----------------------------------------------------------------------------------- LoRA training and checkpoints

def lora_train_steps(model, steps=1) -> list[float]:
    """``steps`` Adam steps (lr 1e-2) of a model's LoRA params on one random batch of 2 x 8 tokens: the losses.
    The plain next-token loss, not the course's step: what a LoRA or QLoRA model must be able to train."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    b, t = 2, 8
    tokens = jax.random.randint(jax.random.key(0), (b, t), 0, model.config.num_embed)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = jnp.tril(jnp.ones((t, t), bool))[None].repeat(b, 0)

    def loss_fn(m):
        logits, _ = m(tokens, pos, None, mask)
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()

    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)

    @nnx.jit
    def step(m, o):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(m)
        o.update(m, grads)
        return loss

    return [float(step(model, opt)) for _ in range(steps)]



def lora_ckpt(base: Path, ckpt: Path, steps=((1, 0),), std: float = 0.05) -> Path:
    """A LoRA checkpoint on every target of ``base``, one synthetic LoRA per (step, seed)."""
    from gemma_tpu_helpers.fixes.model import gemma4, layout
    from gemma_tpu_helpers.fixes.train import lora_checkpoint

    text = gemma4.read_text_config(base)
    meta = {"targets": list(layout.TARGETS), "rank": 4, "alpha": 8.0, "num_layers": text["num_hidden_layers"]}
    for step, seed in steps:
        lora = layout.synthetic_lora(text, list(layout.TARGETS), 4, seed=seed, std=std)
        lora_checkpoint.write_lora_checkpoint(ckpt, lora, meta, step=step)
    return ckpt


def bf16_copy(src: Path, dst: Path) -> Path:
    """``src`` with every fp32 tensor stored in bf16 and config dtype bfloat16, as google/gemma-4-31B-it ships."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        tensors = {k: (v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v)
                   for k, v in load_file(shard).items()}
        save_file(tensors, shard, metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst
