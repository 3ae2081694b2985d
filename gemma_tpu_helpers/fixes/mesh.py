"""Device meshes for tunix: Auto axis types, and a shape checked against the devices."""

from __future__ import annotations

import contextlib
import warnings

from .errors import GemmaTpuError
from .forward_inputs import causal_inputs
from .gemma4 import head_divisibility_problems, load_model


class MeshError(GemmaTpuError, ValueError):
    pass


def make_mesh(shape: tuple[int, ...], axes: tuple[str, ...], devices=None):
    """A ``jax.sharding.Mesh`` of ``shape`` with axis names ``axes``, Auto axis types (with JAX's default, Explicit,
    tunix's embedding gather fails). Raises MeshError unless the shape's product is the number of devices (of all
    processes, in process order: the first axis runs across processes, the last over neighbouring devices)."""
    import jax

    shape = tuple(shape)
    if axes is None or len(axes) != len(shape):
        raise MeshError(f"Give one axis name per mesh dimension: shape {shape}, axes {axes}.")
    devices = list(devices if devices is not None else jax.devices())
    size = 1
    for s in shape:
        size *= s
    if size != len(devices) and jax.process_count() > 1:
        raise MeshError(
            f"Mesh {dict(zip(axes, shape))} needs {size} devices but the {jax.process_count()} processes have "
            f"{len(devices)} together ({jax.local_device_count()} here). The mesh spans every process's devices: "
            f"pick a mesh whose product is {len(devices)}, or change the number of processes."
        )
    if size != len(devices):
        raise MeshError(
            f"Mesh {dict(zip(axes, shape))} needs {size} devices but {len(devices)} are visible "
            f"({devices[0].platform}). On CPU set XLA_FLAGS=--xla_force_host_platform_device_count={size} before "
            f"importing JAX, or pick a mesh whose product is {len(devices)}."
        )
    return jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(shape), devices=devices)


def describe(mesh):
    """The device grid as a table: rows along the first axis, columns along the second, cells are device ids."""
    import pandas as pd

    grid = mesh.devices.reshape(mesh.devices.shape[0], -1)
    cols = [f"{mesh.axis_names[-1]}={j}" for j in range(grid.shape[1])]
    idx = [f"{mesh.axis_names[0]}={i}" for i in range(grid.shape[0])]
    return pd.DataFrame([[d.id for d in row] for row in grid], index=idx, columns=cols)


def example_sharding(mesh, spec=("fsdp", "tp"), shape=None):
    """A small array laid out over ``mesh`` with ``spec``; prints which device holds which block."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    shape = shape or tuple(4 * mesh.shape[a] if a else 4 for a in spec)
    x = jax.device_put(jnp.arange(int(jnp.prod(jnp.array(shape))), dtype=jnp.float32).reshape(shape),
                       NamedSharding(mesh, PartitionSpec(*spec)))
    jax.debug.visualize_array_sharding(x)
    return x


def tp_table(text_config: dict, tp_sizes=(1, 2, 4, 8)):
    """Which tensor-parallel sizes a model config allows, and why the others fail."""
    import pandas as pd

    rows = []
    for tp in tp_sizes:
        problems = head_divisibility_problems(text_config, {"tp": tp})
        rows.append({"tp": tp, "valid": not problems, "why not": "; ".join(problems)})
    return pd.DataFrame(rows)


@contextlib.contextmanager
def trainer_context(mesh):
    """The mesh context tunix's ``PeftTrainer`` needs: ``with mesh:``, its deprecation warnings silenced.

    tunix 0.1.7 shards batches and optimizer state from this legacy context: under ``jax.set_mesh`` alone both
    are silently replicated, and using both crashes.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*with mesh:.*context manager has been deprecated")
        warnings.filterwarnings("ignore", message=".*thread_resources is deprecated")
        with mesh:
            yield mesh


def trainer_batch_sharding(model, mesh, context: str = "trainer", seq_len: int = 16):
    """Run one tunix ``PeftTrainer`` step and return the sharding its batch had *inside* the jitted step.

    ``context``: "trainer" (:func:`trainer_context`) or "set_mesh" (``jax.set_mesh`` alone, the trap). The model
    takes one tiny SGD step: pass a copy if you need it untouched.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from tunix.sft import peft_trainer

    seen = {}

    def loss_fn(model, input_tokens, input_mask, positions, attention_mask):
        jax.debug.inspect_array_sharding(input_tokens, callback=lambda s: seen.setdefault("sharding", s))
        logits, _ = model(input_tokens, positions, None, attention_mask)
        return jnp.mean(logits[..., 0] * input_mask)

    def model_input(x):
        tokens, positions, mask = causal_inputs(x.input_tokens)
        return dict(input_tokens=tokens, input_mask=x.input_mask, positions=positions, attention_mask=mask)

    batch_size = mesh.shape.get("fsdp", 1) * 2
    batch = peft_trainer.TrainingInput(input_tokens=np.full((batch_size, seq_len), 8, np.int32),
                                       input_mask=np.ones((batch_size, seq_len), np.float32))
    ctx = trainer_context(mesh) if context == "trainer" else jax.set_mesh(mesh)
    with ctx:
        config = peft_trainer.TrainingConfig(eval_every_n_steps=1000, max_steps=1, pbar_description=None)
        trainer = peft_trainer.PeftTrainer(model, optax.sgd(1e-9), config)
        trainer.with_loss_fn(loss_fn).with_gen_model_input_fn(model_input).train([batch])
    return seen["sharding"]


def compare_trainer_contexts(model_dir, mesh):
    """The batch's sharding inside a tunix train step under ``jax.set_mesh`` alone vs :func:`trainer_context`."""
    import pandas as pd

    rows = []
    for context, how in (("set_mesh", "with jax.set_mesh(mesh):"), ("trainer", "with mesh_lib.trainer_context(mesh):")):
        sharding = trainer_batch_sharding(load_model(model_dir, mesh), mesh, context=context)
        rows.append({"context": how, "batch spec inside the step": str(sharding.spec),
                     "sharded over fsdp": "fsdp" in str(sharding.spec)})
    return pd.DataFrame(rows)
