"""Sharding audit/fix: every parameter's spec against the mesh, LoRA specs, heads tp cannot divide, the 31B plan."""

import math

import pytest

from gemma_tpu_helpers.course.budget import param_memory
from gemma_tpu_helpers.course.config import tiny
from gemma_tpu_helpers.course.views import model_views
from gemma_tpu_helpers.fixes.model import gemma4, model_size, sharding
from gemma_tpu_helpers.fixes.train import lora


@pytest.fixture(scope="module")
def lora_loaded(tunix_model):
    model, _ = lora.apply_lora(tunix_model, rank=8, alpha=16.0)
    return model


def test_loaded_lora_model_is_clean_and_fully_sharded(lora_loaded, mesh):
    rows = sharding.audit(lora_loaded, mesh)
    assert len(rows) and not sharding.flagged(rows)
    assert {r.kind for r in rows} == {"Param", "LoRAParam"}
    # Bytes per device from the specs agree with what the arrays really hold, parameter by parameter.
    assert all(r.bytes_per_device == r.bytes_per_device_placed for r in rows)
    # A weight sharded on both axes holds 1/8 of its bytes per device.
    q = next(r for r in rows if r.path == "layers/0/attn/q_einsum/w")
    assert q.spec == "('tp', 'fsdp', None)"
    assert q.bytes_per_device * 8 == math.prod(q.shape) * 4


def test_copied_base_spec_on_lora_params_is_flagged_and_derived_back(lora_loaded, mesh):
    """What the paper met: the base weight's spec tuple copied onto LoRA A/B (rank 3 spec on a 2-D array).

    fix() derives the LoRA specs from the base weight's einsum letters; they must equal what qwix 0.1.8 derives.
    """
    from flax import nnx

    model = nnx.clone(lora_loaded)
    originals, changed, wrong_rank = {}, set(), 0
    for path, v in nnx.iter_graph(model):
        if isinstance(v, nnx.LoRAParam):
            module = sharding.module_at(model, path[:-1])
            base_var = getattr(module, str(path[-1]).rsplit("_lora_", 1)[0])
            originals[path] = tuple(v.get_metadata()["out_sharding"])
            copied = tuple(base_var.get_metadata()["out_sharding"])
            v.set_metadata("out_sharding", copied)
            wrong_rank += v.value.ndim != len(copied)
            if copied != originals[path]:
                changed.add("/".join(map(str, path)))
    flagged = sharding.flagged(sharding.audit(model, mesh))
    assert wrong_rank and sum(not r.rank_ok for r in flagged) == wrong_rank
    assert {r.path for r in flagged} == changed
    changes = sharding.fix_shardings(model, mesh)
    assert {c.path for c in changes} >= changed
    assert not sharding.flagged(sharding.audit(model, mesh))
    for path, v in nnx.iter_graph(model):
        if isinstance(v, nnx.LoRAParam):
            assert tuple(v.get_metadata()["out_sharding"]) == originals[path], path


@pytest.fixture(scope="module")
def one_global_kv_head():
    """A 2-layer (sliding + global) model with 1 global KV head, built as tunix builds it (unsharded)."""
    text = dict(tiny.tiny_text_config(6), num_global_key_value_heads=1)
    base = sharding.model_from_config(text, layer_types=["sliding_attention", "full_attention"])
    model, _ = lora.apply_lora(base, rank=4, alpha=8.0)
    return text, model


def test_heads_tp_cannot_divide_flagged_then_fixed_and_compiled(one_global_kv_head, mesh):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    text, model = one_global_kv_head
    assert gemma4.head_divisibility_problems(text, {"tp": 2})  # the loader would refuse this mesh up front
    before = sharding.audit(model, mesh)
    bad = [r for r in before if not r.divides]
    assert [r.path for r in bad] == ["layers/1/attn/k_einsum/w"]
    assert "dim 0 (1) by tp=2" in bad[0].flag
    assert all(r.applied is False for r in before)  # tunix created every variable unsharded
    with pytest.raises(sharding.ShardingError, match="sharding.fix_shardings"):
        sharding.apply_annotations(model, mesh)

    changes = sharding.fix_shardings(model, mesh)
    k = next(c for c in changes if c.path == "layers/1/attn/k_einsum/w")
    assert k.spec_after == "(None, 'fsdp', None)"  # only tp dropped: still sharded 4 ways on fsdp
    after = sharding.audit(model, mesh)
    assert not sharding.flagged(after)
    placed = "bytes_per_device_placed"
    assert model_views.totals(after, placed)["total"] < model_views.totals(before, placed)["total"] / 4

    b, t = 4, 8
    tokens = jnp.ones((b, t), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = jnp.tril(jnp.ones((t, t), bool))[None].repeat(b, 0)
    with mesh:
        logits = nnx.jit(lambda m: m(tokens, pos, None, mask)[0])(model)
    assert logits.shape == (b, t, text["vocab_size"]) and bool(jnp.isfinite(logits).all())
    assert isinstance(logits.sharding, jax.sharding.NamedSharding)


def test_31b_plan_on_v5p8_and_tp8():
    c = gemma4.GEMMA4_31B_TEXT_CONFIG
    summary, before, changes = model_views.plan_lora_sharding(c, (1, 4), rank=64, alpha=64)
    assert summary.attrs["flags"] == 0 and changes.empty
    total_params = model_size.param_count(c)
    lora_params = param_memory.lora_param_count(c, 64, lora.HF_TARGETS)
    # Every weight divides tp=4; only norms (sharded too) and the layer scalars are replicated.
    assert summary.loc["base params", "after fix"] == pytest.approx(total_params * 2 / 4, rel=1e-3)
    assert summary.loc["LoRA params", "paper: LoRA replicated"] == lora_params * 2
    assert summary.loc["LoRA params", "after fix"] < lora_params * 2 / 2

    summary8, before8, changes8 = model_views.plan_lora_sharding(c, (1, 8), rank=64, alpha=64)
    assert set(changes8["path"]) == {"layers/5/attn/k_einsum/w", "layers/5/attn/k_einsum/w_lora_b"}
    assert all("tp=8" in why for why in changes8["why"])
    assert summary8.attrs["flags_after"] == 0
