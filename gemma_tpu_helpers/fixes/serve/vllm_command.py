"""The vLLM command for a Gemma 4 checkpoint on a machine (:class:`ServeTarget`), by one of three routes
(:func:`route`): **docker** on a TPU VM (printed, not run), **pip** (vllm-tpu from PyPI, e.g. Colab) and **cpu**
(vLLM's CPU build). :func:`hbm_per_chip` is the weights + KV-cache arithmetic behind a TPU choice."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path

from ..core import file_io, http_client
from ..core.errors import GemmaTpuError
from ..model.hf_checkpoint import CheckpointError, checkpoint_layout, kv_shared_layers, layer_kinds
from ..model.model_size import attn_dims, param_count


@dataclasses.dataclass(frozen=True)
class ServeSpec:
    tensor_parallel: int
    max_model_len: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    kv_cache_dtype: str = "auto"
    # vLLM's TPU platform warns that a multimodal model (the 31B-it has a vision tower) needs this, or a prompt's
    # image can be split across two scheduler steps and fail at run time.
    disable_chunked_mm_input: bool = False
    # The tag vllm/vllm-tpu's Trillium recipe for Gemma 4 names; it moves, so pin its digest for a reproducible run.
    image: str = "vllm/vllm-tpu:gemma4"
    # vllm-tpu's version for the pip route, the vLLM whose parser checks these commands. A Python 3.12 wheel pinning
    # jax 0.11.2 (through tpu-inference), hence a venv of its own beside tunix's jax 0.10.2.
    pip_version: str = "0.32.0"
    # A TPU server's route: True, `docker run` of the `image` (a TPU VM); False, vllm-tpu from pip as a plain
    # `vllm serve` on this machine (Colab, which has no Docker). CPU targets always run vLLM's CPU build.
    docker: bool = True
    max_num_seqs: int | None = None  # --max-num-seqs (None: vLLM's default)
    # --enforce-eager: no torch.compile at start-up, which the CPU build redoes at every start and a small model
    # never wins back (most of a tiny replica's start).
    enforce_eager: bool = False


# ---- documented defaults (everything else comes from target.spec / target.model / target.lora) ----------------
HOST = "127.0.0.1"  # never listen beyond this machine by default; expose with an API key and a firewall rule


DEFAULT_PORT = 8000  # vLLM's own default


SERVED_NAME = "gemma"  # the `model` name clients send


CPU_KVCACHE_SPACE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: the CPU build's KV cache in GiB (its default is 4)


# VLLM_ENABLE_V1_MULTIPROCESSING=0 on one CPU device: the model runs in the engine process instead of a third
# process that imports torch and vLLM once more. The tiny replica's server is ready in 16 s instead of 22-23 s
# (2-core AMD EPYC), with the same greedy answers; with tensor_parallel > 1 the CPU build needs its worker processes.
CPU_ONE_PROCESS_ENGINE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


# A multimodal-layout checkpoint (Gemma4ForConditionalGeneration, keys under model.language_model.) served text-only:
# the CPU build's multimodal path needs torchvision, which does not load beside the CPU torch.
TEXT_ONLY_OVERRIDES = {"architectures": ["Gemma4ForCausalLM"]}


# Docker on a TPU VM: the shared-memory size and compile-cache paths from the vLLM-TPU install guide.
DOCKER_SHM_SIZE = "16G"


HOST_COMPILE_CACHE = "~/.cache/vllm_xla"


CONTAINER_CACHE = "/root/.cache/vllm"


CONTAINER_MODEL_DIR = "/model"


HOST_HF_CACHE = "~/.cache/huggingface"


HF_TOKEN_ENV = "HF_TOKEN"  # passed to the container by name (`-e HF_TOKEN`), never by value


API_KEY_ENV = http_client.API_KEY_ENV  # vLLM reads it like --api-key; an env var keeps the key out of `ps`


GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class ServeTarget:
    """What serving reads besides its :class:`ServeSpec`: the machine, the model's dtype and the LoRA rank.
    ``name`` labels messages; ``log_dir``: where the server writes ``server.log`` (None: a new temporary directory)."""
    name: str
    platform: str  # "cpu" or "tpu"
    chips: int  # every chip of the slice (all hosts)
    spec: ServeSpec
    dtype: str = "bfloat16"
    hosts: int = 1
    max_lora_rank: int = 64  # --max-lora-rank when LoRA adapters are served unmerged
    hbm_gib_per_chip: float | None = None  # TPU only: hbm_per_chip's budget
    log_dir: str | os.PathLike | None = None
    python: str | os.PathLike = sys.executable  # the python that has vLLM (often a venv of its own)

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts


class ServeError(GemmaTpuError, RuntimeError):
    """Serving failed in a way the user can fix; the message says how."""


def check_model_dir(model_dir: str | os.PathLike) -> Path:
    """A servable HF checkpoint directory, absolute: config.json, weights (every shard's header, against the index)
    and a tokenizer. Raises ServeError before launch."""
    model_dir = file_io.absolute_path(model_dir, "model directory")
    if model_dir.exists() and not model_dir.is_dir():
        raise ServeError(f"{model_dir} is a file; model_dir takes the checkpoint directory (config.json, the "
                         f"*.safetensors shards and the tokenizer).", params=("model_dir",))
    if not model_dir.is_dir():
        raise ServeError(f"Model directory {model_dir} does not exist (merge the adapter "
                         f"into a checkpoint there first, or pass the directory of a Hugging Face checkpoint).")
    missing = []
    if not (model_dir / "config.json").is_file():
        missing.append("config.json")
    if not any(model_dir.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        missing.append("a tokenizer (tokenizer.json or tokenizer.model)")
    if missing:
        raise ServeError(f"{model_dir} is not a servable checkpoint: missing {', '.join(missing)}. vLLM needs the "
                         f"config, the weights and the tokenizer in one directory (the merge step copies the "
                         f"tokenizer).")
    try:
        checkpoint_layout(model_dir)  # a truncated or foreign shard: one line now, not vLLM's traceback later
    except CheckpointError as e:
        raise ServeError(str(e)) from e
    return model_dir


def route(target: ServeTarget) -> str:
    """How ``target``'s server is started: "cpu" (vLLM's CPU build, here), "pip" (vllm-tpu's ``vllm serve`` on this
    machine's TPU; ``spec.docker`` False) or "docker" (the vllm/vllm-tpu image, a command to run on the TPU VM)."""
    if target.platform == "cpu":
        return "cpu"
    return "docker" if target.spec.docker else "pip"


def runs_here(target: ServeTarget) -> bool:
    """True when the server of ``target`` runs on this machine (the cpu and pip routes)."""
    return route(target) != "docker"


def is_multimodal_layout(model_dir: str | os.PathLike) -> bool:
    """True for a ``Gemma4ForConditionalGeneration`` config (a ``text_config`` inside), as google/gemma-4-31B-it."""
    return "text_config" in json.loads((Path(model_dir) / "config.json").read_text())


def _lora_args(target: ServeTarget, lora_modules: dict[str, str | os.PathLike] | None) -> list[str]:
    if not lora_modules:
        return []
    mods = [f"{name}={path}" for name, path in lora_modules.items()]
    return ["--enable-lora", "--lora-modules", *mods, "--max-lora-rank", str(target.max_lora_rank)]


def _engine_args(target: ServeTarget, port: int, host: str, served_name: str, text_only: bool) -> list[str]:
    s = target.spec
    args = [
        "--served-model-name", served_name,
        "--host", host,
        "--port", str(port),
        "--dtype", target.dtype,
        "--tensor-parallel-size", str(s.tensor_parallel),
        "--max-model-len", str(s.max_model_len),
        "--max-num-batched-tokens", str(s.max_num_batched_tokens),
        "--gpu-memory-utilization", str(s.gpu_memory_utilization),
    ]
    if s.max_num_seqs is not None:
        args += ["--max-num-seqs", str(s.max_num_seqs)]
    if s.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", s.kv_cache_dtype]
    if s.disable_chunked_mm_input:
        args += ["--disable-chunked-mm-input"]
    if s.enforce_eager:
        args += ["--enforce-eager"]
    if text_only:
        args += ["--hf-overrides", json.dumps(TEXT_ONLY_OVERRIDES)]
    return args


def serve_command(target: ServeTarget, model_dir: str | os.PathLike, port: int = DEFAULT_PORT,
            api_key: str | None = None, served_name: str = SERVED_NAME,
            lora_modules: dict[str, str | os.PathLike] | None = None, host: str = HOST) -> list[str]:
    """The exact argv that serves ``model_dir`` on ``target`` by its :func:`route` (docker: the model mounted
    read-only, a persistent XLA compile cache, ``HF_TOKEN`` passed by name); :func:`environment` gives the variables.

    ``api_key`` never goes in the argv (``ps`` would show it): the server reads ``VLLM_API_KEY``. ``lora_modules``
    maps adapter names to PEFT adapter directories. Raises ServeError when ``tensor_parallel`` exceeds one host's
    chips.
    """
    how = route(target)
    if how != "cpu":
        chips = target.chips_per_host
        if target.spec.tensor_parallel > chips:
            where = (f"this runtime has {chips} chip{'s' * (chips > 1)}" if how == "pip" else
                     f"one of its hosts has {chips} chips and this command runs on one host")
            raise ServeError(f"Profile {target.name!r} serves with tensor_parallel={target.spec.tensor_parallel}, "
                             f"but {where}. Lower serve.tensor_parallel to {chips} or fewer (check the fit with "
                             f"vllm_command.hbm_per_chip), or serve the 31B from a v6e-8 profile.")
    hub_id = how != "cpu" and is_hub_id(model_dir)
    if how == "pip":
        model = str(model_dir) if hub_id else str(Path(model_dir).expanduser().resolve())
        argv = [str(Path(target.python).parent / "vllm"), "serve", model]
        argv += _engine_args(target, port, host, served_name, text_only=False)
        argv += _lora_args(target, {k: Path(v).expanduser().resolve() for k, v in (lora_modules or {}).items()})
        return argv
    if how == "docker":
        env_names = [HF_TOKEN_ENV] + ([API_KEY_ENV] if api_key else [])
        argv = ["docker", "run", "--rm", "--privileged", "--net=host", f"--shm-size={DOCKER_SHM_SIZE}",
                "--name", f"vllm-{served_name}"]
        for name in env_names:
            argv += ["-e", name]
        argv += ["-e", f"VLLM_XLA_CACHE_PATH={CONTAINER_CACHE}/xla_cache",
                 "-v", f"{os.path.expanduser(HOST_COMPILE_CACHE)}:{CONTAINER_CACHE}"]
        if hub_id:  # downloaded inside the container (needs HF_TOKEN and the licence accepted); cache kept on the host
            argv += ["-v", f"{os.path.expanduser(HOST_HF_CACHE)}:/root/.cache/huggingface"]
        else:
            argv += ["-v", f"{file_io.absolute_path(model_dir, 'model directory')}:{CONTAINER_MODEL_DIR}:ro"]
        lora_mounts = {}
        for i, (name, path) in enumerate((lora_modules or {}).items()):
            lora_mounts[name] = f"/lora/{i}"
            # docker -v needs an absolute path
            argv += ["-v", f"{file_io.absolute_path(path, 'LoRA adapter directory')}:/lora/{i}:ro"]
        if lora_modules:
            argv += ["-e", "MODEL_IMPL_TYPE=vllm"]
        argv += [target.spec.image, "vllm", "serve", str(model_dir) if hub_id else CONTAINER_MODEL_DIR]
        argv += _engine_args(target, port, host, served_name, text_only=False)
        argv += _lora_args(target, lora_mounts)
        return argv
    model_dir = Path(model_dir).resolve()
    py = Path(target.python)
    if not py.is_file():
        raise ServeError(f"The python that runs vLLM, {py}, does not exist: set ServeTarget.python to a python that "
                         f"has vLLM 0.32 (vLLM pins its own transformers, so usually a venv of its own).")
    # `python -m ...api_server`: the CPU build's `vllm` CLI looks for a distribution named `vllm` and fails
    argv = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv += _engine_args(target, port, host, served_name,
                         text_only=(model_dir / "config.json").is_file() and is_multimodal_layout(model_dir))
    argv += _lora_args(target, {k: Path(v).resolve() for k, v in (lora_modules or {}).items()})
    return argv


def is_hub_id(model) -> bool:
    """``org/name`` that is not a local path (e.g. ``google/gemma-4-31B-it``)."""
    s = str(model)
    return s.count("/") == 1 and not s.startswith((".", "/", "~")) and not Path(s).exists()


def environment(target: ServeTarget, api_key: str | None = None, lora: bool = False) -> dict[str, str]:
    """The variables the server needs besides the argv (added to the caller's environment): the CPU build's KV
    cache size and, on one device, its model runner in the engine process (cpu), the persistent XLA compile cache
    and, with ``lora``, vLLM's own model path (pip), the key."""
    env = {}
    how = route(target)
    if how == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(CPU_KVCACHE_SPACE_GIB)
        if target.spec.tensor_parallel == 1:
            env.update(CPU_ONE_PROCESS_ENGINE)
    if how == "pip":
        env["VLLM_XLA_CACHE_PATH"] = os.path.expanduser(HOST_COMPILE_CACHE)
        if lora:
            env["MODEL_IMPL_TYPE"] = "vllm"
    if api_key:
        env[API_KEY_ENV] = api_key
    return env


def shell_line(target: ServeTarget, model_dir, **kw) -> str:
    """:func:`serve_command` as one shell line, the variables it needs in front (secrets shown as ``$NAME``)."""
    api_key = kw.get("api_key")
    argv = serve_command(target, model_dir, **kw)
    env = environment(target, api_key, lora=bool(kw.get("lora_modules")))
    prefix = " ".join(f"{k}={'$' + k if k == API_KEY_ENV else shlex.quote(v)}" for k, v in env.items()
                      if runs_here(target))
    return (prefix + " " if prefix else "") + shlex.join(argv)


def pip_route_profile(target: ServeTarget) -> ServeTarget:
    """``target`` served by the pip route (vllm-tpu in the serving venv, no Docker). Raises ServeError off TPU."""
    if target.platform != "tpu":
        raise ServeError(f"Profile {target.name!r} is not a TPU profile: vllm-tpu serves on a TPU (a CPU target "
                         f"serves with vLLM's CPU build).")
    return target if route(target) == "pip" else dataclasses.replace(
        target, spec=dataclasses.replace(target.spec, docker=False))


def tpu_pip_instructions(target: ServeTarget, model_dir: str | os.PathLike | None = None, **kw) -> str:
    """Shell lines for the pip route: vllm-tpu from PyPI into the serving venv, then, with ``model_dir``, the exact
    serve line (``kw`` as for :func:`serve_command`)."""
    pip_profile = pip_route_profile(target)
    version, venv = target.spec.pip_version, Path(target.python).parent.parent
    chips = target.chips_per_host
    lines = [
        f"# vllm-tpu {version} from PyPI (a Python 3.12 wheel). It pins tpu-inference {version}, hence jax 0.11.2",
        "# and libtpu 0.0.48, so it gets its own venv, the serving venv: tunix's jax 0.10.2 cannot share it.",
        "pip install -q uv",
        f"uv venv --python 3.12 {venv}",
        f"uv pip install --python {venv}/bin/python vllm-tpu=={version}",
        f"{venv}/bin/python -c 'import jax, vllm; print(vllm.__version__, jax.devices())'  # {chips} TPU "
        f"device{'s' * (chips > 1)}",
        f"export {HF_TOKEN_ENV}=...   # only to download from the Hub; a local merged directory needs no token",
        "# vLLM needs the TPU to itself (libtpu admits one process): start it before anything else runs JAX on the",
        "# chip, or restart the runtime first. The first start compiles for minutes; ~/.cache/vllm_xla keeps it.",
    ]
    if model_dir is None:
        lines.append("# then the same `vllm serve ...` arguments as the docker line, from that venv's bin/vllm.")
    else:
        how = ("from Python, vllm_server.start(target, model_dir) runs this line and waits on /health"
               if pip_profile is target
               else "vllm_server.start(vllm_command.pip_route_profile(target), model_dir) runs it")
        lines += [f"# then serve ({how}):", shell_line(pip_profile, model_dir, **kw)]
    return "\n".join(lines)


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def _heads_per_chip(heads: int, tp: int) -> int:
    """KV heads each chip holds under vLLM's tensor parallelism: a share, or one replicated head when tp > heads."""
    if tp <= heads:
        if heads % tp:
            raise ServeError(f"tensor_parallel={tp} does not divide {heads} KV heads; pick a divisor or a multiple.")
        return heads // tp
    if tp % heads:
        raise ServeError(f"tensor_parallel={tp} is not a multiple of {heads} KV heads, which vLLM needs to replicate "
                         f"them; pick a divisor or a multiple of {heads}.")
    return 1


def hbm_per_chip(target: ServeTarget, text_config: dict, weight_dtype: str | None = None) -> dict:
    """Per-chip HBM when vLLM serves the text model under ``target.spec``: weights (replicated KV heads counted per
    chip) plus the KV cache of one ``max_model_len`` sequence, against ``hbm_gib_per_chip x gpu_memory_utilization``.

    vLLM keeps a V slot on k=v layers too; sliding layers are counted at full length (the bound) and at their window
    (``..._windowed``). The vision tower and compiled programs come out of ``free_gib``. ``weight_dtype``: a what-if.
    """
    s = target.spec
    if target.hbm_gib_per_chip is None:
        raise ServeError(f"Profile {target.name!r} has no HBM figure (hbm_gib_per_chip): it is not a TPU "
                         f"profile. Use a TPU profile such as 'v6e-8'.")
    c = text_config
    shared = kv_shared_layers(c)  # E2B/E4B: these layers read an earlier layer's cache and keep none
    tp = s.tensor_parallel
    w_bytes = _DTYPE_BYTES[weight_dtype or target.dtype]
    kv_bytes = _DTYPE_BYTES[target.dtype if s.kv_cache_dtype == "auto" else s.kv_cache_dtype]
    d, window, n = c["hidden_size"], c["sliding_window"], s.max_model_len
    params = param_count(c)
    kv_proj, kv_proj_per_chip, per_token, per_token_windowed = 0, 0.0, 0, 0
    for i, kind in enumerate(layer_kinds(c)):
        heads, head_dim = attn_dims(c, kind)
        per_chip = _heads_per_chip(heads, tp)
        proj = (1 if kind == "global" and c.get("attention_k_eq_v") else 2) * d * heads * head_dim
        kv_proj += proj
        kv_proj_per_chip += proj * per_chip / heads
        token = 0 if i in shared else 2 * per_chip * head_dim * kv_bytes  # K and V
        per_token += token
        per_token_windowed += token * (min(window, n) / n if kind != "global" else 1)
    weights = ((params - kv_proj) / tp + kv_proj_per_chip) * w_bytes
    budget = target.hbm_gib_per_chip * GIB * s.gpu_memory_utilization
    kv_seq, kv_seq_windowed = per_token * n, per_token_windowed * n
    free = budget - weights
    return {
        "profile": target.name, "chips": tp, "params": params, "max_model_len": n,
        "weights_gib": weights / GIB,
        "kv_bytes_per_token": per_token,
        "kv_gib_per_sequence": kv_seq / GIB,
        "kv_gib_per_sequence_windowed": kv_seq_windowed / GIB,
        "budget_gib": budget / GIB,
        "free_gib": free / GIB,
        "full_length_sequences": int(free // kv_seq),
        "full_length_sequences_windowed": int(free // kv_seq_windowed),
        "fits": free >= kv_seq,
    }
