"""The LoRA train step of :mod:`sft`, compiled ahead of time: its arguments as shapes only, sharded on a mesh as
training shards them (LoRA and remat applied as training applies them), lowered under the mesh context tunix trains
in, and the bytes one chip holds of them.

A memory figure holds only for the step that runs, so the AOT plan compiles :func:`sft.jitted` itself.
"""

from __future__ import annotations

from ..model import forward_inputs, gemma4, partition_specs
from ..model import mesh as mesh_lib
from . import remat as remat_lib
from .sft import jitted, optimizer_for


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
