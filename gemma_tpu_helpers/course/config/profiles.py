"""Every hyperparameter and hardware preset of the course, in one place.

A profile is picked by name (``smoke``, ``v5p-8``, ``v6e-8``) or by the ``GEMMA_TPU_PROFILE`` environment
variable. ``smoke`` is the default when no TPU is visible: a tiny random Gemma 4 on 8 virtual CPU devices that
walks the same code paths as the real 31B.

This module must not import JAX: :func:`configure_jax` sets ``XLA_FLAGS`` and has to run before JAX is imported.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path

from ...fixes.core import file_io
from ...fixes.core.process_groups import tpu_device_files, tpu_holders, tpu_visible  # noqa: F401  (profiles.tpu_*)
from ...fixes.model import mesh as mesh_lib
from ...fixes.serve import vllm_command
from ...fixes.serve.vllm_command import ServeSpec
from ...fixes.train.data import DataSpec
from ...fixes.train.lora import EXPERT_TARGETS, LoraSpec
from ...fixes.train.multihost import cpu_xla_flags
from ...fixes.train.sft import TrainSpec
from . import paths

ENV_VAR = paths.PROFILE_ENV

# First contact (hub.py, preflight.py). huggingface_hub sets no timeout of its own: a network that drops packets
# would hang the first metadata request for minutes.
HUB_TIMEOUT_S = 30
# Download sizes to plan disk with when the Hub cannot be asked (pre-flight offline); the Hub's metadata wins when it
# answers. bf16 text weights plus the vision tower, rounded up.
DOWNLOAD_BYTES_FALLBACK = {"google/gemma-4-31B-it": 63 * 10**9, "google/gemma-4-26B-A4B-it": 52 * 10**9}
PREFLIGHT_PROBE_TIMEOUT_S = 20  # the TPU VM's metadata server and `tpu-info`, asked only where a TPU is visible
PYTHON_MIN = (3, 11)  # what the pinned stack (requirements*.txt) is built and tested for

# The paper's GPU baseline and the TPU list prices it compared against (USD per hour, on-demand, us-central1).
PRICES_DATE = "2026-05"
PRICES_USD_PER_HOUR = {"v5p-8": 16.80, "v6e-8": 21.52, "2xH100": 22.12,
                       "v5p-16": 33.60,  # v5p-16: 8 chips at the v5p-8's per-chip rate
                       "v6e-4": 10.76}  # v6e-4: 4 chips at the v6e-8's per-chip rate


# Per-chip peaks for the roofline (predictions.predict_run): dense bf16 FLOP/s and HBM bytes/s (Google's TPU specs).
CHIP_PEAK_BF16_FLOPS = {"v5p": 459e12, "v6e": 918e12, "v5e": 197e12}
CHIP_HBM_BYTES_PER_S = {"v5p": 2765e9, "v6e": 1640e9, "v5e": 819e9}
# What XLA may allocate per chip, GiB (the "available HBM" of libtpu's compile-time OOM, below the nominal HBM): a plan
# fits only under it. tests/fast/test_plan.py asks libtpu for it again.
CHIP_HBM_USABLE_GIB = {"v5p": 95.73, "v6e": 31.24, "v5e": 15.75}
CHIP_HBM_GIB = {"v5p": 95.0, "v6e": 32.0, "v5e": 16.0}  # nominal, per chip


@dataclasses.dataclass(frozen=True)
class Hardware:
    platform: str  # "cpu" or "tpu"
    num_devices: int  # devices JAX sees (virtual CPU devices in smoke)
    mesh: tuple[tuple[str, int], ...]  # axis name -> size, in order
    tpu_topology: str | None = None  # for jax.experimental.topologies (AOT plans)
    chip: str | None = None
    hbm_gib_per_chip: float | None = None
    price_usd_per_hour: float | None = None
    hosts: int = 1  # TPU VM workers; each holds num_devices / hosts chips
    peak_bf16_flops_per_chip: float | None = None  # CHIP_PEAK_BF16_FLOPS[chip]
    hbm_bytes_per_s_per_chip: float | None = None  # CHIP_HBM_BYTES_PER_S[chip]
    accelerator_type: str | None = None  # Cloud's name for the slice when the profile's name is not it (v5litepod-1)

    @property
    def hbm_usable_gib_per_chip(self) -> float | None:
        """What XLA may allocate of a chip's HBM (CHIP_HBM_USABLE_GIB), else the chip's nominal HBM."""
        return CHIP_HBM_USABLE_GIB.get(self.chip, self.hbm_gib_per_chip)


def tpu_slice(chip: str, fsdp: int, tp: int, topology: str, price: str | None = None, hosts: int = 1,
              accelerator_type: str | None = None) -> Hardware:
    """A TPU slice of ``fsdp`` x ``tp`` chips on ``hosts`` hosts; the chip's HBM, peak and bandwidth from the
    tables above; ``price``: its key in PRICES_USD_PER_HOUR (None: not sold by the hour, e.g. Colab)."""
    return Hardware(platform="tpu", num_devices=fsdp * tp, mesh=(("fsdp", fsdp), ("tp", tp)), tpu_topology=topology,
                    chip=chip, hbm_gib_per_chip=CHIP_HBM_GIB[chip], hosts=hosts,
                    price_usd_per_hour=PRICES_USD_PER_HOUR[price] if price else None,
                    peak_bf16_flops_per_chip=CHIP_PEAK_BF16_FLOPS[chip],
                    hbm_bytes_per_s_per_chip=CHIP_HBM_BYTES_PER_S[chip], accelerator_type=accelerator_type)


def virtual_cpu(fsdp: int, tp: int) -> Hardware:
    """``fsdp`` x ``tp`` virtual CPU devices (XLA_FLAGS, set by configure_jax): the smoke profiles."""
    return Hardware(platform="cpu", num_devices=fsdp * tp, mesh=(("fsdp", fsdp), ("tp", tp)))


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    # "tiny" builds the tiny random Gemma 4 (tiny.py) into runs/<profile>/base; otherwise a Hugging Face id.
    source: str
    dtype: str  # param and compute dtype in JAX
    tiny_layers: int = 6
    tiny_seed: int = 0
    tiny_variant: str = "31b"  # which real model the tiny replica copies: "31b", "26b-a4b", "e2b", "e4b" (tiny.py)


@dataclasses.dataclass(frozen=True)
class LearnSpec:
    """The learning check's settings (``course/training/learning_check.py``): the LoRA trained on ``tasks`` eval
    problems (the shortest references), each optimizer step one pass over them, then merged, served and scored
    greedily."""

    tasks: int  # K: the problems trained on and scored
    held_out: int  # the next shortest problems: scored, never trained on
    steps: int
    learning_rate: float  # peak of a cosine decay from the first step (no warmup)
    rank: int
    alpha: int
    max_tokens: int  # per greedy answer


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    description: str
    hardware: Hardware
    model: ModelSpec
    lora: LoraSpec
    train: TrainSpec
    data: DataSpec
    serve: ServeSpec
    learn: LearnSpec | None = None  # the learning check (smoke profiles): a fine-tune that visibly works on a CPU
    # the profile whose slice serves this one's merged model, when its own chips cannot hold it (the 26B trained
    # on one chip with QLoRA is served in bf16 on a v6e-4); None: served where it trains
    serve_on: str | None = None

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.hardware.mesh)

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.hardware.mesh)

    def make_mesh(self, devices=None):
        """The profile's mesh (``mesh.make_mesh``); on a TPU with another chip count, the profiles that fit it."""
        import jax

        devices = list(devices if devices is not None else jax.devices())
        size = math.prod(self.mesh_shape)
        if size != len(devices) and jax.process_count() == 1 and devices[0].platform == "tpu":
            fits = [p.name for p in PROFILES.values()
                    if p.hardware.platform == "tpu" and p.hardware.num_devices == len(devices)]
            raise mesh_lib.MeshError(
                f"Profile {self.name!r} needs {size} TPU chips but this runtime has {len(devices)} "
                f"({devices[0].device_kind}). "
                + (f"Use a profile made for {len(devices)} chip(s): {', '.join(fits)} (GEMMA_TPU_PROFILE or --profile)"
                   + (" - a Colab TPU has one chip and trains Gemma 4 E2B / E4B there." if len(devices) == 1 else ".")
                   if fits else f"No profile here has {len(devices)} chips: pick a slice with {size}."))
        return mesh_lib.make_mesh(self.mesh_shape, self.mesh_axes, devices=devices)

    @property
    def serving(self) -> vllm_command.ServeTarget:
        """What ``fixes/serve.py`` reads of this profile: its ServeSpec, chips, dtype, LoRA rank, HBM and log dir
        (``serve_on``'s slice, when that profile serves this one's model)."""
        hw = PROFILES[self.serve_on].hardware if self.serve_on else self.hardware
        return vllm_command.ServeTarget(name=self.name, platform=hw.platform, chips=hw.num_devices, spec=self.serve,
                                 dtype=self.model.dtype, hosts=hw.hosts, max_lora_rank=self.lora.rank,
                                 hbm_gib_per_chip=hw.hbm_gib_per_chip, log_dir=self.local_dir() / "serve",
                                 python=paths.serve_python())

    def run_dir(self, root: str | os.PathLike | None = None) -> Path:
        """``runs/<profile>/`` under ``root`` (default: $GEMMA_TPU_RUNS, else ``runs/`` in the course checkout),
        absolute. A ``gs://`` root gives an ``etils.epath.Path``: training keeps its checkpoints, metrics and
        ``done.json`` there; local files (the base, the merged model) go to :meth:`local_dir`."""
        root = root or paths.runs_root()
        root = file_io.absolute_path(root, "runs root", remote=True)  # relative: to the current directory, once
        if root.exists() and not root.is_dir():
            raise file_io.PathArgumentError(f"the runs root {root} is a file; give a directory (--runs, "
                                          f"$GEMMA_TPU_RUNS): run directories go under it as <root>/<profile>.")
        return root / self.name

    def local_dir(self, run_dir: str | os.PathLike | None = None) -> Path:
        """Where this profile's local files go (the base checkpoint, the merged model, logs): the run directory
        itself, or ``runs/<profile>/`` in the course checkout when the run directory is on ``gs://``."""
        if isinstance(run_dir, Run):
            return run_dir.local
        run_dir = run_dir or self.run_dir()
        if file_io.is_remote(run_dir):
            return self.run_dir(paths.default_runs_root())
        return file_io.absolute_path(run_dir, "run directory")


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of a profile, resolved once (:func:`resolve_run`) where a command or a notebook starts and passed
    down: ``dir`` holds the checkpoints, metrics and ``done.json`` (absolute; a ``gs://`` one stays remote),
    ``local`` the base, the merged model and the logs (``dir`` itself, or ``runs/<profile>/`` in the course checkout
    when ``dir`` is on ``gs://``)."""

    profile: Profile
    dir: Path
    local: Path

    @property
    def checkpoints(self) -> Path:
        return self.dir / "checkpoints"


def resolve_run(profile: Profile, run_dir: str | os.PathLike | Run | None = None) -> Run:
    """``run_dir`` (default: the profile's, under the runs root) as a :class:`Run`; a Run is returned as it is."""
    if isinstance(run_dir, Run):
        return run_dir
    run_dir = file_io.absolute_path(run_dir or profile.run_dir(), "run directory", remote=True)
    if run_dir.exists() and not run_dir.is_dir():
        raise file_io.PathArgumentError(f"{run_dir} is a file; --run-dir takes a directory (checkpoints, metrics "
                                        f"and the base go under it).")
    return Run(profile, run_dir, profile.local_dir(run_dir))


_PAPER_LORA = LoraSpec(rank=64, alpha=64, dropout=0.05)
_PAPER_TRAIN = TrainSpec(
    learning_rate=1e-4,
    warmup_steps=100,
    schedule="cosine",
    weight_decay=0.001,
    micro_batch=1,
    grad_accum=8,
    max_seq_len=3072,
    epochs=1,
    max_steps=None,
    eval_every=200,
    checkpoint_every=200,
    keep_checkpoints=3,
    remat="block",
)
# The real CodeV-R1 SFT rows, as the paper trained on them: the first 10,000, the <answer>'s fenced Verilog only, and no
# system turn (the rows' R1-style system prompt asks for <think>/<answer> tags that this target strips).
_REAL_DATA = DataSpec(
    source="zhuyaoyu/CodeV-R1-dataset",
    config="sft",
    max_rows=10_000,
    target="verilog",
    system="none",
)
# The merged 31B on a v6e-8: TP8, bf16 weights and KV cache, as vLLM-TPU's Gemma 4 recipe and tpu-inference's CI serve
# it (not fp8: a second, lossy conversion would no longer score the fine-tune itself). Per-chip HBM: hbm_per_chip.
_V6E_SERVE = ServeSpec(
    tensor_parallel=8,
    max_model_len=16384,
    max_num_batched_tokens=4096,
    gpu_memory_utilization=0.90,
    kv_cache_dtype="auto",
    disable_chunked_mm_input=True,
)
# Serving on the training slice (a smoke test of the merged model on the v5p VM): one host's 4 chips, TP4.
_V5P_SERVE = dataclasses.replace(_V6E_SERVE, tensor_parallel=4)
# The 26B-A4B on a v6e-4 (TP4): 8192-token sequences; it also serves what colab-v6e-1-moe trains.
_V6E4_MOE_SERVE = dataclasses.replace(_V5P_SERVE, max_model_len=8192)

# Colab TPU runtimes: one chip, no Docker (vllm-tpu from pip in the serving venv). The sizes are tpu-inference's CI's
# for E2B/E4B on one chip (larger ones ran out of HBM; E4B needs 0.85); 4096 tokens hold a prompt and 2048 new ones.
_COLAB_SERVE = ServeSpec(tensor_parallel=1, max_model_len=4096, max_num_batched_tokens=2048,
                         gpu_memory_utilization=0.85, disable_chunked_mm_input=True, docker=False, max_num_seqs=64)


def _colab(chip: str, model: str, max_seq_len: int, description: str, remat: str = "block") -> "Profile":
    return Profile(
        name=f"colab-{chip}-1",
        description=description,
        hardware=tpu_slice(chip, 1, 1, f"{chip}:1x1", accelerator_type={"v5e": "v5litepod-1"}.get(chip, f"{chip}-1")),
        model=ModelSpec(source=model, dtype="bfloat16"),
        lora=_PAPER_LORA,
        train=dataclasses.replace(_PAPER_TRAIN, max_seq_len=max_seq_len, remat=remat),
        data=_REAL_DATA,
        serve=_COLAB_SERVE,
    )


# The smoke profiles' training, data and serving (smoke-e differs only in its batch layout).
_SMOKE_TRAIN = TrainSpec(
    learning_rate=2e-3,
    warmup_steps=2,
    schedule="cosine",
    weight_decay=0.001,
    micro_batch=4,
    grad_accum=2,
    max_seq_len=512,
    epochs=3,
    max_steps=6,
    eval_every=3,
    checkpoint_every=3,
    keep_checkpoints=2,
    remat="none",
)
# the same call as the real id (config "sft" of the replica); the target keeps the answer's prose
_SMOKE_DATA = DataSpec(source=str(paths.SHIPPED_REPLICA), config=paths.SHIPPED_CONFIG, target="answer", system="none")
# The learning check on the smoke profiles. 20 steps left the loss at 0.20-0.35 and gave 4 of 4 in 2 of 5 seeds
# (3 of 4 in the rest; 2 of 4 on another set); 40 steps take it to 0.034-0.047 and gave 4 of 4 in 15 of 15 runs
# (5 seeds x 3 sets of four short problems: tools/learn_spread.py, README).
_SMOKE_LEARN = LearnSpec(tasks=4, held_out=4, steps=40, learning_rate=6e-3, rank=32, alpha=64, max_tokens=320)
_SMOKE_SERVE = ServeSpec(tensor_parallel=1, max_model_len=1024, max_num_batched_tokens=1024, gpu_memory_utilization=0.1,
                         enforce_eager=True)

# The 26B-A4B's LoRA: the paper's on attention and the dense MLP, and each routed expert its own A and B of rank 8
# (fixes/train/expert_lora.py): the experts hold most of the model, and fine-tuning a mixture of experts is adapting
# them.
_MOE_LORA = dataclasses.replace(_PAPER_LORA, targets=LoraSpec.targets + EXPERT_TARGETS, expert_rank=8)


def _moe(name: str, chip: str, chips: int, topology: str, serve_spec: ServeSpec,
         description: str, remat: str = _PAPER_TRAIN.remat) -> Profile:
    """A 26B-A4B training profile on ``chips`` chips of one host: fsdp x tp=2, the paper's recipe (8 rows/update),
    LoRA on attention and the dense MLP (rank 64) and, by default, on each routed expert (rank 8: ``--no-experts``
    drops them)."""
    return Profile(
        name=name,
        description=description,
        hardware=tpu_slice(chip, chips // 2, 2, topology, price=name.removesuffix("-moe"),
                           accelerator_type=name.removesuffix("-moe")),
        model=ModelSpec(source="google/gemma-4-26B-A4B-it", dtype="bfloat16"),
        lora=_MOE_LORA,
        train=dataclasses.replace(_PAPER_TRAIN, micro_batch=chips // 2, grad_accum=8 // (chips // 2), remat=remat),
        data=_REAL_DATA,
        serve=serve_spec,
    )


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in [
        Profile(
            name="smoke",
            description="Tiny random Gemma 4 with the 31B's structure, 8 virtual CPU devices; "
                        "runs anywhere in minutes.",
            hardware=virtual_cpu(4, 2),
            model=ModelSpec(source="tiny", dtype="float32", tiny_layers=6, tiny_seed=0),
            lora=LoraSpec(rank=8, alpha=16, dropout=0.0),
            train=_SMOKE_TRAIN,
            data=_SMOKE_DATA,
            serve=_SMOKE_SERVE,
            learn=_SMOKE_LEARN,
        ),
        Profile(
            name="smoke-e",
            description="Tiny random Gemma 4 with E2B's structure (per-layer embeddings, KV-shared layers, doubled "
                        "MLP, audio tower), 8 virtual CPU devices; the CPU rehearsal of the Colab profiles.",
            # E2B has one KV head, so tp=1 (as on the real one); fsdp=8 shards hidden_size 256.
            hardware=virtual_cpu(8, 1),
            model=ModelSpec(source="tiny", dtype="float32", tiny_layers=10, tiny_seed=0, tiny_variant="e2b"),
            lora=LoraSpec(rank=8, alpha=16, dropout=0.0),
            train=dataclasses.replace(_SMOKE_TRAIN, micro_batch=8, grad_accum=1),  # one row per fsdp shard
            data=_SMOKE_DATA,
            serve=_SMOKE_SERVE,
            learn=_SMOKE_LEARN,
        ),
        Profile(
            name="smoke-moe",
            description="Tiny random Gemma 4 with the 26B-A4B's structure (router and 8 experts beside the dense MLP, "
                        "2 global KV heads), 8 virtual CPU devices; the CPU rehearsal of the MoE.",
            # 2 global KV heads allow tp <= 2, as on the real 26B; fsdp=4 divides the 8 experts
            hardware=virtual_cpu(4, 2),
            model=ModelSpec(source="tiny", dtype="float32", tiny_layers=6, tiny_seed=0, tiny_variant="26b-a4b"),
            # the routed experts too (fixes/train/expert_lora.py): the point of fine-tuning a mixture of experts
            lora=LoraSpec(rank=8, alpha=16, dropout=0.0, targets=LoraSpec.targets + EXPERT_TARGETS),
            train=_SMOKE_TRAIN,
            data=_SMOKE_DATA,
            serve=_SMOKE_SERVE,
            learn=_SMOKE_LEARN,
        ),
        Profile(
            name="v5p-8",
            description="Gemma 4 31B LoRA training on a TPU v5p-8 (4 chips), the paper's hyperparameters.",
            # tp=8 cannot divide the 31B's 4 global KV heads
            hardware=tpu_slice("v5p", 1, 4, "v5p:2x2x1", price="v5p-8"),
            model=ModelSpec(source="google/gemma-4-31B-it", dtype="bfloat16"),
            lora=_PAPER_LORA,
            train=_PAPER_TRAIN,
            data=_REAL_DATA,
            serve=_V5P_SERVE,
        ),
        Profile(
            name="v5p-16",
            description="The v5p-8 recipe on a v5p-16 (8 chips on 2 hosts, one process each): the smallest multi-host "
                        "slice. Start it on every worker with `python -m gemma_tpu_helpers launch`.",
            # fsdp across the two hosts, tp within each; num_devices counts all hosts' chips (after jax.distributed)
            hardware=tpu_slice("v5p", 2, 4, "v5p:2x2x2", price="v5p-16", hosts=2),
            model=ModelSpec(source="google/gemma-4-31B-it", dtype="bfloat16"),
            lora=_PAPER_LORA,
            # the same 8 rows per optimizer update as v5p-8: 2 rows per micro-step (one per fsdp shard) x 4
            train=dataclasses.replace(_PAPER_TRAIN, micro_batch=2, grad_accum=4),
            data=_REAL_DATA,
            serve=_V5P_SERVE,
        ),
        # seq 3072 does not fit a v5e chip; at 2048 DECODER remat leaves the most HBM spare (notebook 04's AOT table).
        _colab("v5e", "google/gemma-4-E2B-it", 2048,
               "Gemma 4 E2B LoRA training on a Colab TPU v5e-1 (one chip, 16 GiB), the paper's recipe at seq 2048 "
               "with DECODER remat.", remat="decoder"),
        _colab("v6e", "google/gemma-4-E4B-it", 3072,
               "Gemma 4 E4B LoRA training on a Colab TPU v6e-1 (one chip, 32 GiB), the paper's recipe."),
        # Gemma 4 26B-A4B (MoE): its 2 global KV heads allow tp <= 2. A v6e-4 is the smallest one-host v6e slice that
        # holds its bf16 weights; qwix's QLoRA alone leaves the experts bf16 (param_memory.one_chip_moe): see
        # colab-v6e-1-moe.
        _moe("v5p-8-moe", "v5p", 4, "v5p:2x2x1", _V5P_SERVE,
             "Gemma 4 26B-A4B (MoE) LoRA training on a TPU v5p-8 (4 chips, fsdp=2 x tp=2), the paper's recipe, LoRA "
             "on the routed experts too."),
        # BLOCK remat does not fit a v6e chip here (AOT plan); DECODER does, the experts' LoRA included (rank 8):
        # 18.40 GiB a chip compiled (docs/moe-experts.md: 32.29 before expert_lora's backward and grouped matmul)
        _moe("v6e-4-moe", "v6e", 4, "v6e:2x2", _V6E4_MOE_SERVE,
             "Gemma 4 26B-A4B (MoE) LoRA training and serving on a TPU v6e-4 (4 chips, fsdp=2 x tp=2), the paper's "
             "recipe under DECODER remat, LoRA on the routed experts too: the smallest v6e slice that holds the "
             "model.", remat="decoder"),
        # The 26B on one chip: QLoRA with nf4 experts too (fixes/expert_lora.quantize_experts), LoRA on attention,
        # the dense MLP and each routed expert (rank 8 per expert), seq 3072: its compiled step fits (AOT plan,
        # docs/moe-experts.md). Serving the merged bf16 model needs a v6e-4.
        dataclasses.replace(
            _colab("v6e", "google/gemma-4-26B-A4B-it", 3072,
                   "Gemma 4 26B-A4B (MoE) QLoRA on a Colab TPU v6e-1 (one chip, 32 GiB): nf4 weights, the experts "
                   "included, LoRA on attention, the dense MLP and each routed expert, DECODER remat; serve on a "
                   "v6e-4.", remat="decoder"),
            name="colab-v6e-1-moe",
            lora=dataclasses.replace(_MOE_LORA, qlora="nf4"),
            serve=_V6E4_MOE_SERVE, serve_on="v6e-4-moe"),
        Profile(
            name="v6e-8",
            description="Serving the merged 31B with vLLM-TPU on a v6e-8 (8 chips, TP8, bf16, "
                        "as the Gemma 4 TPU recipe).",
            hardware=tpu_slice("v6e", 2, 4, "v6e:2x4", price="v6e-8"),
            model=ModelSpec(source="google/gemma-4-31B-it", dtype="bfloat16"),
            lora=_PAPER_LORA,
            train=_PAPER_TRAIN,
            data=_REAL_DATA,
            serve=_V6E_SERVE,
        ),
    ]
}


def default_profile_name() -> str:
    name = paths.setting(ENV_VAR)
    if name:
        return name
    if not tpu_visible():
        return "smoke"
    accel = paths.setting(paths.ACCELERATOR_ENV) or ""
    if accel in PROFILES:
        return accel
    named = [p.name for p in PROFILES.values() if accel and p.hardware.accelerator_type == accel]
    if len(named) > 1:  # a Colab v6e runtime: E4B (colab-v6e-1); the 26B's one-chip profile is asked for by name
        named = [n for n in named if not n.endswith("-moe")]
    if len(named) == 1:  # Cloud's name for the slice, e.g. v5litepod-1 (a Colab v5e runtime) -> colab-v5e-1
        return named[0]
    raise ValueError(
        f"A TPU is visible but {ENV_VAR} is not set. Set it to one of: {', '.join(PROFILES)} "
        f"(e.g. `export {ENV_VAR}=v5p-8`; in a notebook, `PROFILE = \"colab-v5e-1\"` in its first cell)."
    )


def get_profile(name: str | None = None) -> Profile:
    """The named profile, or the one chosen by $GEMMA_TPU_PROFILE (default ``smoke`` without a TPU)."""
    name = name or default_profile_name()
    try:
        profile = PROFILES[name]
    except KeyError:
        raise ValueError(f"Unknown profile {name!r}. Valid profiles: {', '.join(PROFILES)}.") from None
    return dataclasses.replace(profile, data=dataclasses.replace(profile.data, cache_dir=str(paths.gs_copies())))


def configure_jax(profile: Profile | str | None = None) -> Profile:
    """Set the environment JAX reads at import time; call it before the first ``import jax``.

    For a CPU profile this asks XLA for the profile's number of virtual devices and pins JAX to the CPU, so
    a machine with libtpu installed (it is, for AOT plans) does not probe for a TPU.
    """
    profile = profile if isinstance(profile, Profile) else get_profile(profile)
    if profile.hardware.platform == "cpu":
        flag = f"--xla_force_host_platform_device_count={profile.hardware.num_devices}"
        wanted = cpu_xla_flags(profile.hardware.num_devices, paths.setting("XLA_FLAGS") or "")
        if "jax" in sys.modules and paths.setting("XLA_FLAGS") != wanted:
            import jax  # already imported: only check

            if jax.device_count() != profile.hardware.num_devices:
                raise RuntimeError(
                    f"JAX was imported before configure_jax() and sees {jax.device_count()} devices, but profile "
                    f"{profile.name!r} needs {profile.hardware.num_devices}. Restart the kernel and run the "
                    f"parameters cell first (or set XLA_FLAGS='{flag}' before importing JAX)."
                )
        paths.set_settings({"XLA_FLAGS": wanted})
        paths.set_settings({"JAX_PLATFORMS": "cpu"}, keep=True)
    return profile


def as_dict(profile: Profile) -> dict:
    return dataclasses.asdict(profile)


# The paper's GPU baseline (PyTorch + TRL SFTTrainer + FSDP on 2xH100) as its report states it; the per-device batch
# and accumulation are not stated: 1 x 4 on 2 GPUs gives its effective batch of 8.
GPU_RECIPE = {
    "platform": "2xH100",
    "world_size": 2,
    "per_device_batch": 1,
    "grad_accum": 4,
    "max_seq_len": 4096,
    "packing": False,
    "loss_on": "full sequence",
    "learning_rate": 1e-4,
    "schedule": "cosine",
    "warmup_steps": 100,
    "weight_decay": 0.001,
    "lora_rank": 64,
    "lora_alpha": 64,
    "lora_dropout": 0.05,
    "lora_targets": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "dtype": "bfloat16",
}
