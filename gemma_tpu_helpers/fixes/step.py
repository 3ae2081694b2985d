"""The one LoRA train step, for training and for the ahead-of-time compile alike.

A memory figure holds only for the step that runs, so training (:func:`make_trainer`: tunix's ``PeftTrainer`` running
:func:`train_step`) and the AOT plan (:func:`abstract_arguments`, :func:`lower`) both take it from here. One
micro-step: packed-row inputs, assistant-token NLL, LoRA-only gradients, AdamW with warmup-cosine, clipping, a
non-finite update skipped, gradient accumulation. The remat policy is a switch on the model, so it is inside too.
"""

from __future__ import annotations

import dataclasses
import logging

from . import forward_inputs, gemma4, partition_specs
from . import mesh as mesh_lib
from . import remat as remat_lib


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
        raise ValueError(f"Unknown schedule {spec.schedule!r}; this course implements 'cosine'.")
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
                         f"profile {spec.grad_accum}: build the config from the profile.")

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


def _place(node, mesh) -> None:
    """Shard every abstract leaf of ``node`` on ``mesh`` by its partition spec, less the axes that cannot divide."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    state = nnx.state(node)
    specs = nnx.get_partition_spec(state)
    placed = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, P(*partition_specs.divisible_spec(x.shape, tuple(s), sizes)))),
        state, specs)
    nnx.update(node, placed)


def batch_axis(mesh, batch: int):
    """The mesh axis the batch is split over: ``fsdp`` when it divides the batch (as in training), else none."""
    return "fsdp" if batch % dict(zip(mesh.axis_names, mesh.devices.shape)).get("fsdp", 1) == 0 else None


def abstract_batch(mesh, batch: int, seq_len: int) -> dict:
    """A packed micro-batch's shapes and dtypes (``forward_inputs.BATCH_DTYPES``), split over the batch axis."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P(batch_axis(mesh, batch), None))
    return {k: jax.ShapeDtypeStruct((batch, seq_len), dt, sharding=sharding)
            for k, dt in forward_inputs.BATCH_DTYPES.items()}


def abstract_arguments(text_config: dict, mesh, lora_spec, train_spec, batch: int, seq_len: int,
                       dtype: str = "bfloat16", remat: str = "none", total_steps: int = 1000):
    """``(model, optimizer, batch)`` of :func:`train_step` as shapes only, sharded on ``mesh`` as in training, with
    LoRA and remat applied as training applies them."""
    from flax import nnx
    from tunix.models.gemma4 import model as gm

    policy = remat_lib.check_policy(remat)
    cfg = gemma4.to_tunix_config(text_config, dtype=dtype)

    # LoRA on the abstract base, not inside the base's eval_shape: traced there, qwix's QLoRA adapts no MLP einsum.
    model = remat_lib.lora_then_remat(nnx.eval_shape(lambda: gm.Gemma4(cfg, rngs=nnx.Rngs(0))), lora_spec.rank,
                                      lora_spec.alpha, policy, targets=lora_spec.targets, dropout=lora_spec.dropout,
                                      qlora=lora_spec.qlora, abstract=True, expert_rank=lora_spec.expert_rank)
    optimizer = nnx.eval_shape(lambda m: optimizer_for(m, train_spec, total_steps), model)
    _place(model, mesh)
    _place(optimizer, mesh)
    return model, optimizer, abstract_batch(mesh, batch, seq_len)


def argument_bytes(*trees) -> int:
    """Bytes one chip holds of abstract, sharded arguments: XLA's argument size before a compile, less the
    padding of TPU layouts."""
    import jax
    from flax import nnx

    total = 0
    for x in jax.tree.leaves([nnx.state(t) if isinstance(t, nnx.Pytree) else t for t in trees]):
        sizes = dict(zip(x.sharding.mesh.axis_names, x.sharding.mesh.devices.shape))
        # a key: its words
        data = jax.eval_shape(jax.random.key_data, x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        total += partition_specs.bytes_per_device(data.shape, data.dtype, tuple(x.sharding.spec), sizes)
    return total


def lower(model, optimizer, batch, mesh):
    """:func:`jitted` lowered for these (abstract or concrete) arguments, under the mesh context tunix trains in."""
    with mesh_lib.trainer_context(mesh):
        return jitted().lower(model, optimizer, batch)


def fingerprint(lowered) -> str:
    """A digest of a lowered step's StableHLO with locations stripped: equal digests, the same program."""
    import hashlib
    import re

    text = lowered.as_text()
    text = re.sub(r"loc\([^)]*\)|#loc\d*( = .*)?", "", text)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
