"""Supervised LoRA fine-tuning on tunix: the one train step, and tunix's ``PeftTrainer`` running it.

One micro-step (:func:`train_step`): packed-row inputs, assistant-token NLL, LoRA-only gradients, AdamW with
warmup-cosine, clipping, a non-finite update skipped; ``PeftTrainer`` adds the gradient accumulation
(:func:`make_trainer`). The model is any tunix Gemma 4 with LoRA (``lora.apply_lora``); ``step.py`` compiles this
same step ahead of time, so a memory figure holds for the step that trains.
"""

from __future__ import annotations

import dataclasses
import logging

from ..model import forward_inputs


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    learning_rate: float
    warmup_steps: int
    schedule: str  # "cosine"
    weight_decay: float
    micro_batch: int  # global rows per micro-step
    grad_accum: int
    max_seq_len: int
    epochs: int
    max_steps: int | None  # None: one pass over the data times `epochs`
    eval_every: int
    checkpoint_every: int
    keep_checkpoints: int
    remat: str  # "none" | "block" | "decoder"
    seed: int = 0
    max_grad_norm: float = 1.0  # TRL/transformers' default clipping, kept for equivalence


def token_nll(logits, labels):
    """Next-token NLL per position for integer ``labels``, in the logits' dtype (cast them first for fp32).

    The label's logit is picked by a masked sum, which stays sharded along the vocabulary: ``take_along_axis``
    (optax's integer-label loss) all-gathers vocab-sharded logits first, GiBs per chip on the 31B.
    """
    import jax
    import jax.numpy as jnp

    vocab = jax.lax.broadcasted_iota(labels.dtype, logits.shape, logits.ndim - 1)
    picked = jnp.sum(jnp.where(vocab == labels[..., None], logits, 0.0), axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - picked


def masked_token_nll(logits, tokens, loss_mask, segment_ids):
    """Sum of next-token NLL over assistant targets that stay inside their example, and their count."""
    import jax.numpy as jnp

    nll = token_nll(logits[:, :-1].astype(jnp.float32), tokens[:, 1:])
    valid = ((loss_mask[:, 1:] > 0) & (segment_ids[:, 1:] == segment_ids[:, :-1])).astype(jnp.float32)
    return jnp.sum(nll * valid), jnp.sum(valid)


def model_inputs(batch) -> dict:
    """What the loss function gets: tokens, loss mask, per-example positions and the block-diagonal causal mask."""
    import jax.numpy as jnp

    return dict(input_tokens=jnp.asarray(batch["tokens"]), loss_mask=jnp.asarray(batch["loss_mask"]),
                positions=jnp.asarray(batch["positions"]), segment_ids=jnp.asarray(batch["segment_ids"]),
                attention_mask=forward_inputs.attention_mask_from_segments(batch["segment_ids"]))


def loss_fn(model, input_tokens, loss_mask, positions, segment_ids, attention_mask):
    """Mean NLL per assistant target token of a micro-batch."""
    import jax.numpy as jnp

    logits, _ = model(input_tokens, positions, None, attention_mask)
    total, count = masked_token_nll(logits, input_tokens, loss_mask, segment_ids)
    return total / jnp.maximum(count, 1.0)


def lr_schedule(spec, total_steps: int):
    """Linear warmup from 0 to the peak, then cosine decay to 0 at ``total_steps`` (as HF's cosine-with-warmup)."""
    import optax

    if spec.schedule != "cosine":
        raise ValueError(f"Unknown schedule {spec.schedule!r}; lr_schedule implements 'cosine' (TrainSpec.schedule).")
    warmup = min(spec.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(0.0, spec.learning_rate, warmup, max(total_steps, warmup + 1), 0.0)


def build_optimizer(spec, total_steps: int):
    """AdamW with the schedule, weight decay and clipping; a non-finite update is skipped, so a NaN step leaves the
    LoRA params (and the next checkpoint) as they were. ``PeftTrainer`` adds the accumulation."""
    import optax

    tx = optax.chain(optax.clip_by_global_norm(spec.max_grad_norm),
                     optax.adamw(lr_schedule(spec, total_steps), weight_decay=spec.weight_decay))
    return optax.apply_if_finite(tx, max_consecutive_errors=1_000_000)


def accumulating(spec, total_steps: int):
    """:func:`build_optimizer` in ``optax.MultiSteps`` over ``spec.grad_accum`` micro-batches, as ``PeftTrainer``."""
    import optax

    return optax.MultiSteps(build_optimizer(spec, total_steps), spec.grad_accum)


def train_step(model, optimizer, batch):
    """One micro-step (tunix's ``PeftTrainer._train_step`` with these inputs and loss): ``(loss, None, grad norm)``;
    the LoRA params and ``optimizer`` (an ``nnx.Optimizer`` over ``nnx.LoRAParam``) are updated in place."""
    import optax
    from flax import nnx

    inputs = model_inputs(batch)
    grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))
    loss, grads = grad_fn(model, **inputs)
    grad_norm = optax.global_norm(grads)
    optimizer.update(model, grads)
    return loss, None, grad_norm


def jitted():
    """:func:`train_step` under ``nnx.jit`` with the model *and* the optimizer donated.

    ``nnx.jit`` returns the frozen base weights too; donated, they alias their inputs instead of being copied into
    new buffers each step (tunix donates only the optimizer: a second copy of the weights on every chip).
    """
    from flax import nnx

    return nnx.jit(train_step, donate_argnames=("model", "optimizer"))


def make_trainer(model, spec, total_steps: int, config):
    """tunix's ``PeftTrainer`` running :func:`jitted` with :func:`build_optimizer`; eval runs the same loss.

    ``config``: its ``TrainingConfig``; raises ValueError unless it accumulates ``spec.grad_accum`` micro-batches."""
    import functools

    from tunix.sft import peft_trainer

    if config.gradient_accumulation_steps != spec.grad_accum:
        raise ValueError(f"TrainingConfig accumulates {config.gradient_accumulation_steps} micro-batches, the "
                         f"TrainSpec {spec.grad_accum}: build the config from the spec.")

    class LoraTrainer(peft_trainer.PeftTrainer):
        def create_train_step_fn(self):
            return train_step

        def jit_train_and_eval_step(self, skip_jit: bool = False, cache_nnx_graph: bool = False):
            """tunix's, with :func:`jitted` (the model donated too) as the train step it calls."""
            from flax import nnx

            train_fn, eval_fn = super().jit_train_and_eval_step(skip_jit, cache_nnx_graph)
            if skip_jit or getattr(train_fn, "donates_model", False):
                return train_fn, eval_fn
            fn = jitted()  # bound to the model and optimizer as tunix binds its own (PeftTrainer.train caches them)
            if cache_nnx_graph:
                train_fn = functools.partial(nnx.cached_partial(fn, self.model, self.optimizer))
            else:
                train_fn = functools.partial(fn, self.model, self.optimizer)
            train_fn.donates_model, train_fn.jitted = True, fn
            self._jitted_train_step_fn = train_fn  # tunix's cache of the jitted step (cleared by clear_jit_cache)
            return train_fn, eval_fn

    save_replicas_once()
    trainer = LoraTrainer(model, build_optimizer(spec, total_steps), config)
    return trainer.with_loss_fn(loss_fn).with_gen_model_input_fn(model_inputs)


def save_replicas_once() -> None:
    """In a one-process run, make Orbax save each replicated array whole from its first replica (as it does on GPUs).

    Replica-parallel saving (the default) cuts each array into one eager slice per replica, for hosts that one
    process does not have: seconds per save. Same file format. Registers a global ``jax.Array`` handler; idempotent.
    """
    import jax
    import orbax.checkpoint as ocp

    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if jax.process_count() > 1 or not getattr(handler, "_use_replica_parallel", False):
        return
    store = getattr(handler, "_array_metadata_store", None)
    absl = logging.getLogger("absl")  # Orbax warns on every override of a registered type
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False, array_metadata_store=store),
            override=True)
    finally:
        absl.setLevel(level)


def optimizer_for(model, spec, total_steps: int):
    """The ``nnx.Optimizer`` ``PeftTrainer`` builds for a LoRA model (for runs and compiles outside the trainer)."""
    from flax import nnx

    return nnx.Optimizer(model, accumulating(spec, total_steps), wrt=nnx.LoRAParam)
