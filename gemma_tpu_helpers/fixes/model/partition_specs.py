"""PartitionSpec arithmetic on plain shapes: the bytes one device holds, the dims a mesh cannot divide, and the
spec with only the offending axes dropped. ``sizes`` maps mesh axis names to their sizes (``dict(mesh.shape)``).
And where a flax variable keeps its annotation (:func:`annotated_spec`)."""

from __future__ import annotations

import math

SPEC_KEYS = ("out_sharding", "sharding_names", "sharding")  # flax's metadata keys for an annotation, newest first


def annotated_spec(variable) -> tuple[tuple | None, str | None]:
    """An nnx variable's annotated spec and the metadata key that holds it; ``(None, None)`` when it has none."""
    md = variable.get_metadata()
    for key in SPEC_KEYS:
        if md.get(key) is not None:
            return tuple(md[key]), key
    return None, None


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of one spec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def axis_size(sizes: dict[str, int], entry) -> int:
    return math.prod(sizes[a] for a in axes_of(entry))


def dtype_bits(dtype) -> int:
    from jax._src import dtypes

    return dtypes.itemsize_bits(dtype)


def bytes_per_device(shape, dtype, spec, sizes) -> int:
    per = list(shape)
    for i, entry in enumerate(spec or ()):
        if i < len(per) and entry is not None:
            per[i] = -(-per[i] // axis_size(sizes, entry))
    return math.prod(per) * dtype_bits(dtype) // 8


def indivisible_dims(shape, spec, sizes) -> list[str]:
    out = []
    for i, entry in enumerate(spec or ()):
        if i >= len(shape) or entry is None:
            continue
        n = axis_size(sizes, entry)
        if shape[i] % n:
            out.append(f"dim {i} ({shape[i]}) by {'x'.join(axes_of(entry))}={n}")
    return out


def divisible_spec(shape, spec, sizes) -> tuple:
    """Drop only the mesh axes that cannot divide their dim (and repeated axes); keep everything else."""
    out, used = [], set()
    for i, entry in enumerate(spec):
        axes = [a for a in axes_of(entry) if a not in used]
        while axes and shape[i] % math.prod(sizes[a] for a in axes):
            # drop the axis whose removal keeps the most sharding that divides
            axes = max(([b for b in axes if b != a] for a in axes),
                       key=lambda rest: (shape[i] % max(1, math.prod(sizes[b] for b in rest)) == 0,
                                         math.prod(sizes[b] for b in rest)))
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return tuple(out)

