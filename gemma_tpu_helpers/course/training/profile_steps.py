"""The course's run directory on top of the fixes: a profile's merged checkpoint (cached), and the fixes' reports
for a profile's model, mesh and LoRA settings. Each function here reads a profile and calls one fix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ...fixes.core.file_io import path_id
from ...fixes.export.merge import merge_lora, read_merge_info
from ...fixes.model import gemma4
from ...fixes.model.layout import lora_param_count
from ...fixes.serve import vllm_command
from ...fixes.train.lora import EXPERT_TARGETS, apply_lora, coverage_of_regex
from ..config import base_model, profiles
from ..views import model_views
from . import train


def lora_report(profile, regex: str | None = None, model=None):
    """Coverage summary for a profile's base model: ours (HF targets) or a raw qwix ``regex``. Abstract (fast)."""
    if model is None:
        base = base_model.ensure_base(profile)
        model = gemma4.load_model(base, profile.make_mesh(), dtype=profile.model.dtype)
    spec = profile.lora
    if regex is not None:
        return model_views.lora_summary(coverage_of_regex(model, regex, rank=spec.rank, alpha=spec.alpha))
    _, report = apply_lora(model, targets=spec.targets, rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout,
                           abstract=True, expert_rank=spec.expert_rank)
    out = model_views.lora_summary(report)
    text = base_model.profile_text_config(profile)
    if text.get("enable_moe_block"):  # an MoE: both counts, with and without the routed experts
        dense = [t for t in spec.targets if t not in EXPERT_TARGETS]
        with_experts = lora_param_count(text, spec.rank, dense + list(EXPERT_TARGETS), spec.expert_rank)
        out.attrs["counts"] = (f"LoRA parameters: {with_experts:,} with the routed experts, "
                               f"{lora_param_count(text, spec.rank, dense):,} on attention and the dense MLP alone "
                               f"(--no-experts)")
    return out


def without_experts(profile):
    """The profile with LoRA on attention and the dense MLP only (``--no-experts``): the routed experts untrained."""
    targets = tuple(t for t in profile.lora.targets if t not in EXPERT_TARGETS)
    return dataclasses.replace(profile, lora=dataclasses.replace(profile.lora, targets=targets))


def hbm_per_chip(profile, weight_dtype: str | None = None) -> dict:
    """``vllm_command.hbm_per_chip`` for a profile's serving settings and model config (per-chip weights + KV cache)."""
    return vllm_command.hbm_per_chip(profile.serving, base_model.profile_text_config(profile), weight_dtype)


def sharding_plan(profile):
    """``model_views.plan_lora_sharding`` for a profile's model, mesh and LoRA settings (abstract: runs on any CPU)."""
    text = base_model.profile_text_config(profile)
    return model_views.plan_lora_sharding(text, profile.mesh_shape, profile.mesh_axes, rank=profile.lora.rank,
                                          alpha=profile.lora.alpha, targets=profile.lora.targets,
                                          dtype=profile.model.dtype, expert_rank=profile.lora.expert_rank)


def ensure_merged(profile, run_dir: str | Path | None = None, progress: bool = True) -> Path:
    """``runs/<profile>/merged``, merged from the run's trained LoRA (``train.ensure_trained``) when missing or stale.

    Cached: rebuilt when the latest checkpoint step, the checkpoint directory, or the LoRA arrays' recorded source
    changed. How notebooks 08 (serving) and 09 (evaluation) stay standalone.
    """
    run = profiles.resolve_run(profile, run_dir)
    ckpt = train.ensure_trained(profile, run, progress=progress)
    base = base_model.ensure_base(profile, run)
    out = run.local / "merged"  # local, also for a gs:// run directory
    info = read_merge_info(out)
    step = train.latest_step(ckpt)
    if info and info.get("step") == step and info.get("checkpoint_dir") == path_id(ckpt) \
            and info.get("base_dir") == path_id(base):
        return out
    merge_lora(base, ckpt, out, overwrite=True, progress=progress)
    return out
