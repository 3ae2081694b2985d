"""How much memory a profile's train step takes per chip, asked of XLA: :func:`aot_plan` AOT-compiles the train step
for the profile's TPU topology on this host (libtpu, abstract params, no TPU needed) and reads XLA's per-chip memory
and cost analysis; it compiles 6 and 12 layers and extrapolates linearly (``layers=60``: the whole model, minutes).
:func:`course_plans` gives the course's settings: cached, compiled, or the points shipped with the course. Counted
from the config instead: :mod:`param_memory`; hours and dollars: :mod:`predictions`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import time
from pathlib import Path

from ...fixes.core.errors import GemmaTpuError
from ...fixes.core.file_io import write_atomic
from ...fixes.model import layout
from ...fixes.model import mesh as mesh_lib
from ...fixes.model.hf_checkpoint import PATTERN
from ...fixes.train import remat as remat_lib
from ...fixes.train import step
from ..config import base_model, paths, profiles
from ..config.profiles import Profile
from .param_memory import GIB

FIT_LAYERS = (6, 12)  # one and two sliding/global periods
_FIGURES = ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "peak_bytes")
_COSTS = ("flops", "bytes_accessed")  # XLA's cost analysis, linear in the layers too (they are unrolled)


class PlanError(GemmaTpuError, ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class AotPlan:
    """XLA's memory for one setting of the train step, per chip (``*_bytes``), against the chip's HBM: compiled at
    ``layers`` or extrapolated there from the compiled ``points`` (``method`` says which; ``fit``: each figure's
    fixed and per-layer part, when extrapolated). ``hbm_oom``: XLA stopped for lack of HBM, so ``peak_bytes``
    (arguments + temporaries) is a lower bound and the output and alias figures are unknown (None)."""

    profile: str
    topology: str
    chip: str
    mesh: dict
    model: str
    remat: str
    seq_len: int
    batch: int
    lora_rank: int
    qlora: str | None  # "nf4": the QLoRA step
    expert_rank: int | None  # each routed expert's LoRA rank (an MoE), else None
    layers: int
    model_layers: int
    method: str
    points: list[dict]  # compile_train_step's figures at each compiled depth (as data/aot_points.json ships them)
    argument_bytes: int
    temp_bytes: int
    output_bytes: int | None
    alias_bytes: int | None
    peak_bytes: int
    hbm_bytes: int
    hbm_usable_bytes: int  # what XLA may allocate of it (profiles.Hardware.hbm_usable_gib_per_chip)
    spare_bytes: int | None
    fits: bool
    hbm_oom: bool
    compile_s_total: float
    flops: float | None = None  # XLA's cost analysis of one micro-step, per chip (None: compiled before it was kept)
    bytes_accessed: float | None = None
    optimal_seconds: float | None = None
    fit: dict = dataclasses.field(default_factory=dict)  # {figure: {"fixed": bytes, "per_layer": bytes}}
    source: str = ""  # course_plans: the shipped reference, a cached compile, or compiled now

    @classmethod
    def from_json(cls, data: dict) -> AotPlan:
        """A plan as :func:`cached_aot_plan` stores it; one cached before this class (flat ``<figure>_fixed`` and
        ``<figure>_per_layer`` keys, no usable-HBM figure) reads too."""
        fit = data.get("fit") or {k: {"fixed": data[f"{k}_fixed"], "per_layer": data[f"{k}_per_layer"]}
                                  for k in (*_FIGURES, *_COSTS) if f"{k}_per_layer" in data}
        names = {f.name for f in dataclasses.fields(cls)}
        values = {"hbm_usable_bytes": data["hbm_bytes"], "hbm_oom": False, "expert_rank": None, "qlora": None,
                  "model": "google/gemma-4-31B-it", "model_layers": data["layers"], **data, "fit": fit}
        values.setdefault("spare_bytes", None if values["hbm_oom"] else
                          values["hbm_usable_bytes"] - values["peak_bytes"])
        return cls(**{k: v for k, v in values.items() if k in names})


def require_libtpu() -> None:
    if importlib.util.find_spec("libtpu") is None:
        raise PlanError("The AOT plan compiles for a TPU topology and needs libtpu on this host (no TPU required): "
                        "`pip install libtpu` (or `pip install -r requirements-tpu.txt`).")


def topology_mesh(profile: Profile):
    """A mesh of abstract (compile-only) TPU devices for the profile's topology, with its mesh axes."""
    require_libtpu()
    if not profile.hardware.tpu_topology:
        raise PlanError(f"Profile {profile.name!r} has no TPU topology; use a TPU profile such as v5p-8 or v6e-8.")
    # quiets libtpu's metadata probing
    paths.set_settings({paths.ACCELERATOR_ENV: profile.hardware.accelerator_type or profile.name,
                        "TPU_WORKER_HOSTNAMES": "localhost"}, keep=True)
    if not profiles.tpu_visible():  # compile-only: let a second process (a test, a notebook) load libtpu too
        paths.set_settings({"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}, keep=True)
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="tpu", topology_name=profile.hardware.tpu_topology)
    return mesh_lib.make_mesh(profile.mesh_shape, profile.mesh_axes, devices=topo.devices)


def with_layers(text_config: dict, layers: int) -> dict:
    """The config with ``layers`` decoder layers (the sliding/global pattern repeated), same per-layer shapes."""
    if layers <= 0:
        raise PlanError(f"layers must be positive, got {layers}.")
    if text_config.get("num_kv_shared_layers"):
        if layers != text_config["num_hidden_layers"]:
            raise PlanError(f"A KV-shared model (E2B/E4B) is compiled at its full depth "
                            f"({text_config['num_hidden_layers']} layers), not {layers}: its last layers read "
                            f"earlier layers' K/V, so a cut model is not the same program per layer.")
        return dict(text_config)
    c = dict(text_config)
    c["num_hidden_layers"] = layers
    c["layer_types"] = (list(PATTERN) * (layers // len(PATTERN) + 1))[:layers]
    return c


# XLA:TPU stops a compile whose temporaries alone exceed the chip's HBM (libtpu 0.0.52's E1000 CompileTimeHbmOom):
# "the total memory required for HLO temporaries (20.71G) exceeds available HBM (15.75G)". Sizes in binary units.
_SIZE = r"\(([\d.]+)\s*([KMGT]?)i?B?\)"
_HBM_OOM = re.compile(rf"HLO temporaries {_SIZE} exceeds available HBM {_SIZE}")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _hbm_oom(error: BaseException) -> tuple[int, int] | None:
    m = _HBM_OOM.search(str(error))
    return None if m is None else (int(float(m.group(1)) * _UNITS[m.group(2)]),
                                   int(float(m.group(3)) * _UNITS[m.group(4)]))


def hbm_oom_temp_bytes(error: BaseException) -> int | None:
    """The temporaries XLA's compile-time HBM OOM says the step needs (as its message rounds them), or None when
    ``error`` is not that OOM."""
    oom = _hbm_oom(error)
    return oom and oom[0]


def probe_usable_hbm_bytes(profile: Profile) -> int:
    """What XLA may allocate on one chip of the profile's topology, asked of libtpu (no TPU needed, about 2 s): a
    program that must hold 256 GiB of temporaries is compiled for one abstract chip, and XLA's compile-time OOM names
    the HBM it had (15.75 GiB of a v5e's 16). ``profiles.CHIP_HBM_USABLE_GIB`` keeps the figures."""
    import jax
    import jax.numpy as jnp

    device = topology_mesh(profile).devices.flat[0]
    x = jax.ShapeDtypeStruct((2**18,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))

    def f(x):  # outer(x, x): 2^36 fp32 = 256 GiB, kept whole by the barrier (XLA would fuse it away otherwise)
        y = jax.lax.optimization_barrier(jnp.outer(x, x))
        return y.sum() + jnp.cos(y).max()

    try:
        jax.jit(f).lower(x).compile()
    except Exception as e:  # noqa: BLE001 - the OOM is the answer; anything else re-raises
        oom = _hbm_oom(e)
        if oom is None:
            raise
        return oom[1]
    raise PlanError(f"A 256 GiB program compiled for {profile.hardware.tpu_topology}: libtpu no longer stops a compile "
                    f"that exceeds HBM, so its usable HBM cannot be read this way.")


def compile_train_step(profile: Profile, remat_policy: str, seq_len: int, layers: int, text_config: dict | None = None,
                       batch: int | None = None, rank: int | None = None, alpha: float | None = None,
                       dtype: str | None = None, qlora: str | None = None) -> dict:
    """AOT-compile the profile's train step (``step.train_step``, sharded as training shards it) with ``layers``
    layers for the profile's topology; XLA's per-chip bytes and costs.

    Unset arguments default to the profile's; ``qlora="nf4"`` compiles the QLoRA step. A compile that XLA stops for
    lack of HBM comes back as a point with ``hbm_oom`` (peak = counted arguments + reported temporaries, a lower
    bound), not as an exception.
    """
    remat_policy = remat_lib.check_policy(remat_policy)
    mesh = topology_mesh(profile)
    text = with_layers(text_config or base_model.profile_text_config(profile), layers)
    batch = batch or profile.train.micro_batch
    lora_spec = dataclasses.replace(profile.lora, **{k: v for k, v in (("rank", rank), ("alpha", alpha),
                                                                       ("qlora", qlora)) if v is not None})
    t0 = time.perf_counter()
    args = step.abstract_arguments(text, mesh, lora_spec, profile.train, batch, seq_len,
                                   dtype=dtype or profile.model.dtype, remat=remat_policy)
    try:
        compiled = step.lower(*args, mesh).compile()
    except Exception as e:  # noqa: BLE001 - only XLA's compile-time HBM OOM is a result; anything else re-raises
        temp = hbm_oom_temp_bytes(e)
        if temp is None:
            raise
        arguments = step.argument_bytes(*args)
        return {"layers": layers, "compile_s": round(time.perf_counter() - t0, 1), "hbm_oom": True,
                "argument_bytes": arguments, "output_bytes": None, "temp_bytes": temp, "alias_bytes": None,
                "peak_bytes": arguments + temp, "qlora": lora_spec.qlora, "expert_rank": expert_rank(lora_spec)}
    seconds = time.perf_counter() - t0
    figures = remat_lib.memory_figures(compiled)
    return {"layers": layers, "compile_s": round(seconds, 1), **{k: figures[k] for k in _FIGURES},
            **cost_figures(compiled), "qlora": lora_spec.qlora, "expert_rank": expert_rank(lora_spec)}


def expert_rank(lora_spec) -> int | None:
    """The rank of each routed expert's LoRA when the spec adapts the experts (an MoE), else None."""
    return (lora_spec.expert_rank or lora_spec.rank) if set(lora_spec.targets) & set(layout.EXPERT_TARGETS) else None


def cost_figures(compiled) -> dict:
    """XLA's cost analysis of a compiled step, per chip (the partitioned program one chip runs): FLOPs, HBM bytes
    accessed, and XLA's own lower bound on the step's seconds."""
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    optimal = float(ca.get("optimal_seconds", 0.0))
    return {"flops": float(ca.get("flops", 0.0)), "bytes_accessed": float(ca.get("bytes accessed", 0.0)),
            "optimal_seconds": optimal if optimal > 0 else None}  # libtpu 0.0.52 gives v6e a negative one


def extrapolate(points: list[dict], layers: int) -> tuple[dict, dict]:
    """Fit ``bytes = fixed + L * per_layer`` through the compiled points (two or more) and evaluate it at
    ``layers``: ``({"layers": layers, figure: predicted}, {figure: {"fixed": ..., "per_layer": ...}})``."""
    import numpy as np

    ls = np.array([p["layers"] for p in points], dtype=float)
    out, fit = {"layers": layers}, {}
    for k in _FIGURES + tuple(c for c in _COSTS if all(c in p for p in points)):
        ys = np.array([p[k] for p in points], dtype=float)
        per_layer, fixed = np.polyfit(ls, ys, 1)
        out[k] = int(round(fixed + per_layer * layers))
        fit[k] = {"fixed": int(round(fixed)), "per_layer": int(round(per_layer))}
    return out, fit


def aot_plan(profile: Profile | str, remat: str | None = None, seq_len: int | None = None, layers: int | None = None,
             fit_layers: tuple[int, ...] = FIT_LAYERS, text_config: dict | None = None,
             qlora: str | None = None) -> AotPlan:
    """XLA's per-chip memory for the profile's LoRA train step, against the chip's HBM.

    ``layers=None``: compile the ``fit_layers`` variants and extrapolate linearly to the model's depth (60 for the
    31B). ``layers=N``: compile exactly N layers (``N=60`` is the full model: minutes). Batch is the profile's
    micro-batch, ``seq_len`` defaults to the profile's ``max_seq_len``, ``remat`` to ``profile.train.remat``,
    ``qlora`` to the profile's (``"nf4"``: the QLoRA step).
    """
    profile = profile if isinstance(profile, Profile) else profiles.get_profile(profile)
    policy = remat_lib.check_policy(remat or profile.train.remat)
    require_libtpu()
    if profile.hardware.platform != "tpu":
        raise PlanError(f"The AOT plan needs a TPU profile (v5p-8, v6e-8); {profile.name!r} runs on "
                        f"{profile.hardware.platform}.")
    text = text_config or base_model.profile_text_config(profile)
    seq_len = seq_len or profile.train.max_seq_len
    if text.get("num_kv_shared_layers"):  # E2B/E4B: full depth only (see with_layers)
        layers = layers or text["num_hidden_layers"]
    if layers:
        points = [compile_train_step(profile, policy, seq_len, layers, text, qlora=qlora)]
    else:
        points = []
        for n in fit_layers:  # a variant that runs out of HBM ends it: a deeper one needs more
            points.append(compile_train_step(profile, policy, seq_len, n, text, qlora=qlora))
            if points[-1].get("hbm_oom"):
                break
    return assemble_plan(profile, policy, seq_len, points, layers or text["num_hidden_layers"],
                         text["num_hidden_layers"])


def assemble_plan(profile: Profile, policy: str, seq_len: int, points: list[dict], layers: int,
                  model_layers: int = 60) -> AotPlan:
    """An :func:`aot_plan` result from compiled points: the point itself if it has ``layers`` layers, else the
    linear fit through the points evaluated at ``layers``."""
    exact = [p for p in points if p["layers"] == layers]
    oom = [p for p in points if p.get("hbm_oom")]
    fit = {}
    if oom:  # the deepest variant that ran out: a deeper model needs more
        figures = max(oom, key=lambda p: p["layers"])
        method = f"compile stopped at {figures['layers']} layers: HBM OOM"
    elif exact:
        figures, method = exact[0], "compiled"
    else:
        figures, fit = extrapolate(points, layers)
        method = f"extrapolated from {', '.join(str(p['layers']) for p in points)} layers"
    hw = profile.hardware
    hbm, usable = int(hw.hbm_gib_per_chip * GIB), int(hw.hbm_usable_gib_per_chip * GIB)
    return AotPlan(
        profile=profile.name, topology=hw.tpu_topology, chip=hw.chip, mesh=dict(hw.mesh), model=profile.model.source,
        remat=policy, seq_len=seq_len, batch=profile.train.micro_batch, lora_rank=profile.lora.rank,
        qlora=points[0].get("qlora"), expert_rank=points[0].get("expert_rank"), layers=figures["layers"],
        model_layers=model_layers, method=method, points=points,
        **{k: figures[k] for k in _FIGURES}, hbm_bytes=hbm, hbm_usable_bytes=usable,
        spare_bytes=None if oom else usable - figures["peak_bytes"],
        fits=not oom and bool(figures["peak_bytes"] <= usable), hbm_oom=bool(oom),
        compile_s_total=round(sum(p["compile_s"] for p in points), 1),
        **{k: figures.get(k) for k in (*_COSTS, "optimal_seconds")}, fit=fit)


def fit_table(plan: AotPlan):
    """The compiled points of a plan and, when extrapolated, the fitted fixed and per-layer parts (GiB per chip)."""
    import pandas as pd

    rows = [{"what": f"compiled, {p['layers']} layers", "compile s": p["compile_s"],
             **{k.replace("_bytes", " GiB"): None if p.get(k) is None else round(p[k] / GIB, 3) for k in _FIGURES}}
            for p in plan.points]
    if plan.fit:
        for part in ("fixed", "per_layer"):
            rows.append({"what": f"fit: {part.replace('_', ' ')}",
                         **{k.replace("_bytes", " GiB"): round(plan.fit[k][part] / GIB, 3) for k in _FIGURES}})
        rows.append({"what": f"extrapolated, {plan.layers} layers",
                     **{k.replace("_bytes", " GiB"): round(getattr(plan, k) / GIB, 3) for k in _FIGURES}})
    return pd.DataFrame(rows)


def lora_label(plan: AotPlan, rank: bool = False) -> str:
    """"LoRA", or "QLoRA nf4" for a plan of the QLoRA step (``rank``: and its rank), "+ experts r8" when each routed
    expert has its own LoRA (an MoE)."""
    label = (f"QLoRA {plan.qlora}" if plan.qlora else "LoRA") + (f" rank {plan.lora_rank}" * rank)
    return label + (f" + experts r{plan.expert_rank}" if plan.expert_rank else "")


def plan_row(plan: AotPlan) -> dict:
    """One table row (GiB per chip) of an :func:`aot_plan` result."""
    g = lambda k: None if getattr(plan, k) is None else round(getattr(plan, k) / GIB, 2)  # noqa: E731
    return {
        "profile": plan.profile, "remat": plan.remat, "LoRA": lora_label(plan), "seq": plan.seq_len,
        "layers": plan.layers,
        "method": plan.method, "arguments GiB": g("argument_bytes"), "temp GiB": g("temp_bytes"),
        "output GiB": g("output_bytes"), "peak GiB": g("peak_bytes"), "HBM GiB": g("hbm_bytes"),
        "XLA can use GiB": g("hbm_usable_bytes"), "spare GiB": g("spare_bytes"),
        "fits": plan.fits if plan.layers >= plan.model_layers or plan.hbm_oom
        else f"({plan.layers} of {plan.model_layers} layers)",
        "compile s": plan.compile_s_total,
    }


def plan_table(plans: list[AotPlan]):
    import pandas as pd

    return pd.DataFrame([plan_row(p) for p in plans])


def read_cached_plan(path: Path) -> AotPlan:
    """A plan :func:`cached_aot_plan` wrote to ``path``, its ``source`` naming the file."""
    return dataclasses.replace(AotPlan.from_json(json.loads(path.read_text())), source=f"cached ({path})")


def cached_aot_plan(run_dir: str | os.PathLike, profile: Profile | str, remat: str | None = None,
                    seq_len: int | None = None, layers: int | None = None, **kwargs) -> AotPlan:
    """:func:`aot_plan`, cached as JSON in ``run_dir/plan/`` (compile once, reuse on rerun); ``source`` says which."""
    profile = profile if isinstance(profile, Profile) else profiles.get_profile(profile)
    key = plan_key(profile.name, remat or profile.train.remat, seq_len or profile.train.max_seq_len, layers,
                   kwargs.get("qlora") or profile.lora.qlora)
    if kwargs.get("text_config") is not None:
        key += f"_d{kwargs['text_config']['hidden_size']}"
    path = Path(run_dir) / "plan" / f"{key}.json"
    if path.is_file():
        return read_cached_plan(path)
    result = dataclasses.replace(aot_plan(profile, remat, seq_len, layers, **kwargs), source="compiled now")
    write_atomic(path, json.dumps(dataclasses.asdict(result), indent=1, default=str))
    return result


# The course's settings: the three remat policies on the v5p-8, and the v6e-8, at seq 3072.
COURSE_PLANS = (("v5p-8", "block"), ("v5p-8", "none"), ("v5p-8", "decoder"), ("v6e-8", "block"))

# The one-chip Colab profiles (E2B on v5e-1 at seq 2048, E4B on v6e-1 at 3072), each remat policy with LoRA, and
# QLoRA (nf4) under BLOCK: notebook 04's Colab table. E models compile at full depth (no extrapolation).
COLAB_PLANS = (("colab-v5e-1", "none"), ("colab-v5e-1", "block"), ("colab-v5e-1", "decoder"),
               ("colab-v5e-1", "block", "nf4"),
               ("colab-v6e-1", "none"), ("colab-v6e-1", "block"), ("colab-v6e-1", "decoder"),
               ("colab-v6e-1", "block", "nf4"))

# Gemma 4 26B-A4B (MoE) on the 4-chip slices its 2 global KV heads allow (fsdp=2 x tp=2), and QLoRA (nf4 experts) on
# one Colab v6e chip: notebook 04's MoE rows.
MOE_PLANS = (("v5p-8-moe", "block"), ("v6e-4-moe", "block"), ("v6e-4-moe", "decoder"), ("colab-v6e-1-moe", "decoder"))
# the settings the MoE profiles train with, the experts' LoRA included
MOE_PREDICTIONS = (("v5p-8-moe", "block"), ("v6e-4-moe", "decoder"), ("colab-v6e-1-moe", "decoder", "nf4"))

# XLA's compiled points for the course's settings (batch 1, bf16, LoRA rank 64), shown when nothing is compiled
# (how they were measured: docs/design-notes.md). Regenerate: `python -m gemma_tpu_helpers plan --aot ...`.
REFERENCE_NOTE = "measured 2026-11-29 to 12-07 with jax 0.10.2 / libtpu 0.0.52 on a shared 2-core CPU host"
_AOT_POINTS = json.loads((paths.DATA_DIR / "aot_points.json").read_text())
# A setting with a single point (an E model, compiled at full depth) is shown as compiled, not extrapolated.
REFERENCE_POINTS: dict[str, list[dict]] = _AOT_POINTS["reference_points"]
# Independent compiles (18 and 60 layers) that measure the extrapolation's error.
REFERENCE_CHECKS: dict[str, list[dict]] = _AOT_POINTS["reference_checks"]


def plan_key(profile_name: str, policy: str, seq_len: int, layers: int | None, qlora: str | None = None) -> str:
    return f"{profile_name}_{policy}_seq{seq_len}_L{layers or 'fit'}" + (f"_{qlora}" if qlora else "")


def course_plans(run_dir: str | os.PathLike, compute: bool = False, settings=COURSE_PLANS,
                 seq_len: int | None = None, layers: int | None = None) -> list[AotPlan]:
    """The AOT plans of ``settings`` (``(profile, policy)`` or ``(profile, policy, qlora)``; ``seq_len`` default:
    each profile's): from ``run_dir/plan/`` when cached there, compiled (and cached) when ``compute``, else the
    reference figures shipped with the course (``source`` says which)."""
    out = []
    for name, policy, *quant in settings:
        prof = profiles.get_profile(name)
        qlora = quant[0] if quant else prof.lora.qlora
        seq = seq_len or prof.train.max_seq_len
        key = plan_key(name, policy, seq, layers, qlora)
        path = Path(run_dir) / "plan" / f"{key}.json"
        if path.is_file():
            out.append(read_cached_plan(path))
        elif compute:
            out.append(cached_aot_plan(run_dir, prof, policy, seq, layers, qlora=qlora))
        elif key in REFERENCE_POINTS:
            points = REFERENCE_POINTS[key]
            model_layers = base_model.profile_text_config(prof)["num_hidden_layers"]
            depth = layers or (model_layers if len(points) > 1 else points[0]["layers"])
            step = ("the train step" if all(p.get("step") == "train" for p in points) else
                    "the pre-#13 stand-in step (plain AdamW, replicated LoRA; recompile with plan --aot)")
            out.append(dataclasses.replace(assemble_plan(prof, policy, seq, points, depth, model_layers),
                                           source=f"reference ({REFERENCE_NOTE}; {step})"))
    return out


def extrapolation_error(plan: AotPlan, checks: list[dict]):
    """Extrapolated vs compiled bytes (GiB per chip) at the depths of independent compiles ``checks``. A check of
    another step than the plan's points (``step``: "train", or none for the pre-#13 stand-in) is left out: the
    table would measure the change of step, not the fit's error."""
    import pandas as pd

    rows = []
    for c in (c for c in checks if c.get("step") == plan.points[0].get("step")):
        pred, _ = extrapolate(plan.points, c["layers"])
        for k in ("argument_bytes", "temp_bytes", "peak_bytes"):
            rows.append({"layers": c["layers"], "figure": k.replace("_bytes", ""),
                         "extrapolated GiB": round(pred[k] / GIB, 3), "compiled GiB": round(c[k] / GIB, 3),
                         "error %": round(100 * (pred[k] - c[k]) / c[k], 1), "compile s": c["compile_s"]})
    return pd.DataFrame(rows)


def format_plan(plan: AotPlan) -> str:
    g = lambda k: getattr(plan, k) / GIB  # noqa: E731
    usable, spare = plan.hbm_usable_bytes, plan.spare_bytes
    of = f"of the {usable / GIB:.2f} GiB XLA can use ({g('hbm_bytes'):.0f} GiB HBM)"
    lines = [
        f"AOT plan: {plan.profile} ({plan.topology}, mesh {plan.mesh}), {plan.model} "
        f"{lora_label(plan, rank=True)}, bf16",
        f"  remat={plan.remat} batch={plan.batch} seq={plan.seq_len} layers={plan.layers} ({plan.method})",
    ]
    for p in plan.points:
        if p.get("hbm_oom"):
            lines.append(f"  compiled {p['layers']:3d} layers: XLA stopped after {p['compile_s']:.1f} s, out of HBM "
                         f"(temp {p['temp_bytes'] / GIB:.2f} GiB alone exceeds what the chip has)")
            continue
        lines.append(f"  compiled {p['layers']:3d} layers in {p['compile_s']:6.1f} s: arguments "
                     f"{p['argument_bytes'] / GIB:7.2f} GiB, temp {p['temp_bytes'] / GIB:7.2f} GiB, "
                     f"output {p['output_bytes'] / GIB:7.2f} GiB")
    if plan.hbm_oom:
        lines.append(f"  per chip: arguments {g('argument_bytes'):.2f} GiB + temp {g('temp_bytes'):.2f} GiB = at least "
                     f"{g('peak_bytes'):.2f} GiB {of}: DOES NOT FIT. Try remat block or "
                     f"decoder (--remat), a shorter --seq-len, or QLoRA (--qlora nf4).")
        return "\n".join(lines)
    lines.append(f"  per chip: arguments {g('argument_bytes'):.2f} GiB + temp {g('temp_bytes'):.2f} GiB + output "
                 f"{g('output_bytes'):.2f} GiB - aliased {g('alias_bytes'):.2f} GiB = {g('peak_bytes'):.2f} GiB "
                 f"{of}: " + (f"FITS, {spare / GIB:.2f} GiB spare" if plan.fits else
                              f"DOES NOT FIT, {-spare / GIB:.2f} GiB over")
                 + (f" (a {plan.layers}-layer variant of the {plan.model_layers}-layer model)"
                    if plan.layers < plan.model_layers else ""))
    return "\n".join(lines)
