"""The AOT plan compiled for real: the train step for a v5p (libtpu's abstract devices) in this process, about
80 s on 2 cores. The plan's arithmetic, its shipped points and its messages: tests/fast/test_plan.py."""

import importlib.util
import math

import pytest

from gemma_tpu_helpers.course.budget import plan, predictions
from gemma_tpu_helpers.course.config import profiles, tiny
from gemma_tpu_helpers.fixes.model import layout, model_size

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
TINY = tiny.tiny_text_config(6)


def shard_bytes(tree) -> int:
    """Bytes one device holds of abstract, sharded arrays."""
    import math

    import jax

    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


@needs_libtpu
# runs in CI (not slow); notebook 04 compiles the same tiny step for a v5p in every `make test`
def test_aot_compile_for_v5p_in_this_process(smoke):
    """The tiny config (2 layers) train step compiled for the v5p-8 topology next to the 8 virtual CPU devices: XLA's
    per-chip arguments match the sharded argument bytes, the optimizer state is donated, and DECODER remat needs
    less temp memory than none."""
    import dataclasses

    import jax
    from flax import nnx

    from gemma_tpu_helpers.fixes.train import step

    v5p = profiles.get_profile("v5p-8")
    kw = dict(text_config=TINY, batch=1, rank=8, alpha=16.0, dtype="bfloat16")
    none = plan.compile_train_step(v5p, "none", 1024, 2, **kw)
    dec = plan.compile_train_step(v5p, "decoder", 1024, 2, **kw)
    assert jax.device_count() == 8 and jax.devices()[0].platform == "cpu"  # the CPU platform is untouched
    two = plan.with_layers(TINY, 2)
    base = model_size.param_count(two)
    # Every argument of the step as training shards it (base weights and LoRA by their partition specs over tp=4,
    # the optimizer state like its LoRA param), bf16. XLA's TPU layouts pad small minor dims to 128 lanes (LoRA
    # A's rank 8), so the compiled figure is somewhat above the element count.
    model, optimizer, batch = step.abstract_arguments(two, plan.topology_mesh(v5p), dataclasses.replace(
        v5p.lora, rank=8, alpha=16.0), v5p.train, 1, 1024, dtype="bfloat16")
    expected = shard_bytes(nnx.state(model)) + shard_bytes(nnx.state(optimizer)) + shard_bytes(batch)
    assert expected <= none["argument_bytes"] < 1.3 * expected
    assert step.argument_bytes(model, optimizer, batch) == expected  # what an HBM-OOM point reports as arguments
    # sft.jitted donates both; XLA aliases nearly all of it (93% here: a few small buffers change layout)
    donated = shard_bytes(nnx.state(model)) + shard_bytes(nnx.state(optimizer))
    assert 0.9 * donated <= none["alias_bytes"] < 1.3 * donated
    print(f"tiny on v5p: temp none {none['temp_bytes'] / 2**20:.1f} MiB, decoder {dec['temp_bytes'] / 2**20:.1f} MiB")
    assert dec["temp_bytes"] < none["temp_bytes"]  # tiny activations: 10.5 vs 11.5 MiB here

    # XLA's cost analysis is per chip: times 4 chips it is the analytic count (matmuls; XLA adds the elementwise
    # work), and DECODER remat shows as one more forward of the layers
    targets = profiles.get_profile("smoke").lora.targets
    for point, policy in ((none, "none"), (dec, "decoder")):
        analytic = predictions.analytic_step_flops(two, 1, 1024, 8, targets, policy)
        ratio = point["flops"] * 4 / analytic["total"]
        print(f"tiny {policy}: XLA {point['flops'] * 4 / 1e9:.2f} GFLOP vs analytic {analytic['total'] / 1e9:.2f}")
        assert 1.0 <= ratio < 1.10 and point["bytes_accessed"] > base * 2 / 4
    # QLoRA: the same step with the targeted frozen weights in nf4 (4 bits + a bf16 scale per 64-element tile)
    q = plan.compile_train_step(v5p, "none", 1024, 2, qlora="nf4", **kw)
    targeted = sum(math.prod(s) for s in layout.targeted_weights(two).values()) * 2 / 4  # bf16 bytes per chip (tp=4)
    print(f"tiny on v5p: arguments LoRA {none['argument_bytes'] / 2**20:.2f} MiB, "
          f"QLoRA {q['argument_bytes'] / 2**20:.2f}")
    assert q["qlora"] == "nf4" and none["qlora"] is None
    assert none["argument_bytes"] - q["argument_bytes"] > 0.5 * targeted
    compiled_plan = dataclasses.replace(plan.assemble_plan(v5p, "decoder", 1024, [dec], 2, 2), lora_rank=8)  # rank 8
    pred = predictions.predict_run(compiled_plan, v5p, text_config=TINY)
    assert pred["xla_over_analytic"] == pytest.approx(dec["flops"] * 4 / predictions.analytic_step_flops(
        two, 1, 1024, 8, v5p.lora.targets, "decoder")["total"])
    assert pred["micro_step_s"] == max(dec["flops"] / 459e12, dec["bytes_accessed"] / 2765e9)
