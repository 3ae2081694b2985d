"""The merge folds the 26B-A4B's router ``per_expert_scale`` into ``experts.down_proj`` (issue 60 item 5).

transformers, vLLM's CPU build and tunix multiply expert e's output by s_e; tpu-inference never applies it. The merged
checkpoint therefore carries s_e·(W_e + ΔW_e) in each expert's down_proj and ones in per_expert_scale: the same model
on every server. Here on the tiny MoE replica (its scales drawn in [0.75, 1.25], as a trained checkpoint's are not 1),
in fp32 and in bf16 (as the real files are), with and without LoRA on the experts; `verify --weights` knows the fold
from merge_info.json; a dense model merges bit for bit as before."""

import json
import shutil

import numpy as np
import pytest

from gemma_tpu_helpers import __main__ as cli
from gemma_tpu_helpers.course.config import tiny
from gemma_tpu_helpers.fixes.export import merge, merge_plan, weight_check
from gemma_tpu_helpers.fixes.model import gemma4, layout
from gemma_tpu_helpers.fixes.train import lora_checkpoint
from support import bf16_copy, lora_ckpt, model_tensor

PRE = gemma4.KEY_PREFIX
RANK, ALPHA = 4, 8.0
U = 2.0 ** -24  # fp32's unit roundoff
UNIT = {"float32": 0.0, "bfloat16": 2.0 ** -8}  # the stored dtype's unit roundoff beyond fp32's (fp32: none)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """The MoE replica in fp32 and bf16, each with two LoRA checkpoints: attention + MLP + experts, and attention +
    MLP only (down_proj then gets the fold alone)."""
    d = tmp_path_factory.mktemp("fold")
    fp32 = tiny.write_tiny_model(d / "fp32" / "base", seed=0, layers=6, variant="26b-a4b")
    out = {"float32": fp32, "bfloat16": bf16_copy(fp32, d / "bf16" / "base")}
    text = gemma4.read_text_config(fp32)
    rng = np.random.default_rng(7)
    for base in out.values():
        for experts in (True, False):
            targets = list(layout.TARGETS) + (list(layout.EXPERT_TARGETS) if experts else [])
            arrays = layout.synthetic_lora(text, list(layout.TARGETS), RANK, seed=1, std=0.05)
            if experts:
                arrays.update({k: (rng.standard_normal(s) * 0.05).astype(np.float32)
                               for k, s in layout.expert_lora_shapes(text, RANK).items()})
            meta = {"targets": targets, "rank": RANK, "alpha": ALPHA, "num_layers": text["num_hidden_layers"]}
            lora_checkpoint.write_lora_checkpoint(base.parent / f"ckpt_{experts}", arrays, meta, step=1)
    return out


def _ckpt(base, experts):
    return base.parent / f"ckpt_{experts}"


@pytest.mark.parametrize("experts", [True, False], ids=["expert-lora", "fold-only"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_down_proj_is_scaled_per_expert_and_the_scale_is_one(moe, tmp_path, dtype, experts):
    """merged down_proj[e] = round(s_e·(W_e + ΔW_e)) against the exact value in fp64, within what the merge's fp32
    arithmetic and one rounding to the stored dtype allow: |s|·(r+1)·u·Σ|scale·aᵢ·bᵢ| (the rank-r dot), 2u|ref| (the
    sum's and the product's fp32 roundings), u_D|ref| (the stored dtype's: bf16's 2⁻⁸, fp32's none). A skipped fold
    is |s_e - 1| ≥ 2.6e-2 of |W| off on the replica: over 10⁵ of that bound in fp32, over 3 in bf16."""
    base = moe[dtype]
    out = merge.merge_lora(base, _ckpt(base, experts), tmp_path / "m", progress=False).out_dir
    info = merge.read_merge_info(out)
    assert info["fold_expert_scale"] is True
    text = gemma4.read_text_config(base)
    meta = lora_checkpoint.read_lora_config(_ckpt(base, experts))
    _, arrays = lora_checkpoint.restore_lora(_ckpt(base, experts))
    deltas = {d.hf: d for d in merge_plan.plan_merge(arrays, meta, text)}
    worst, n_layers = 0.0, text["num_hidden_layers"]
    for i in range(n_layers):
        s = model_tensor(base, f"{PRE}layers.{i}.router.per_expert_scale").astype(np.float64)
        assert np.ptp(s) > 0.1  # learned-looking scales: the fold shows
        got_s = model_tensor(out, f"{PRE}layers.{i}.router.per_expert_scale")
        assert got_s.dtype == model_tensor(base, f"{PRE}layers.{i}.router.per_expert_scale").dtype
        assert np.all(got_s.astype(np.float64) == 1.0)
        name = f"{PRE}layers.{i}.experts.down_proj"
        w = model_tensor(base, name).astype(np.float64)
        got = model_tensor(out, name).astype(np.float64)
        d = deltas.get(name)
        if d is None:
            dw, dot = 0.0, 0.0
        else:
            a, b = d.a.astype(np.float64), d.b.astype(np.float64)  # (E, in, r), (E, r, out)
            dw = d.scale * np.einsum("eir,ero->eoi", a, b)
            dot = abs(d.scale) * np.einsum("eir,ero->eoi", np.abs(a), np.abs(b))
        ref = s[:, None, None] * (w + dw)
        bound = np.abs(s)[:, None, None] * (RANK + 1) * U * dot + (2 * U + UNIT[dtype]) * np.abs(ref) * 1.001
        bound = np.maximum(bound, np.finfo(np.float32).tiny)
        worst = max(worst, float((np.abs(got - ref) / bound).max()))
    print(f"\n{dtype} {'expert LoRA' if experts else 'fold only'}: max |down_proj - s·(W + ΔW)| / bound = {worst:.3f}")
    assert worst <= 1.0


def test_a_dense_model_merges_bit_for_bit_as_before(tiny_dir, tmp_path):
    """The 31B replica has no per_expert_scale: the fold changes nothing, not a byte of a shard."""
    ckpt = lora_ckpt(tiny_dir, tmp_path / "ckpt")
    on = merge.merge_lora(tiny_dir, ckpt, tmp_path / "on", progress=False)
    off = merge.merge_lora(tiny_dir, ckpt, tmp_path / "off", progress=False, fold_expert_scale=False)
    assert on.info["fold_expert_scale"] is False and on.merged_tensors == off.merged_tensors
    shards = sorted(p.name for p in tiny_dir.glob("*.safetensors"))
    assert len(shards) > 1
    for shard in shards:
        assert (on.out_dir / shard).read_bytes() == (off.out_dir / shard).read_bytes(), shard


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_weights_knows_the_fold(moe, tmp_path, capsys, dtype):
    """`verify --weights` passes a folded merge (from merge_info.json) and an unfolded one; a merge whose fold was
    skipped but recorded as folded fails, naming per_expert_scale and each down_proj."""
    base = moe[dtype]
    ckpt = _ckpt(base, True)
    folded = merge.merge_lora(base, ckpt, tmp_path / "folded", progress=False).out_dir
    res = weight_check.verify_weights(base, ckpt, folded, progress=False)
    assert res.ok and res.fold_expert_scale, res.problems[:3]
    assert res.ones_tensors == 6 and res.max_excess <= 1.0
    print(f"\n{dtype} folded: {res.max_ulps} ulp at most, {res.max_excess:.3f} of the allowed rounding")
    plain = merge.merge_lora(base, ckpt, tmp_path / "plain", progress=False, fold_expert_scale=False).out_dir
    res = weight_check.verify_weights(base, ckpt, plain, progress=False)
    assert res.ok and not res.fold_expert_scale and res.ones_tensors == 0, res.problems[:3]
    assert sum(".per_expert_scale" in r.tensor and r.kind == "copied" for r in res.tensors) == 6
    lie = tmp_path / "lie"  # the fold skipped, merge_info.json saying it was done
    shutil.copytree(plain, lie)
    info = json.loads((lie / "merge_info.json").read_text())
    (lie / "merge_info.json").write_text(json.dumps({**info, "fold_expert_scale": True}))
    res = weight_check.verify_weights(base, ckpt, lie, progress=False)
    assert not res.ok and res.params == ["fold_expert_scale"]
    for i in range(6):
        assert any(p.startswith(f"{PRE}layers.{i}.router.per_expert_scale in ") and "is [" in p
                   and "not 1: merge_info.json records fold_expert_scale, but the scale was not folded" in p
                   for p in res.problems), res.problems
        assert any(p.startswith(f"{PRE}layers.{i}.experts.down_proj in ")
                   and "ulps from per_expert_scale x (base + ΔW) of step 1" in p for p in res.problems)
    assert len(res.problems) == 12
    rc = cli.main(["verify", "--weights", "--base", str(base), "--checkpoint", str(ckpt), "--merged", str(lie)])
    out = capsys.readouterr().out
    assert rc == 1 and out.rstrip().endswith("verify --weights: FAILED (12 problem(s))"), out[-3000:]
    assert f"FAILED: {PRE}layers.0.router.per_expert_scale in " in out
