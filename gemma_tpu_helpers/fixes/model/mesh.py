"""Device meshes for tunix: Auto axis types, and a shape checked against the devices."""

from __future__ import annotations

import contextlib
import warnings

from ..core.errors import GemmaTpuError


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
