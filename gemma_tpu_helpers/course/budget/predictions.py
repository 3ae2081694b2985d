"""What a compiled train step implies for a training run: roofline seconds per step from XLA's cost analysis, steps
per epoch packed vs padded, hours and dollars, and the MFU the paper's measured run implies (:func:`predict_run`);
the FLOPs counted from the config as a cross-check (:func:`analytic_step_flops`).
"""

from __future__ import annotations

import math
import os

from ...fixes.model.hf_checkpoint import kv_shared_layers, layer_kinds
from ...fixes.model.model_size import attn_dims
from ...fixes.train import packing
from ..config import base_model, profiles
from ..config.profiles import Profile
from . import serving_bench
from .plan import AotPlan, PlanError, course_plans, with_layers

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
    (``packing.codev_like_lengths``: CodeV-R1's mean 922 and p99 2553 tokens) of the profile's ``max_rows`` (the
    paper's 10,000) examples, all of them trained on (as the paper's 1,249 steps were)."""
    n = profile.data.max_rows or serving_bench.PAPER_TRAINING_ROWS
    lengths = packing.codev_like_lengths(n=n, seed=seed)
    use = packing.token_use_for_lengths(lengths, profile.train.max_seq_len)
    return {"examples": int(n), **use}


def predict_run(plan: AotPlan, profile: Profile, paper_hours: float | None = None, paper_steps: int | None = None,
                paper_profile: str = "v5p-8", text_config: dict | None = None) -> dict:
    """The training run an :func:`aot_plan` result (with cost figures) implies: roofline seconds per optimizer step
    (XLA's per-chip FLOPs at peak or its bytes at HBM bandwidth, whichever is longer), steps per epoch packed vs
    padded, hours and dollars per epoch, the MFU the paper's measured run implies, and the epoch at that MFU.
    A profile without a price (Colab bills compute units) gets hours and no dollars."""
    hw, tr = profile.hardware, profile.train
    if plan.flops is None:
        raise PlanError(f"The plan for {plan.profile} has no cost analysis (compiled before it was recorded); "
                        f"recompile it.")
    if not hw.peak_bf16_flops_per_chip or not hw.hbm_bytes_per_s_per_chip:
        raise PlanError(f"Profile {profile.name!r} names no chip peaks (profiles.CHIP_PEAK_BF16_FLOPS).")

    chips, rows_per_step = hw.num_devices, tr.micro_batch * tr.grad_accum
    compute_s = plan.flops / hw.peak_bf16_flops_per_chip
    memory_s = plan.bytes_accessed / hw.hbm_bytes_per_s_per_chip
    micro_s = max(compute_s, memory_s)
    step_s = micro_s * tr.grad_accum
    text = with_layers(text_config or base_model.profile_text_config(profile), plan.layers)
    analytic = analytic_step_flops(text, plan.batch, plan.seq_len, plan.lora_rank, profile.lora.targets,
                                   plan.remat, profile.lora.expert_rank)
    xla_total = plan.flops * chips
    rows = epoch_rows(profile)
    steps = {k: math.ceil(rows[f"{k}_rows"] / rows_per_step) for k in ("packed", "padded")}
    price = hw.price_usd_per_hour
    usd = lambda hours: {k: h * price for k, h in hours.items()} if price else dict.fromkeys(hours)  # noqa: E731
    out = {
        "profile": profile.name, "chips": chips, "layers": plan.layers, "remat": plan.remat,
        "seq_len": plan.seq_len, "rows_per_step": rows_per_step,
        "flops_per_chip": plan.flops, "bytes_per_chip": plan.bytes_accessed,
        "compute_s": compute_s, "memory_s": memory_s, "bound": "compute" if compute_s >= memory_s else "memory",
        "micro_step_s": micro_s, "step_s": step_s, "xla_optimal_s": plan.optimal_seconds,
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
                                          paper.lora.rank, paper.lora.targets, plan.remat)["model"]
    paper_mfu = paper_steps * paper_rows * paper_row_flops / (
        paper_hours * 3600 * paper.hardware.num_devices * paper.hardware.peak_bf16_flops_per_chip)
    out.update({"paper_hours": paper_hours, "paper_steps": paper_steps, "paper_mfu": paper_mfu,
                "paper_hfu": paper_mfu * xla_total / analytic["model"],  # XLA's FLOPs, the recompute included
                "roofline_mfu": analytic["model"] / (chips * hw.peak_bf16_flops_per_chip * micro_s)})
    at_paper_s = analytic["model"] / plan.batch * rows_per_step / (paper_mfu * chips * hw.peak_bf16_flops_per_chip)
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
        if p.flops is not None and p.layers >= p.model_layers:
            out.append({**predict_run(p, profiles.get_profile(p.profile)), "source": p.source})
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
