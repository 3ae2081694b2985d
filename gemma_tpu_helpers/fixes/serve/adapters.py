"""LoRA adapters for serving unmerged (``--enable-lora``; tests/e2e/test_serve.py): a PEFT test adapter, the
target regex vLLM serves exactly, and the transformers + PEFT reference a served adapter is checked against."""

from __future__ import annotations

from pathlib import Path

from ..model.hf_checkpoint import layer_kinds, read_text_config
from ..train.lora import LoraSpec, peft_target_modules


def make_test_adapter(base_dir, out_dir, rank: int, alpha: float | None = None, targets=None, seed: int = 0,
                      b_std: float = 0.05) -> Path:
    """A PEFT LoRA adapter for ``base_dir`` with random non-zero B (so it changes the outputs), for serving tests.

    Both factors come from ``seed`` alone (PEFT would draw A from torch's global generator). Keys are in the
    multimodal layout (``base_model.model.model.language_model.layers.N...``), which vLLM maps as it maps the base.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    out_dir = Path(out_dir)
    model = AutoModelForImageTextToText.from_pretrained(str(base_dir), dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=0.0,
                     target_modules=(targets if isinstance(targets, str)
                                     else peft_target_modules(targets or LoraSpec.targets)))
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name:
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


def targets_without_global_k(model_dir, targets=None) -> str:
    """A PEFT ``target_modules`` regex: ``targets`` everywhere, except ``k_proj`` on the global (k=v) layers, where
    vLLM 0.32 applies the LoRA to K only while the model uses that projection for V too (merged weights are fine)."""
    local = [i for i, k in enumerate(layer_kinds(read_text_config(model_dir))) if k == "local"]
    return peft_target_modules(targets or LoraSpec.targets, k_layers=local)


def hf_peft_top_logprobs(base_dir, adapter_dir, token_ids, candidates: list[int]) -> dict[int, float]:
    """Next-token log-probabilities from transformers + PEFT (fp32) for ``candidates``: the reference for a served
    adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor([list(token_ids)], dtype=torch.long)).logits[0, -1].double()
    lp = torch.log_softmax(logits, -1)
    return {int(c): float(lp[c]) for c in candidates}


def lora_reference_gap(server, name: str, base_dir, adapter_dir, token_ids, top: int = 5) -> float:
    """max |Δ log-prob| between vLLM serving adapter ``name`` (``server``: a ``vllm_client.Client``) and transformers +
    PEFT, over vLLM's ``top`` next-token candidates. fp32 rounding gives ~1e-4; more means vLLM computes a different
    model."""
    served = server.complete_ids(token_ids, 1, model=name, top=top)["top"][0]
    ref = hf_peft_top_logprobs(base_dir, adapter_dir, token_ids, [t for t, _ in served])
    return max(abs(ref[t] - lp) for t, lp in served)
