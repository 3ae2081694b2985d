"""Compatibility shims for the pinned tunix / qwix, all in this one module.

Nothing here runs at import time: every shim is applied by an explicit call (``lora.apply_lora(qlora=...)`` calls
:func:`patch_gemma4_qlora_einsum` for you) and can be undone. ``tests/test_lora.py`` runs the unpatched path and
expects it to fail (``xfail(strict=True)``): when upstream fixes the bug that test starts passing, pytest reports
it as XPASS-strict, and the shim can be deleted.

Shims
-----
``gemma4_qlora_einsum`` (tunix 0.1.7, qwix 0.1.8)
    tunix's Gemma 4 ``Einsum.__call__`` does ``w = jnp.astype(self.w.value, self.dtype)``. After qwix QLoRA
    (``weight_qtype="nf4"``) the weight is a ``qwix ... ptq.WithAux`` holding the quantized array, and
    ``jnp.astype`` rejects it: ``TypeError: astype requires ndarray or scalar arguments, got <class
    'qwix._src.providers.ptq.WithAux'>`` at the first training step (model application during
    ``apply_lora_to_model`` still works, because the weight is quantized only afterwards). ``WithAux.astype`` is no
    way out either (qwix 0.1.8 raises ``Unsupported type: QArray``). The shim skips the cast for a quantized weight
    and hands it to ``jnp.einsum`` as it is: qwix intercepts that einsum and does the nf4 matmul (the weight's
    dtype is the model's param dtype already).
"""

from __future__ import annotations

import contextlib

_ORIGINALS: dict[str, object] = {}


def _einsum_cls():
    from tunix.models.gemma4 import model as gm

    return gm.Einsum


def patch_gemma4_qlora_einsum() -> bool:
    """Make tunix's Gemma 4 ``Einsum`` accept a qwix-quantized weight. Idempotent; True if it changed anything."""
    if "gemma4_qlora_einsum" in _ORIGINALS:
        return False
    import jax.numpy as jnp
    from qwix._src.providers import ptq

    cls = _einsum_cls()
    original = cls.__call__

    def __call__(self, x):
        w = self.w.value
        if not isinstance(w, ptq.WithAux):
            return original(self, x)
        if self.w_scale is not None:  # only the per-layer-input projection (E2B/E4B) uses it
            raise NotImplementedError("QLoRA on a Gemma 4 Einsum with w_scale (per-layer inputs) is not supported.")
        x = jnp.astype(x, self.dtype)
        return jnp.einsum(self.einsum_str, x, w)  # qwix's einsum takes the quantized weight as it is

    __call__.__wrapped__ = original
    cls.__call__ = __call__
    _ORIGINALS["gemma4_qlora_einsum"] = original
    return True


def unpatch_gemma4_qlora_einsum() -> bool:
    """Restore tunix's own ``Einsum.__call__``. True if a patch was removed."""
    original = _ORIGINALS.pop("gemma4_qlora_einsum", None)
    if original is None:
        return False
    _einsum_cls().__call__ = original
    return True


def applied() -> list[str]:
    """Names of the shims currently in effect."""
    return sorted(_ORIGINALS)


@contextlib.contextmanager
def unpatched():
    """Run a block with tunix as shipped (to check whether upstream still needs the shims)."""
    was = "gemma4_qlora_einsum" in _ORIGINALS
    unpatch_gemma4_qlora_einsum()
    try:
        yield
    finally:
        if was:
            patch_gemma4_qlora_einsum()
