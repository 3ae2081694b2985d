"""How much memory a profile needs per chip, and what its training run costs: counted, then asked of XLA.

:func:`memory_estimate` counts parameters from the HF config (no activations). :func:`aot_plan` AOT-compiles the
train step for the profile's TPU topology on this host (libtpu, abstract params, no TPU needed) and reads XLA's
per-chip memory; it compiles 6 and 12 layers and extrapolates linearly (``layers=60``: the whole model, minutes).
:func:`predict_run` turns a plan's cost analysis into hours and dollars per epoch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import time
from pathlib import Path

from ..fixes import data, layout, step
from ..fixes import mesh as mesh_lib
from ..fixes import remat as remat_lib
from ..fixes.errors import GemmaTpuError
from ..fixes.file_io import write_atomic
from ..fixes.hf_checkpoint import PATTERN, kv_shared_layers, layer_kinds
from ..fixes.model_size import attn_dims, expert_param_count, param_count
from . import base_model, paths, profiles, serving_bench
from .profiles import Profile

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
GIB = 1024**3


def lora_param_count(c: dict, rank: int, targets, expert_rank: int | None = None) -> int:
    """LoRA parameters for HF target names, from the layout table (``layout.lora_param_count``).

    k and v share one ``kv_einsum`` (one A) on local layers; global k=v layers have only ``k_einsum``; the routed
    experts (``experts.gate_up_proj``, ``experts.down_proj``) count at ``expert_rank`` (default ``rank``).
    """
    return layout.lora_param_count(c, rank, targets, expert_rank)


def memory_estimate(profile: Profile, text_config: dict) -> dict:
    """Per-device bytes for frozen params (fully sharded), LoRA params, their grads and AdamW state (replicated)."""
    p = param_count(text_config)
    lora = lora_param_count(text_config, profile.lora.rank, profile.lora.targets, profile.lora.expert_rank)
    nbytes = _DTYPE_BYTES[profile.model.dtype]
    devices = profile.hardware.num_devices
    quantized = quantized_param_count(text_config, profile.lora.targets) if profile.lora.qlora else 0
    base = (p - quantized) * nbytes + quantized * nf4_bytes(nbytes)
    per_device = {
        "base params (sharded)" if not quantized else f"base params (sharded; {quantized / p:.0%} in nf4)":
            base / devices,
        "LoRA params (replicated)": lora * nbytes,
        "LoRA grads (fp32)": lora * 4,
        "AdamW state (fp32, 2x)": lora * 8,
    }
    total = sum(per_device.values())
    return {
        "profile": profile.name,
        "params": p,
        "lora_params": lora,
        "trainable_pct": 100 * lora / p,
        "devices": devices,
        "per_device_bytes": per_device,
        "total_per_device_gib": total / GIB,
        "hbm_gib_per_chip": profile.hardware.hbm_gib_per_chip,
    }


NF4_TILE = 64  # QLoRA's tile on the real Gemma 4 sizes (lora.apply_lora picks the largest <= 256 that divides)


def nf4_bytes(scale_bytes: int = 2, tile: int = NF4_TILE) -> float:
    """Bytes a weight takes in nf4: 4 bits, plus its share of one scale per ``tile`` weights."""
    return 0.5 + scale_bytes / tile


def quantized_param_count(text_config: dict, targets) -> int:
    """The frozen weights QLoRA stores in nf4: every weight a LoRA on ``targets`` adapts, and the routed experts of a
    MoE, targeted or not (``expert_lora.quantize_experts``)."""
    dense = [t for t in targets if t not in layout.EXPERT_TARGETS]
    return (sum(math.prod(s) for s in layout.targeted_weights(text_config, dense).values())
            + expert_param_count(text_config))


def one_chip_moe(text_config: dict, usable_gib: float, tile: int = NF4_TILE):
    """Can an MoE (26B-A4B) train on one chip? Its frozen weights per chip, before activations, three ways (pandas):
    bf16 (LoRA); QLoRA as qwix does it (nf4 on what LoRA targets: attention and the dense MLP; the experts, which
    run through ``ragged_dot``, and the embedding stay bf16); and nf4 experts too (``lora.apply_lora(qlora="nf4")``
    on a MoE: ``expert_lora.quantize_experts``). nf4: 4 bits a weight plus a bf16 scale per ``tile`` weights
    (default: the tile QLoRA picks on the real 26B)."""
    import pandas as pd

    c = text_config
    total = param_count(c)
    embed = c["vocab_size"] * c["hidden_size"]
    experts = expert_param_count(c)
    other = total - embed - experts  # attention, dense MLP, router, norms
    nf4 = nf4_bytes(2, tile)
    rows = [("LoRA, bf16 weights", total * 2),
            ("QLoRA nf4 as qwix does it (experts stay bf16)", (embed + experts) * 2 + other * nf4),
            ("QLoRA with nf4 experts (the course's QLoRA: colab-v6e-1-moe)", embed * 2 + (experts + other) * nf4)]
    return pd.DataFrame([{"setting": name, "weights GiB": round(b / GIB, 1), "XLA can use GiB": usable_gib,
                          "fits before activations": b / GIB < usable_gib} for name, b in rows])


def memory_table(estimate: dict):
    import pandas as pd

    rows = [{"what": k, "GiB per device": v / GIB} for k, v in estimate["per_device_bytes"].items()]
    rows.append({"what": "total (before activations)", "GiB per device": estimate["total_per_device_gib"]})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------- AOT plan

FIT_LAYERS = (6, 12)  # one and two sliding/global periods
_FIGURES = ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "peak_bytes")
_COSTS = ("flops", "bytes_accessed")  # XLA's cost analysis, linear in the layers too (they are unrolled)


class PlanError(GemmaTpuError, ValueError):
    pass


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


def extrapolate(points: list[dict], layers: int) -> dict:
    """Fit ``bytes = fixed + L * per_layer`` through the compiled points (two or more) and evaluate it at
    ``layers``. Returns the predicted figures plus each figure's per-layer and fixed part."""
    import numpy as np

    ls = np.array([p["layers"] for p in points], dtype=float)
    out = {"layers": layers}
    for k in _FIGURES + tuple(c for c in _COSTS if all(c in p for p in points)):
        ys = np.array([p[k] for p in points], dtype=float)
        per_layer, fixed = np.polyfit(ls, ys, 1)
        out[k] = int(round(fixed + per_layer * layers))
        out[f"{k}_per_layer"] = int(round(per_layer))
        out[f"{k}_fixed"] = int(round(fixed))
    return out


def aot_plan(profile: Profile | str, remat: str | None = None, seq_len: int | None = None, layers: int | None = None,
             fit_layers: tuple[int, ...] = FIT_LAYERS, text_config: dict | None = None,
             qlora: str | None = None) -> dict:
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
                  model_layers: int = 60) -> dict:
    """An :func:`aot_plan` result from compiled points: the point itself if it has ``layers`` layers, else the
    linear fit through the points evaluated at ``layers``."""
    exact = [p for p in points if p["layers"] == layers]
    oom = [p for p in points if p.get("hbm_oom")]
    if oom:  # the deepest variant that ran out: a deeper model needs more
        result = dict(max(oom, key=lambda p: p["layers"]))
        method = f"compile stopped at {result['layers']} layers: HBM OOM"
    elif exact:
        result, method = dict(exact[0]), "compiled"
    else:
        result = extrapolate(points, layers)
        method = f"extrapolated from {', '.join(str(p['layers']) for p in points)} layers"
    hbm, usable = profile.hardware.hbm_gib_per_chip * GIB, profile.hardware.hbm_usable_gib_per_chip * GIB
    result.update({
        "profile": profile.name, "topology": profile.hardware.tpu_topology, "chip": profile.hardware.chip,
        "mesh": dict(profile.hardware.mesh), "remat": policy, "seq_len": seq_len,
        "batch": profile.train.micro_batch, "lora_rank": profile.lora.rank, "method": method, "points": points,
        "qlora": points[0].get("qlora"), "expert_rank": points[0].get("expert_rank"), "model": profile.model.source,
        "hbm_bytes": int(hbm), "hbm_usable_bytes": int(usable),
        "spare_bytes": None if oom else int(usable - result["peak_bytes"]),
        "fits": not oom and bool(result["peak_bytes"] <= usable), "model_layers": model_layers,
        "compile_s_total": round(sum(p["compile_s"] for p in points), 1),
    })
    return result


def fit_table(plan: dict):
    """The compiled points of a plan and, when extrapolated, the fitted fixed and per-layer parts (GiB per chip)."""
    import pandas as pd

    rows = [{"what": f"compiled, {p['layers']} layers", "compile s": p["compile_s"],
             **{k.replace("_bytes", " GiB"): None if p.get(k) is None else round(p[k] / GIB, 3) for k in _FIGURES}}
            for p in plan["points"]]
    if f"{_FIGURES[0]}_per_layer" in plan:
        for part in ("fixed", "per_layer"):
            rows.append({"what": f"fit: {part.replace('_', ' ')}",
                         **{k.replace("_bytes", " GiB"): round(plan[f"{k}_{part}"] / GIB, 3) for k in _FIGURES}})
        rows.append({"what": f"extrapolated, {plan['layers']} layers",
                     **{k.replace("_bytes", " GiB"): round(plan[k] / GIB, 3) for k in _FIGURES}})
    return pd.DataFrame(rows)


def lora_label(plan: dict, rank: bool = False) -> str:
    """"LoRA", or "QLoRA nf4" for a plan of the QLoRA step (``rank``: and its rank), "+ experts r8" when each routed
    expert has its own LoRA (an MoE)."""
    label = (f"QLoRA {plan['qlora']}" if plan.get("qlora") else "LoRA") + (f" rank {plan.get('lora_rank')}" * rank)
    return label + (f" + experts r{plan['expert_rank']}" if plan.get("expert_rank") else "")


def plan_row(plan: dict) -> dict:
    """One table row (GiB per chip) of an :func:`aot_plan` result."""
    g = lambda k: None if plan.get(k) is None else round(plan[k] / GIB, 2)  # noqa: E731
    return {
        "profile": plan["profile"], "remat": plan["remat"], "LoRA": lora_label(plan), "seq": plan["seq_len"],
        "layers": plan["layers"],
        "method": plan["method"], "arguments GiB": g("argument_bytes"), "temp GiB": g("temp_bytes"),
        "output GiB": g("output_bytes"), "peak GiB": g("peak_bytes"), "HBM GiB": g("hbm_bytes"),
        "XLA can use GiB": g("hbm_usable_bytes"), "spare GiB": g("spare_bytes"),
        "fits": plan["fits"] if plan["layers"] >= plan.get("model_layers", 60) or plan.get("hbm_oom")
        else f"({plan['layers']} of {plan.get('model_layers', 60)} layers)",
        "compile s": plan["compile_s_total"],
    }


def plan_table(plans: list[dict]):
    import pandas as pd

    return pd.DataFrame([plan_row(p) for p in plans])


def cached_aot_plan(run_dir: str | os.PathLike, profile: Profile | str, remat: str | None = None,
                    seq_len: int | None = None, layers: int | None = None, **kwargs) -> dict:
    """:func:`aot_plan`, cached as JSON in ``run_dir/plan/`` (compile once, reuse on rerun); ``cached`` says which."""
    profile = profile if isinstance(profile, Profile) else profiles.get_profile(profile)
    key = plan_key(profile.name, remat or profile.train.remat, seq_len or profile.train.max_seq_len, layers,
                   kwargs.get("qlora") or profile.lora.qlora)
    if kwargs.get("text_config") is not None:
        key += f"_d{kwargs['text_config']['hidden_size']}"
    path = Path(run_dir) / "plan" / f"{key}.json"
    if path.is_file():
        return {**json.loads(path.read_text()), "cached": True}
    result = aot_plan(profile, remat, seq_len, layers, **kwargs)
    write_atomic(path, json.dumps(result, indent=1, default=str))
    return {**result, "cached": False}


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
                 seq_len: int | None = None, layers: int | None = None) -> list[dict]:
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
            out.append({**json.loads(path.read_text()), "source": f"cached ({path})"})
        elif compute:
            out.append({**cached_aot_plan(run_dir, prof, policy, seq, layers, qlora=qlora), "source": "compiled now"})
        elif key in REFERENCE_POINTS:
            points = REFERENCE_POINTS[key]
            model_layers = base_model.profile_text_config(prof)["num_hidden_layers"]
            depth = layers or (model_layers if len(points) > 1 else points[0]["layers"])
            step = ("the train step" if all(p.get("step") == "train" for p in points) else
                    "the pre-#13 stand-in step (plain AdamW, replicated LoRA; recompile with plan --aot)")
            out.append({**assemble_plan(prof, policy, seq, points, depth, model_layers),
                        "source": f"reference ({REFERENCE_NOTE}; {step})"})
    return out


def extrapolation_error(plan: dict, checks: list[dict]):
    """Extrapolated vs compiled bytes (GiB per chip) at the depths of independent compiles ``checks``. A check of
    another step than the plan's points (``step``: "train", or none for the pre-#13 stand-in) is left out: the
    table would measure the change of step, not the fit's error."""
    import pandas as pd

    rows = []
    for c in (c for c in checks if c.get("step") == plan["points"][0].get("step")):
        pred = extrapolate(plan["points"], c["layers"])
        for k in ("argument_bytes", "temp_bytes", "peak_bytes"):
            rows.append({"layers": c["layers"], "figure": k.replace("_bytes", ""),
                         "extrapolated GiB": round(pred[k] / GIB, 3), "compiled GiB": round(c[k] / GIB, 3),
                         "error %": round(100 * (pred[k] - c[k]) / c[k], 1), "compile s": c["compile_s"]})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------- time and cost

# Rematerialisation recomputes each layer's forward once in the backward pass (tunix BLOCK / DECODER).
_RECOMPUTED_FORWARDS = {"none": 0, "block": 1, "decoder": 1}


def analytic_step_flops(text_config: dict, batch: int, seq_len: int, rank: int, targets, policy: str,
                        expert_rank: int | None = None) -> dict:
    """FLOPs of one LoRA micro-step (all chips together), counted from the config: matmuls only (2 per
    multiply-add), attention dense over the full causal square (the sliding window is a mask in the compiled step),
    the frozen weights' backward through the activations only, LoRA's full backward, and the forward ``policy``
    recomputes. ``model`` = forward + backward (what MFU counts); ``total`` adds the recompute (what the chips run).
    E models' KV-shared layers and per-layer inputs, and an MoE's router and top-k experts, are counted too."""
    t = set(targets)
    c, tokens = text_config, batch * seq_len
    d, n = c["hidden_size"], c["num_attention_heads"]
    pl, shared = c.get("hidden_size_per_layer_input") or 0, kv_shared_layers(c)
    frozen = attention = lora = 0.0
    for i, kind in enumerate(layer_kinds(c)):
        k, h = attn_dims(c, kind)
        kv_out = 0 if i in shared else (1 if kind == "global" and c.get("attention_k_eq_v") else 2) * k * h
        f = c["intermediate_size"] * (2 if i in shared and c.get("use_double_wide_mlp") else 1)
        frozen += 2 * tokens * (2 * d * n * h + d * kv_out + 3 * d * f + 2 * d * pl)
        attention += 2 * 2 * batch * seq_len * seq_len * n * h  # q·kᵀ and p·v
        modules = [(d, n * h, "q_proj"), (n * h, d, "o_proj"), (d, f, "gate_proj"), (d, f, "up_proj"),
                   (f, d, "down_proj")]
        if t & {"k_proj", "v_proj"} and kv_out:
            modules.append((d, kv_out, "kv"))  # k and v share one A (kv_einsum); a k=v layer has k only
        lora += sum(2 * tokens * rank * (i + o) for i, o, name in modules if name in t or name == "kv")
        if c.get("enable_moe_block"):  # the router, and the top-k experts a token runs through (26B-A4B: 8 of 128)
            frozen += 2 * tokens * (d * c["num_experts"] + c["top_k_experts"] * 3 * d * c["moe_intermediate_size"])
            fe = c["moe_intermediate_size"]  # each expert's LoRA, where targeted, on the top-k a token runs through
            lora += sum(2 * tokens * c["top_k_experts"] * (expert_rank or rank) * (i + o)
                        for i, o, name in ((d, 2 * fe, "experts.gate_up_proj"), (fe, d, "experts.down_proj"))
                        if name in t)
    frozen += 2 * tokens * d * c["num_hidden_layers"] * pl  # embeddings -> per-layer inputs (E2B/E4B)
    logits = 2 * tokens * d * c["vocab_size"]
    forward = frozen + attention + lora + logits
    # backward: frozen weights and logits through the activations only (1x), attention 2x (dq, dk, dv, dp),
    # LoRA 2x (activations and its own A, B)
    backward = frozen + logits + 2 * attention + 2 * lora
    recompute = _RECOMPUTED_FORWARDS.get(policy, 0) * (frozen + attention + lora)
    return {"forward": forward, "backward": backward, "recompute": recompute, "model": forward + backward,
            "total": forward + backward + recompute, "attention_share": 3 * attention / (forward + backward)}


def epoch_rows(profile: Profile, seed: int = 0) -> dict:
    """Rows of one epoch at the profile's ``max_seq_len``, packed vs padded, for CodeV-R1-like example lengths
    (``data.codev_like_lengths``: CodeV-R1's mean 922 and p99 2553 tokens) of the profile's ``max_rows`` (the
    paper's 10,000) examples, all of them trained on (as the paper's 1,249 steps were)."""
    n = profile.data.max_rows or serving_bench.PAPER_TRAINING_ROWS
    lengths = data.codev_like_lengths(n=n, seed=seed)
    use = data.token_use_for_lengths(lengths, profile.train.max_seq_len)
    return {"examples": int(n), **use}


def predict_run(plan: dict, profile: Profile, paper_hours: float | None = None, paper_steps: int | None = None,
                paper_profile: str = "v5p-8", text_config: dict | None = None) -> dict:
    """The training run an :func:`aot_plan` result (with cost figures) implies: roofline seconds per optimizer step
    (XLA's per-chip FLOPs at peak or its bytes at HBM bandwidth, whichever is longer), steps per epoch packed vs
    padded, hours and dollars per epoch, the MFU the paper's measured run implies, and the epoch at that MFU.
    A profile without a price (Colab bills compute units) gets hours and no dollars."""
    hw, tr = profile.hardware, profile.train
    if "flops" not in plan:
        raise PlanError(f"The plan for {plan['profile']} has no cost analysis (compiled before it was recorded); "
                        f"recompile it.")
    if not hw.peak_bf16_flops_per_chip or not hw.hbm_bytes_per_s_per_chip:
        raise PlanError(f"Profile {profile.name!r} names no chip peaks (profiles.CHIP_PEAK_BF16_FLOPS).")

    chips, rows_per_step = hw.num_devices, tr.micro_batch * tr.grad_accum
    compute_s = plan["flops"] / hw.peak_bf16_flops_per_chip
    memory_s = plan["bytes_accessed"] / hw.hbm_bytes_per_s_per_chip
    micro_s = max(compute_s, memory_s)
    step_s = micro_s * tr.grad_accum
    text = with_layers(text_config or base_model.profile_text_config(profile), plan["layers"])
    analytic = analytic_step_flops(text, plan["batch"], plan["seq_len"], plan["lora_rank"], profile.lora.targets,
                                   plan["remat"], profile.lora.expert_rank)
    xla_total = plan["flops"] * chips
    rows = epoch_rows(profile)
    steps = {k: math.ceil(rows[f"{k}_rows"] / rows_per_step) for k in ("packed", "padded")}
    price = hw.price_usd_per_hour
    usd = lambda hours: {k: h * price for k, h in hours.items()} if price else dict.fromkeys(hours)  # noqa: E731
    out = {
        "profile": profile.name, "chips": chips, "layers": plan["layers"], "remat": plan["remat"],
        "seq_len": plan["seq_len"], "rows_per_step": rows_per_step,
        "flops_per_chip": plan["flops"], "bytes_per_chip": plan["bytes_accessed"],
        "compute_s": compute_s, "memory_s": memory_s, "bound": "compute" if compute_s >= memory_s else "memory",
        "micro_step_s": micro_s, "step_s": step_s, "xla_optimal_s": plan.get("optimal_seconds"),
        "analytic_total_flops": analytic["total"], "analytic_model_flops": analytic["model"],
        "xla_over_analytic": xla_total / analytic["total"], "attention_share": analytic["attention_share"],
        "rows": rows, "steps": steps, "price_usd_per_hour": price,
        "roofline_hours": {k: v * step_s / 3600 for k, v in steps.items()},
    }
    out["roofline_usd"] = usd(out["roofline_hours"])
    paper_hours = paper_hours if paper_hours is not None else serving_bench.PAPER_TRAINING_HOURS[paper_profile]
    paper_steps = paper_steps if paper_steps is not None else serving_bench.PAPER_TRAINING_STEPS
    paper = profiles.get_profile(paper_profile)
    # the paper's run: paper_steps updates of its rows per step (8, each padded to its seq_len), at the 31B's model
    # FLOPs per row (this step's count when the plan is of the paper's model and length)
    paper_rows = paper.train.micro_batch * paper.train.grad_accum
    paper_row_flops = analytic_step_flops(base_model.profile_text_config(paper), 1, paper.train.max_seq_len,
                                          paper.lora.rank, paper.lora.targets, plan["remat"])["model"]
    paper_mfu = paper_steps * paper_rows * paper_row_flops / (
        paper_hours * 3600 * paper.hardware.num_devices * paper.hardware.peak_bf16_flops_per_chip)
    out.update({"paper_hours": paper_hours, "paper_steps": paper_steps, "paper_mfu": paper_mfu,
                "paper_hfu": paper_mfu * xla_total / analytic["model"],  # XLA's FLOPs, the recompute included
                "roofline_mfu": analytic["model"] / (chips * hw.peak_bf16_flops_per_chip * micro_s)})
    at_paper_s = analytic["model"] / plan["batch"] * rows_per_step / (paper_mfu * chips * hw.peak_bf16_flops_per_chip)
    at_paper_s = max(at_paper_s, step_s)  # never faster than the roofline (a memory-bound chip: v6e)
    out["paper_mfu_step_s"] = at_paper_s
    out["paper_mfu_hours"] = {k: v * at_paper_s / 3600 for k, v in steps.items()}
    out["paper_mfu_usd"] = usd(out["paper_mfu_hours"])
    return out


# The training profiles a run is predicted for (notebooks 04 and 06), at the course's seq 3072 and BLOCK remat.
PREDICTION_SETTINGS = (("v5p-8", "block"), ("v5p-16", "block"), ("v6e-8", "block"))


def course_predictions(run_dir: str | os.PathLike, compute: bool = False, settings=PREDICTION_SETTINGS) -> list[dict]:
    """:func:`predict_run` for each setting whose plan (:func:`course_plans`: cached, compiled when ``compute``, or
    the shipped reference) has XLA's cost analysis; the others are left out (compile them with ``plan --aot``)."""
    out = []
    for p in course_plans(run_dir, compute=compute, settings=settings):
        if "flops" in p and p["layers"] >= p.get("model_layers", p["layers"]):
            out.append({**predict_run(p, profiles.get_profile(p["profile"])), "source": p["source"]})
    return out


def _dollars(x: float | None) -> str:
    return "no price" if x is None else f"${x:.2f}"


def _round(x: float | None, digits: int):
    return None if x is None else round(x, digits)


def prediction_table(predictions: list[dict]):
    """One row per profile: roofline step time, steps, hours and dollars per epoch packed and padded, the paper's
    MFU and the epoch at that MFU, and the FLOP cross-check."""
    import pandas as pd

    rows = []
    for p in predictions:
        rows.append({
            "profile": p["profile"], "chips": p["chips"], "TFLOP/chip/micro-step": round(p["flops_per_chip"] / 1e12, 1),
            "bound": p["bound"], "roofline s/step": round(p["step_s"], 2),
            "steps packed": p["steps"]["packed"], "steps padded": p["steps"]["padded"],
            "roofline h packed": round(p["roofline_hours"]["packed"], 2),
            "roofline $ packed": _round(p["roofline_usd"]["packed"], 2),
            "roofline h padded": round(p["roofline_hours"]["padded"], 2),
            "paper MFU %": round(100 * p["paper_mfu"], 1),
            "h padded @ paper MFU": round(p["paper_mfu_hours"]["padded"], 2),
            "$ padded @ paper MFU": _round(p["paper_mfu_usd"]["padded"], 2),
            "h packed @ paper MFU": round(p["paper_mfu_hours"]["packed"], 2),
            "$ packed @ paper MFU": _round(p["paper_mfu_usd"]["packed"], 2),
            "XLA / analytic FLOPs": round(p["xla_over_analytic"], 3),
        })
    return pd.DataFrame(rows)


def packing_savings(pred: dict) -> str:
    """What packing saves on the real run, at the paper's MFU: hours and dollars, padded vs packed."""
    h, usd, st = pred["paper_mfu_hours"], pred["paper_mfu_usd"], pred["steps"]
    saved = None if usd["packed"] is None else usd["padded"] - usd["packed"]
    return (f"{pred['profile']} at the paper's MFU ({100 * pred['paper_mfu']:.1f}%, {pred['paper_mfu_step_s']:.2f} s "
            f"per step of {pred['rows_per_step']} rows): padded {st['padded']:,} steps = {h['padded']:.2f} h = "
            f"{_dollars(usd['padded'])}; packed {st['packed']:,} steps = {h['packed']:.2f} h = "
            f"{_dollars(usd['packed'])}; packing saves {h['padded'] - h['packed']:.2f} h and {_dollars(saved)} "
            f"({100 * (1 - h['packed'] / h['padded']):.0f}%)")


def format_prediction(pred: dict) -> str:
    """The lines ``plan --aot`` prints for :func:`predict_run`."""
    h, usd, st = pred["roofline_hours"], pred["roofline_usd"], pred["steps"]
    ph, pu = pred["paper_mfu_hours"], pred["paper_mfu_usd"]
    r = pred["rows"]
    return "\n".join([
        f"predicted run: {pred['profile']} ({pred['chips']} chip{'s' if pred['chips'] != 1 else ''}), "
        f"remat={pred['remat']}, seq {pred['seq_len']}, "
        f"{pred['rows_per_step']} rows per optimizer step",
        f"  per chip per micro-step (XLA cost analysis, {pred['layers']} layers): "
        f"{pred['flops_per_chip'] / 1e12:.2f} TFLOP -> {pred['compute_s']:.3f} s at peak; "
        f"{pred['bytes_per_chip'] / 1e9:.1f} GB -> {pred['memory_s']:.3f} s at HBM bandwidth: {pred['bound']}-bound",
        f"  roofline: {pred['step_s']:.2f} s per optimizer step (model FLOPs would run at "
        f"{100 * pred['roofline_mfu']:.0f}% of peak there: MFU leaves out the recompute)",
        f"  FLOP cross-check: XLA {pred['flops_per_chip'] * pred['chips'] / 1e12:.1f} TFLOP per micro-step vs "
        f"analytic {pred['analytic_total_flops'] / 1e12:.1f} (forward + backward + remat recompute): "
        f"x{pred['xla_over_analytic']:.3f}",
        f"  epoch of {r['examples']:,} CodeV-R1-like examples: packed {r['packed_rows']:,} rows = {st['packed']:,} "
        f"steps, padded {r['padded_rows']:,} rows = {st['padded']:,} steps",
        f"  at the roofline: packed {h['packed']:.2f} h {_dollars(usd['packed'])}, padded {h['padded']:.2f} h "
        f"{_dollars(usd['padded'])} " + (f"(at ${pred['price_usd_per_hour']:.2f}/h)" if pred["price_usd_per_hour"]
                                         else "(the profile has no hourly price)"),
        f"  the paper's {pred['paper_hours']} h for {pred['paper_steps']:,} padded steps on v5p-8 implies MFU "
        f"{100 * pred['paper_mfu']:.1f}% (XLA's FLOPs, the recompute included: {100 * pred['paper_hfu']:.1f}%)",
        f"  what packing saves at the paper's MFU: padded {ph['padded']:.2f} h {_dollars(pu['padded'])} -> packed "
        f"{ph['packed']:.2f} h {_dollars(pu['packed'])} ({pred['paper_mfu_step_s']:.2f} s per step)",
    ])


def format_plan(plan: dict) -> str:
    g = lambda k: plan[k] / GIB  # noqa: E731
    usable = plan.get("hbm_usable_bytes", plan["hbm_bytes"])  # a plan cached before the usable figure: the nominal
    spare = plan.get("spare_bytes", usable - plan["peak_bytes"])
    of = f"of the {usable / GIB:.2f} GiB XLA can use ({g('hbm_bytes'):.0f} GiB HBM)"
    lines = [
        f"AOT plan: {plan['profile']} ({plan['topology']}, mesh {plan['mesh']}), "
        f"{plan.get('model', 'google/gemma-4-31B-it')} {lora_label(plan, rank=True)}, bf16",
        f"  remat={plan['remat']} batch={plan['batch']} seq={plan['seq_len']} layers={plan['layers']} "
        f"({plan['method']})",
    ]
    for p in plan["points"]:
        if p.get("hbm_oom"):
            lines.append(f"  compiled {p['layers']:3d} layers: XLA stopped after {p['compile_s']:.1f} s, out of HBM "
                         f"(temp {p['temp_bytes'] / GIB:.2f} GiB alone exceeds what the chip has)")
            continue
        lines.append(f"  compiled {p['layers']:3d} layers in {p['compile_s']:6.1f} s: arguments "
                     f"{p['argument_bytes'] / GIB:7.2f} GiB, temp {p['temp_bytes'] / GIB:7.2f} GiB, "
                     f"output {p['output_bytes'] / GIB:7.2f} GiB")
    if plan.get("hbm_oom"):
        lines.append(f"  per chip: arguments {g('argument_bytes'):.2f} GiB + temp {g('temp_bytes'):.2f} GiB = at least "
                     f"{g('peak_bytes'):.2f} GiB {of}: DOES NOT FIT. Try remat block or "
                     f"decoder (--remat), a shorter --seq-len, or QLoRA (--qlora nf4).")
        return "\n".join(lines)
    lines.append(f"  per chip: arguments {g('argument_bytes'):.2f} GiB + temp {g('temp_bytes'):.2f} GiB + output "
                 f"{g('output_bytes'):.2f} GiB - aliased {g('alias_bytes'):.2f} GiB = {g('peak_bytes'):.2f} GiB "
                 f"{of}: " + (f"FITS, {spare / GIB:.2f} GiB spare" if plan["fits"] else
                              f"DOES NOT FIT, {-spare / GIB:.2f} GiB over")
                 + (f" (a {plan['layers']}-layer variant of the {plan['model_layers']}-layer model)"
                    if plan["layers"] < plan.get("model_layers", plan["layers"]) else ""))
    return "\n".join(lines)

