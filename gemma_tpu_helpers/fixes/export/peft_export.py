"""The trained LoRA as an unmerged PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

For ``vllm --enable-lora`` and ``peft.PeftModel``. The keys and factors come from :mod:`layout`'s table through
:mod:`merge_plan`, so PEFT's ΔW = (alpha/r)·B·A is the merge's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from ..core.file_io import absolute_path, install_dir, path_id, temp_dir_beside
from ..model import layout
from ..model.hf_checkpoint import KEY_PREFIX, read_text_config
from ..model.parity import load_hf
from ..train.lora import peft_target_modules
from ..train.lora_checkpoint import lora_digest, read_lora_config, restore_lora
from .merge import prepare_out_dir
from .merge_plan import plan_merge

PEFT_PREFIX = "base_model.model."  # PEFT's wrapper: base_model (LoraModel) . model (the HF model)


def peft_key(layer: int, row: layout.Row, ab: str, adapter: str | None = None) -> str:
    """A PEFT adapter key: ``base_model.model.<HF module>.lora_A.weight`` (``adapter``: the name PEFT puts before
    ``.weight`` in a live model's state dict, e.g. ``default``; saved adapter files have none)."""
    ab = ab.upper()
    if ab not in ("A", "B"):
        raise layout.LayoutError(f"ab must be 'A' or 'B', got {ab!r}")
    return f"{PEFT_PREFIX}{KEY_PREFIX}layers.{layer}.{row.hf_module}.lora_{ab}.{adapter + '.' if adapter else ''}weight"


def peft_keys(text_config: dict, targets=layout.TARGETS, adapter: str | None = None) -> list[str]:
    """Every PEFT key of a LoRA on ``targets`` (one lora_A and one lora_B per HF module that exists)."""
    return [peft_key(layer.index, row, ab, adapter) for layer in layout.layers(text_config)
            for row in layout.rows_for(layer, targets) for ab in ("A", "B")]


def peft_factors(row: layout.Row, a, b, rank: int):
    """PEFT's ``(lora_A (r, in), lora_B (out, r))`` of one row: ``(alpha/r) · lora_B · lora_A`` is the merge's ΔW."""
    a2, b2 = layout.delta_factors(row, a, b, rank)
    return a2.T, b2.T


def export_peft_adapter(checkpoint_dir, out_dir, base_dir, step: int | None = None, overwrite: bool = False) -> Path:
    """Write the checkpoint's LoRA as a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``), in
    the multimodal-layout key names vLLM 0.32 and ``PeftModel.from_pretrained`` accept.

    Caveat: vLLM 0.32 applies a global k=v layer's ``k_proj`` LoRA to K only, though the model uses it for V too;
    serve the merged weights instead, or train without it (``adapters.targets_without_global_k``).
    """
    from peft import LoraConfig
    from safetensors.numpy import save_file

    out_dir = absolute_path(out_dir, "output directory")
    base_dir = absolute_path(base_dir, "base directory")
    checkpoint_dir = absolute_path(checkpoint_dir, "checkpoint directory", remote=True)
    prepare_out_dir(out_dir, overwrite)
    meta = read_lora_config(checkpoint_dir)
    step, arrays = restore_lora(checkpoint_dir, step)
    deltas = plan_merge(arrays, meta, read_text_config(base_dir))
    tensors = {}
    experts = [t for t in layout.EXPERT_TARGETS if any(d.target == t for d in deltas)]
    for d in deltas:  # d.a = A2 (in, r), d.b = B2 (r, out): PEFT's lora_A = A2ᵀ, lora_B = B2ᵀ (peft_factors)
        if d.a.ndim == 3:
            key, (lora_a, lora_b) = _expert_key(d, experts), layout.expert_peft_factors(d.a, d.b)
        else:
            key, lora_a, lora_b = PEFT_PREFIX + d.hf.removesuffix(".weight"), d.a.T, d.b.T
        tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(lora_a.astype(np.float32))
        tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(lora_b.astype(np.float32))
    dense = layout.check_targets({d.target for d in deltas} - set(experts))
    rank, expert_rank = int(meta["rank"]), int(meta.get("expert_rank") or meta["rank"])
    cfg = LoraConfig(r=rank, lora_alpha=float(meta["alpha"]), lora_dropout=0.0,
                     target_modules=peft_target_modules(dense) if dense else [],  # the language model's only
                     target_parameters=experts or None,  # the routed experts: one A and B per expert
                     rank_pattern={t: expert_rank for t in experts} if expert_rank != rank else {},
                     base_model_name_or_path=str(meta.get("base_model") if meta.get("base_model") not in (None, "tiny")
                                                 else Path(base_dir).resolve()))
    tmp = temp_dir_beside(out_dir)
    try:
        cfg.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_source.json").write_text(json.dumps(
            {"checkpoint_dir": path_id(checkpoint_dir), "step": step, "lora_sha256": lora_digest(arrays),
             "tensors": len(tensors)}, indent=1) + "\n")
        install_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _expert_key(d, experts) -> str:
    """Where PEFT keeps an expert tensor's factors: it wraps the ``experts`` module once per targeted tensor, in
    ``target_parameters`` order, so with both targeted ``gate_up_proj`` is the inner wrapper's (``base_layer``)."""
    module = d.hf.rsplit(".", 1)[0]  # model.language_model.layers.<i>.experts
    inner = len(experts) == 2 and d.target == experts[0]
    return PEFT_PREFIX + module + (".base_layer" if inner else "")


def peft_logits(base_dir, adapter_dir, tokens: np.ndarray) -> np.ndarray:
    """transformers + PEFT (fp32, unmerged adapter) logits."""
    import torch
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_hf(base_dir), str(adapter_dir)).eval()
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens, dtype=torch.long)).logits.double().numpy()
