"""The weight check on a bf16 run, as the real files are stored: train, merge and verify --weights (about 40 s).
The check's rules on synthetic LoRAs: tests/fast/test_weight_check.py."""

import pandas as pd

from gemma_tpu_helpers.fixes.export import merge, weight_check
from gemma_tpu_helpers.fixes.model import gemma4
from gemma_tpu_helpers.fixes.train import lora_checkpoint
from support import bf16_copy, lora_ckpt, short_rows


def test_bf16_train_merge_verify(smoke, tiny_dir, tmp_path, mesh, monkeypatch):
    """The real checkpoints are bf16: train on a bf16 copy of the replica, merge (bf16 files out), verify. The loader
    gives fp32 parameters when asked (tunix kept the files' bf16, so the fp32 reference had bf16 LoRA factors); the
    logits run on the merge's unrounded fp32 twin within the port's bound, (c) checks transformers and tunix read the
    bf16 files alike, and a layout bug in the merge plan (which the weight check shares) still fails on the logits."""
    from flax import nnx

    from gemma_tpu_helpers.course.training import train
    from gemma_tpu_helpers.fixes.export import merge_plan, verify

    base = bf16_copy(tiny_dir, tmp_path / "base")
    model = gemma4.load_model(base, mesh, dtype="float32")
    assert {str(v.value.dtype) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))} == {"float32"}
    del model
    train.train(short_rows(smoke), run_dir=tmp_path / "run", base_dir=base, max_steps=2, checkpoint_every=2,
                progress=False)
    ckpt = tmp_path / "run" / "checkpoints"
    merged = merge.merge_lora(base, ckpt, tmp_path / "merged", progress=False).out_dir
    res = verify.verify_merge(base, ckpt, merged, mesh=mesh)
    print(pd.DataFrame(res.rows).to_string())
    rows = {r.comparison[:3]: r for r in res.rows}
    assert res.ok and res.stored_dtype == "BF16" and res.weights.ok, res.rows
    assert res.bound == verify.PORT_FACTOR * res.port_rel and rows["(c)"].rel <= res.bound
    assert res.lora_effect_rel > 10 * res.bound and res.storage_rel > res.bound  # bf16 rounding shows
    print(f"changed {res.weights.changed_share:.1%} of the targeted elements")
    assert not res.notes  # bf16 keeps most of this LoRA's effect (2 steps at smoke's rate: 0.42 of the logits)
    weak = lora_ckpt(base, tmp_path / "weak", std=1e-3)  # a ΔW mostly under bf16's rounding: the merge loses it
    res = verify.verify_merge(base, weak,
                        merge.merge_lora(base, weak, tmp_path / "weak_merged", progress=False).out_dir, mesh=mesh)
    assert res.ok and any("of the LoRA's own effect" in n for n in res.notes), res.notes
    assert res.weights.changed_share < weight_check.KEPT_SHARE  # and the weight check, which runs on the 31B
    assert any("of the targeted elements" in n for n in res.weights.notes), res.weights.notes

    _, arrays = lora_checkpoint.restore_lora(ckpt)
    strong = tmp_path / "strong"
    lora_checkpoint.write_lora_checkpoint(strong, verify.perturbed_lora(arrays), lora_checkpoint.read_lora_config(ckpt),
                                          step=3)
    real_plan = merge_plan.plan_merge

    def swapped(arrays, meta, text):  # a plan that puts k's update into v_proj and v's into k_proj
        deltas = real_plan(arrays, meta, text)
        for d in deltas:
            if d.module.endswith("kv_einsum"):
                d.hf = d.hf.replace("k_proj", "TMP").replace("v_proj", "k_proj").replace("TMP", "v_proj")
        return deltas

    monkeypatch.setattr(merge_plan, "plan_merge", swapped)  # merge and weight check share the plan: only logits tell
    bad = merge.merge_lora(base, strong, tmp_path / "bad", progress=False).out_dir
    res = verify.verify_merge(base, strong, bad, mesh=mesh)
    assert res.weights.ok and not res.ok, res.rows
    assert res.rows[0].rel > 1e-2 and res.rows[1].rel > 1e-2
