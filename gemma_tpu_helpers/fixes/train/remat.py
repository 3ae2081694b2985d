"""Gradient checkpointing (remat) for the Gemma 4 LoRA step: tunix's policies, and the order they must come in.

The policy is tunix's ``model.config.remat_config`` (:data:`POLICIES`). Switched on *before* qwix applies LoRA, it
yields a model with no LoRA params (qwix creates them while tracing, and tunix's ``nnx.remat`` drops variables
created inside it): :func:`lora_then_remat` applies LoRA first and refuses the wrong order.
"""

from __future__ import annotations

from ..core.errors import GemmaTpuError
from . import lora

# name -> description: tunix's model.config.remat_config values.
POLICIES: dict[str, str] = {
    "none": "no rematerialisation: every activation is kept for the backward pass",
    "block": "tunix RematConfig.BLOCK: attention and MLP blocks each recomputed in the backward pass",
    "decoder": "tunix RematConfig.DECODER: each decoder layer recomputed; only its input is kept",
}


class UnknownPolicyError(GemmaTpuError, ValueError):
    pass


class RematOrderError(GemmaTpuError, ValueError):
    """LoRA applied to a model whose remat is already on: qwix would create no LoRA params."""


def check_policy(policy: str) -> str:
    name = str(policy).lower()
    if name not in POLICIES:
        raise UnknownPolicyError(f"Unknown remat policy {policy!r}. Valid policies: {', '.join(POLICIES)}.")
    return name


def count_lora_params(model) -> int:
    """Number of LoRA parameters (elements of every ``nnx.LoRAParam``) in a model (works on abstract models)."""
    import math

    import jax
    from flax import nnx

    leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.LoRAParam))
    return sum(math.prod(x.shape) for x in leaves)


def _configs(model) -> list:
    """Every distinct tunix ModelConfig object referenced by the model's modules."""
    seen, out = set(), []
    for _, module in model.iter_modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "remat_config") and id(cfg) not in seen:
            seen.add(id(cfg))
            out.append(cfg)
    return out


def remat_config_of(model) -> str:
    """The tunix remat setting of a model, lower case ("none", "block", "decoder")."""
    return model.config.remat_config.name.lower()


def set_remat(model, policy: str, require_lora: bool = True) -> str:
    """Switch a model's remat policy in place (LoRA must already be applied); returns the policy name."""
    from tunix.models.gemma4 import model as gm

    policy = check_policy(policy)
    if require_lora and count_lora_params(model) == 0:
        raise RematOrderError(
            "This model has no LoRA params. Apply LoRA first (remat.lora_then_remat does both in the right "
            "order), then switch remat on."
        )
    value = getattr(gm.RematConfig, policy.upper())
    for cfg in _configs(model):
        cfg.remat_config = value
    return policy


def lora_then_remat(model, rank: int, alpha: float, policy: str = "none", seed: int = 0,
                    targets=lora.HF_TARGETS, dropout: float = 0.0, qlora: str | None = None, abstract: bool = False,
                    expert_rank: int | None = None):
    """Apply LoRA (``lora.apply_lora``; QLoRA with ``qlora="nf4"``), then the remat policy; return the model, ready
    to train. ``abstract``: shapes only (``nnx.eval_shape``). Raises :class:`RematOrderError` if remat is already on.
    """
    policy = check_policy(policy)
    current = remat_config_of(model)
    if current != "none":
        raise RematOrderError(
            f"remat_config is already {current.upper()} on this model. With remat on, qwix.apply_lora_to_model "
            f"creates no LoRA params on Gemma 4 (the LoRA variables made inside tunix's nnx.remat are dropped). "
            f"Load the model with remat='none', apply LoRA, then set remat (remat.lora_then_remat(model, rank, "
            f"alpha, policy={current!r}) does it in this order)."
        )
    model = lora.apply_lora(model, targets, rank, alpha, dropout, qlora=qlora, seed=seed, abstract=abstract,
                            expert_rank=expert_rank)[0]
    if dropout > 0:
        # qwix draws LoRA dropout masks from the modules' ``qwix_rngs``, which it unsets after creating the params:
        # without these the first train step fails ("Cannot find rngs in the current module").
        from flax import nnx

        model.set_attributes(qwix_rngs=nnx.Rngs(dropout=seed))
    set_remat(model, policy)
    return model


def memory_figures(compiled) -> dict:
    """XLA's per-device memory analysis of a compiled executable, in bytes."""
    m = compiled.memory_analysis()
    args, out, temp = m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes
    alias = getattr(m, "alias_size_in_bytes", 0)
    code = getattr(m, "generated_code_size_in_bytes", 0)
    return {"argument_bytes": args, "output_bytes": out, "temp_bytes": temp, "alias_bytes": alias,
            "code_bytes": code, "peak_bytes": args + out - alias + temp}


def count_remat_regions(jaxpr) -> int:
    """How many rematerialised regions (``checkpoint``/``remat`` equations) a jaxpr (its text) holds."""
    text = str(jaxpr)
    return text.count("checkpoint[") + text.count("remat[") + text.count("remat2[")
