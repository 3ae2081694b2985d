"""LoRA on the routed experts of the tiny 26B-A4B replica (fixes/train/expert_lora.py), on abstract shapes: the count
per expert and layer, and the targets refused. Parity with PEFT and the gradients: tests/e2e/test_tiny_moe.py."""

import numpy as np
import pytest

from gemma_tpu_helpers.course.config import tiny
from gemma_tpu_helpers.fixes.model import layout, sharding
from gemma_tpu_helpers.fixes.train import lora

RANK, EXPERT_RANK, ALPHA = 4, 2, 8.0


def test_each_expert_gets_its_own_lora_and_the_count_is_the_analytic_one():
    text = tiny.tiny_text_config(6, "26b-a4b")
    model = sharding.model_from_config(text, abstract=True)
    targets = lora.HF_TARGETS + lora.EXPERT_TARGETS
    lm, report = lora.apply_lora(model, targets, rank=RANK, alpha=ALPHA, expert_rank=EXPERT_RANK, abstract=True)
    shapes = layout.expert_lora_shapes(text, EXPERT_RANK)
    e, d, f = text["num_experts"], text["hidden_size"], text["moe_intermediate_size"]
    assert shapes["layers/0/moe/gating_einsum_lora_a"] == (e, d, EXPERT_RANK)
    assert shapes["layers/0/moe/gating_einsum_lora_b"] == (e, EXPERT_RANK, 2 * f)
    assert shapes["layers/0/moe/linear_lora_a"] == (e, f, EXPERT_RANK)
    assert shapes["layers/0/moe/linear_lora_b"] == (e, EXPERT_RANK, d)
    for path, shape in shapes.items():
        layer, _, name = path.split("/", 3)[1:]
        assert tuple(getattr(lm.layers[int(layer)].moe, name).value.shape) == shape, path
    experts = sum(int(np.prod(s)) for s in shapes.values())
    assert experts == 6 * e * EXPERT_RANK * (d + 2 * f + f + d)
    dense = layout.lora_param_count(text, RANK, lora.HF_TARGETS)
    assert report.attrs["lora_params"] == dense + experts
    got = report[report["target"].isin(lora.EXPERT_TARGETS)].groupby("target")["LoRA params"].sum()
    assert got["experts.gate_up_proj"] == 6 * e * EXPERT_RANK * (d + 2 * f)
    assert got["experts.down_proj"] == 6 * e * EXPERT_RANK * (f + d)
    assert report[report["target"] == "router.proj"]["LoRA params"].sum() == 0  # the router keeps no LoRA
    assert f"{experts:,} LoRA parameters reach them" in report.attrs["experts"]
    assert report.attrs["expert_rank"] == EXPERT_RANK


def test_expert_targets_on_a_dense_model_are_refused(tunix_model):
    with pytest.raises(lora.LoraCoverageError, match="no routed experts"):
        lora.apply_lora(tunix_model, ["q_proj", "experts.down_proj"], rank=2, abstract=True)
    with pytest.raises(lora.LoraConfigError, match="experts.gate_up_proj and experts.down_proj"):
        lora.validate_targets(["q_proj", "experts"])


# ------------------------------------------------------------------------------------------ QLoRA: nf4 experts

def _compute_layout(row, w):
    """An expert weight as tunix hands it to ragged_dot, (E, in, out): gating_einsum (E, 2, I, D) -> (E, D, 2I)."""
    if row.param == "gating_einsum":
        e, _, i, d = w.shape
        return np.transpose(w, (0, 3, 1, 2)).reshape(e, d, 2 * i)
    return w


def test_nf4_experts_are_within_the_rounding_bound_of_nf4():
    """Each weight rounds to the nearest of nf4's 16 levels times its tile's scale (the tile's absmax), so it moves
    by at most half the widest gap between levels times that scale; an expert's matmul then moves by at most
    sum_k |x_k| * that, plus fp32's summation bound of the two dots (2 * in * 2^-24 * sum_k |x_k| |w_k|)."""
    import jax
    import jax.numpy as jnp
    from qwix._src.core import numerics, qarray
    from qwix._src.utils import flax_util

    from gemma_tpu_helpers.fixes.train import expert_lora

    text = tiny.tiny_text_config(6, "26b-a4b")
    model = sharding.model_from_config(text, layer_types=["sliding_attention"])
    moe = model.layers[0].moe
    before = {row.param: np.asarray(getattr(moe, row.param).value) for row in layout.EXPERT_ROWS}
    tile = 64
    expert_lora.quantize_experts(model, "nf4", tile)
    half_gap = float(np.diff(np.asarray(numerics.get_nf4_buckets())).max()) / 2  # 0.152, at the -1 end
    eps = 2.0**-24
    rng = np.random.default_rng(0)
    e = text["num_experts"]
    sizes = np.array([7, 0, 3, 12, 1, 5, 0, 4])[:e]  # rows per expert, two experts with none
    for row in layout.EXPERT_ROWS:
        box = getattr(moe, row.param)
        assert isinstance(box, expert_lora.quantized_class())
        assert flax_util.unbox(box.array.qvalue).dtype == jnp.uint4  # 4 bits a weight
        w, wq = before[row.param], np.asarray(box.value)
        assert (wq == np.asarray(qarray.dequantize(flax_util.unbox(box.array)))).all()  # qwix's values, to the bit
        scale = np.repeat(np.asarray(flax_util.unbox(box.array.scale)), tile, axis=row.contracted)
        assert scale.shape == w.shape
        assert (np.abs(w - wq) <= half_gap * scale + eps * np.abs(wq)).all(), row.param
        wc, wqc, sc = (_compute_layout(row, a) for a in (w, wq, half_gap * scale))
        x = rng.standard_normal((int(sizes.sum()), wc.shape[1])).astype(np.float32)
        dot = lambda a, b: np.asarray(jax.lax.ragged_dot(jnp.asarray(a), jnp.asarray(b), jnp.asarray(sizes)))  # noqa: E731
        moved = np.abs(dot(x, wc) - dot(x, wqc))
        bound = dot(np.abs(x), sc) + 2 * wc.shape[1] * eps * (dot(np.abs(x), np.abs(wc)) + dot(np.abs(x), np.abs(wqc)))
        assert (moved <= bound).all(), (row.param, float((moved / bound).max()))
        rel = float(np.linalg.norm(moved) / np.linalg.norm(dot(x, wc)))
        print(f"{row.param}: nf4 vs fp32 expert matmul, max |diff| / bound = {(moved / bound).max():.3f}, "
              f"relative norm of the difference {rel:.3f}")


def test_qlora_quantizes_the_experts_and_their_lora_trains():
    """QLoRA on the MoE: the dense targets in nf4 (qwix), the experts in nf4 too (targeted or not), each expert's
    LoRA on top; a few steps on one batch lower the loss and move the experts' B."""
    import jax.numpy as jnp
    from flax import nnx
    from qwix._src.utils import flax_util

    from gemma_tpu_helpers.fixes.train import expert_lora
    from support import lora_train_steps

    text = tiny.tiny_text_config(6, "26b-a4b")
    targets = lora.HF_TARGETS + lora.EXPERT_TARGETS
    plain = lora.apply_lora(sharding.model_from_config(text, abstract=True), targets, rank=RANK, alpha=ALPHA,
                            expert_rank=EXPERT_RANK, abstract=True)[1]
    abstract, report = lora.apply_lora(sharding.model_from_config(text, abstract=True), targets, rank=RANK,
                                       alpha=ALPHA, expert_rank=EXPERT_RANK, qlora="nf4", abstract=True)
    assert report.attrs["lora_params"] == plain.attrs["lora_params"]  # the same LoRA, on a quantized base
    assert lora.base_param_count(abstract) == plain.attrs["base_params"]  # scales not counted as parameters
    box = expert_lora.quantized_class()
    for layer in abstract.layers:
        assert all(flax_util.unbox(getattr(layer.moe, row.param).array.qvalue).dtype == jnp.uint4
                   for row in layout.EXPERT_ROWS)

    model, _ = lora.apply_lora(sharding.model_from_config(text, layer_types=["sliding_attention"]),
                               targets, rank=RANK, alpha=ALPHA, expert_rank=EXPERT_RANK, qlora="nf4")
    assert all(isinstance(getattr(layer.moe, row.param), box) for layer in model.layers for row in layout.EXPERT_ROWS)
    b_before = {p: v.value.copy() for p, v in nnx.iter_graph(model) if p and str(p[-1]).endswith("_lora_b")}
    assert any("moe" in p for p in b_before)
    losses = lora_train_steps(model, steps=3)
    assert losses[-1] < losses[0], losses
    moved = {p for p, v in nnx.iter_graph(model) if p in b_before and not jnp.array_equal(v.value, b_before[p])}
    assert {p[-1] for p in moved if "moe" in p} == {"gating_einsum_lora_b", "linear_lora_b"}


# ------------------------------------------------------------------------- the experts' matmuls and their VJP

def _grouped_inputs(m: int, k: int, n: int, r: int, integers: bool):
    """Rows sorted into 4 groups (one empty, one across the middle row, where a 2-way row split cuts), x (m, k),
    A (4, k, r), B (4, r, n), a frozen W (4, k, n) and a cotangent (m, n), in fp32. ``integers``: small integers,
    so every product and sum of the matmuls and their gradients is exact in fp32 (all below 2^24): any order of
    summation gives the same bits, and two kernels must agree exactly."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    draw = ((lambda *s: rng.integers(-2, 3, s)) if integers else (lambda *s: rng.standard_normal(s)))
    sizes = np.array([m // 2 - 8, 0, 24, m // 2 - 16])
    arrays = [draw(m, k), draw(4, k, r), draw(4, r, n), draw(4, k, n), draw(m, n)]
    return jnp.asarray(sizes, jnp.int32), *(jnp.asarray(a, jnp.float32) for a in arrays)


def _two_ragged_dots(x, a, b, gs, scale):
    import jax

    return jax.lax.ragged_dot(jax.lax.ragged_dot(x, a, gs), b, gs) * scale


def test_the_experts_lora_backward_is_autodiffs_with_the_weight_gradients_tied_to_the_input_gradient():
    """lora_delta on the CPU kernel gives the bits autodiff of the two ragged_dots gives (the same matmuls in the
    same order), for the value and the gradients of x, A and B; its backward ties dA and dB to dx with one
    optimization barrier (docs/moe-experts.md: without it XLA:TPU computes them at the end of the step)."""
    import jax

    from gemma_tpu_helpers.fixes.train import expert_lora

    gs, x, a, b, _, ct = _grouped_inputs(64, 48, 40, 4, integers=False)
    ours, vjp = jax.vjp(lambda *v: expert_lora.lora_delta(*v, gs, 0.25), x, a, b)
    ref, ref_vjp = jax.vjp(lambda *v: _two_ragged_dots(*v, gs, 0.25), x, a, b)
    assert (ours == ref).all()
    for got, want, name in zip(vjp(ct), ref_vjp(ct), ("x", "A", "B")):
        assert got.shape == want.shape and (got == want).all(), name
    jaxpr = str(jax.make_jaxpr(lambda *v: jax.vjp(lambda *w: expert_lora.lora_delta(*w, gs, 0.25), *v)[1](ct))(
        x, a, b))
    barriers = [line for line in jaxpr.splitlines() if "optimization_barrier" in line]
    assert len(barriers) == 1 and barriers[0].count("f32[") == 3, barriers  # (dx, dA, dB) together


def test_megablox_on_a_mesh_equals_ragged_dot_exactly_on_exact_inputs(mesh):
    """The TPU kernel (megablox's gmm / tgmm, Pallas interpret mode on this CPU) on a fsdp=2 x tp=2 mesh, the rows
    split over fsdp and K over tp with a partial last tile (176 = 128 + 48 a shard), against ragged_dot: on small
    integers both are exact, so they must agree to the bit, for each matmul, the LoRA delta and its gradients. A
    row given to the wrong shard or group, a lost partial sum or a misplaced tile changes integers."""
    import jax
    from jax.sharding import Mesh

    from gemma_tpu_helpers.fixes.train import expert_lora

    grid = Mesh(np.asarray(mesh.devices).reshape(-1)[:4].reshape(2, 2), ("fsdp", "tp"))
    gs, x, a, b, w, ct = _grouped_inputs(256, 352, 200, 8, integers=True)
    tpu = dict(kernel="megablox", mesh=grid, interpret=True)

    @jax.jit
    def both(x, a, b, w, ct):
        out = {kind: (expert_lora.grouped(kind, p, q, gs), expert_lora.grouped(kind, p, q, gs, **tpu))
               for kind, (p, q) in {"fwd": (x, w), "bwd": (ct, w), "wgrad": (x, ct)}.items()}
        for name, kw in (("ragged", {}), ("megablox", tpu)):
            value, vjp = jax.vjp(lambda *v: expert_lora.lora_delta(*v, gs, 0.5, **kw), x, a, b)
            out[name] = (value, *vjp(ct))
        return out

    out = both(x, a, b, w, ct)
    for kind in ("fwd", "bwd", "wgrad"):
        ref, got = out[kind]
        assert got.shape == ref.shape and (got == ref).all(), kind
    assert float(abs(out["ragged"][0]).max()) > 100  # not a test of zeros
    for ref, got, name in zip(out["ragged"], out["megablox"], ("delta", "dx", "dA", "dB")):
        assert got.shape == ref.shape and (got == ref).all(), name
