"""Device meshes for tunix: Auto axis types, and a shape checked against the devices."""

from __future__ import annotations

from .profiles import Profile


class MeshError(ValueError):
    pass


def make_mesh(profile_or_shape: Profile | tuple[int, ...], axes: tuple[str, ...] | None = None, devices=None):
    """A ``jax.sharding.Mesh`` with ``AxisType.Auto`` axes.

    ``jax.make_mesh`` defaults to Explicit axes in this JAX, and tunix's embedding gather then fails, so the
    axis types are set here. The shape's product must equal the number of devices.
    """
    import jax

    if isinstance(profile_or_shape, Profile):
        shape, axes = profile_or_shape.mesh_shape, profile_or_shape.mesh_axes
    else:
        shape = tuple(profile_or_shape)
        if axes is None or len(axes) != len(shape):
            raise MeshError(f"Give one axis name per mesh dimension: shape {shape}, axes {axes}.")
    devices = list(devices if devices is not None else jax.devices())
    size = 1
    for s in shape:
        size *= s
    if size != len(devices):
        raise MeshError(
            f"Mesh {dict(zip(axes, shape))} needs {size} devices but {len(devices)} are visible "
            f"({devices[0].platform}). On CPU set XLA_FLAGS=--xla_force_host_platform_device_count={size} before "
            f"importing JAX (profiles.configure_jax does it), or pick a mesh whose product is {len(devices)}."
        )
    return jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(shape), devices=devices)
