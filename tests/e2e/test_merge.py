"""The merge (merge.py and the modules it calls: lora_checkpoint, merge_plan, safetensors_io), verify.py and
peft_export.py: Orbax LoRA -> streamed safetensors merge, verification against transformers/tunix, PEFT export."""

import argparse
import errno
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gemma_tpu_helpers.course.commands import commands_train
from gemma_tpu_helpers.course.commands.cli import run_cli
from gemma_tpu_helpers.course.training import profile_steps
from gemma_tpu_helpers.fixes.export import merge, merge_plan, peft_export, safetensors_io, verify, weight_check
from gemma_tpu_helpers.fixes.model import gemma4, hf_checkpoint
from gemma_tpu_helpers.fixes.train import lora_checkpoint
from support import SMOKE_RUN_EVERY, SMOKE_RUN_STEPS, shard_tensors

LOCAL, GLOBAL = 5, 1  # the tiny model's 6 layers: 5 sliding, 1 global (k=v)
STEPS, EVERY = SMOKE_RUN_STEPS, SMOKE_RUN_EVERY


@pytest.fixture(scope="module")
def trained(smoke_run):
    """The checkpoints of conftest's smoke run (the real trainer: steps EVERY and STEPS). Read-only: copy first."""
    return smoke_run[0] / "checkpoints"


@pytest.fixture(scope="module")
def strong(trained, tmp_path_factory):
    """The trained LoRA with random B: after a few steps B is ~1e-3, too weak to expose a wrong layout."""
    _, arrays = lora_checkpoint.restore_lora(trained)
    ckpt = tmp_path_factory.mktemp("strong") / "checkpoints"
    lora_checkpoint.write_lora_checkpoint(ckpt, verify.perturbed_lora(arrays, seed=1),
                                          lora_checkpoint.read_lora_config(trained), step=3)
    return ckpt


@pytest.fixture(scope="module")
def merged(tiny_dir, strong, tmp_path_factory):
    out = tmp_path_factory.mktemp("merged_parent") / "merged"
    merge.merge_lora(tiny_dir, strong, out, progress=False)
    return out


def _expected_delta(arrays, layer, target, kind, scale):
    """ΔW [out, in] from the raw tunix arrays, written out per layout with einsums
    (independent of merge_plan.plan_merge)."""
    p = f"layers/{layer}/"
    if target == "q_proj":
        a, b = arrays[p + "attn/q_einsum/w_lora_a"], arrays[p + "attn/q_einsum/w_lora_b"]
        return scale * np.einsum("dr,rnh->nhd", a, b).reshape(-1, a.shape[0])
    if target in ("k_proj", "v_proj"):
        if kind == "global":
            a, b = arrays[p + "attn/k_einsum/w_lora_a"], arrays[p + "attn/k_einsum/w_lora_b"]
            return scale * np.einsum("dr,rkh->khd", a, b).reshape(-1, a.shape[0])
        a, b = arrays[p + "attn/kv_einsum/w_lora_a"], arrays[p + "attn/kv_einsum/w_lora_b"]
        w = np.einsum("dr,rskh->skhd", a, b)[0 if target == "k_proj" else 1]
        return scale * w.reshape(-1, a.shape[0])
    if target == "o_proj":
        a, b = arrays[p + "attn/attn_vec_einsum/w_lora_a"], arrays[p + "attn/attn_vec_einsum/w_lora_b"]
        return scale * np.einsum("nhr,rd->dnh", a, b).reshape(b.shape[1], -1)
    a, b = arrays[p + f"mlp/{target}/kernel_lora_a"], arrays[p + f"mlp/{target}/kernel_lora_b"]
    return scale * (a @ b).T


# ------------------------------------------------------------------------------------------------ the Orbax side

def test_restore_only_lora_arrays_as_numpy(trained):
    step, arrays = lora_checkpoint.restore_lora(trained)
    assert step == STEPS and lora_checkpoint.list_steps(trained) == [EVERY, STEPS]
    assert len(arrays) == 2 * (6 * LOCAL + 6 * GLOBAL)  # q, kv|k, o, gate, up, down; A and B each
    assert all(type(v) is np.ndarray for v in arrays.values())
    assert arrays["layers/0/attn/kv_einsum/w_lora_b"].shape == (8, 2, 8, 64)
    assert arrays["layers/5/attn/k_einsum/w_lora_b"].shape == (8, 4, 128)
    assert "layers/5/attn/kv_einsum/w_lora_a" not in arrays
    step1, arrays1 = lora_checkpoint.restore_lora(trained, step=EVERY)
    assert step1 == EVERY
    key = "layers/0/attn/q_einsum/w_lora_b"
    assert np.abs(arrays[key]).max() > 0 and not np.array_equal(arrays[key], arrays1[key])  # B trained, per step


def test_plan_maps_every_module_once(trained, tiny_dir):
    from gemma_tpu_helpers.fixes.model import gemma4

    meta = lora_checkpoint.read_lora_config(trained)
    _, arrays = lora_checkpoint.restore_lora(trained)
    deltas = merge_plan.plan_merge(arrays, meta, gemma4.read_text_config(tiny_dir))
    names = [d.hf for d in deltas]
    assert len(names) == len(set(names)) == 7 * LOCAL + 6 * GLOBAL
    assert "model.language_model.layers.5.self_attn.v_proj.weight" not in names
    k5 = next(d for d in deltas if d.hf == "model.language_model.layers.5.self_attn.k_proj.weight")
    assert k5.module == "layers/5/attn/k_einsum" and k5.shape == (4 * 128, 256)
    assert all(d.scale == meta["alpha"] / meta["rank"] for d in deltas)


# ------------------------------------------------------------------------------------------------ the merge

def test_merge_applies_lora_and_copies_the_rest_bit_for_bit(tiny_dir, strong, merged):
    _, arrays = lora_checkpoint.restore_lora(strong)
    meta = lora_checkpoint.read_lora_config(strong)
    scale = meta["alpha"] / meta["rank"]
    base_index = json.loads((tiny_dir / hf_checkpoint.INDEX).read_text())
    out_index = json.loads((merged / hf_checkpoint.INDEX).read_text())
    assert out_index["weight_map"] == base_index["weight_map"]
    shards = sorted(set(base_index["weight_map"].values()))
    assert sorted(p.name for p in merged.glob("*.safetensors")) == shards and len(shards) > 1
    assert out_index["metadata"]["total_size"] == base_index["metadata"]["total_size"]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        assert (merged / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    assert not (merged / "tiny_model.json").exists()

    kinds = ["local"] * LOCAL + ["global"] * GLOBAL
    changed = copied = towers = 0
    for shard in shards:
        assert (merged / shard).stat().st_size == (tiny_dir / shard).stat().st_size
        base, out = shard_tensors(tiny_dir / shard), shard_tensors(merged / shard)
        assert base.keys() == out.keys()
        for key, w in base.items():
            parts = key.split(".")
            towers += key.startswith(gemma4.MULTIMODAL_PREFIXES)  # the vision tower: copied, never merged
            target = parts[-2] if key.endswith("_proj.weight") and key.startswith(gemma4.KEY_PREFIX) else None
            if target is None or (target == "v_proj" and kinds[int(parts[3])] == "global"):
                assert out[key].tobytes() == w.tobytes(), key
                copied += 1
                continue
            layer = int(parts[3])
            dw = _expected_delta(arrays, layer, target, kinds[layer], scale)
            assert out[key].dtype == w.dtype and out[key].shape == w.shape == dw.shape
            np.testing.assert_allclose(out[key], w + dw, rtol=1e-6, atol=1e-6, err_msg=key)
            assert np.abs(out[key] - w).max() > 1e-3, key  # the LoRA did change it
            changed += 1
    assert changed == 7 * LOCAL + 6 * GLOBAL and towers > 10
    info = merge.read_merge_info(merged)
    assert info["merged_tensors"] == changed and info["copied_tensors"] == copied and info["step"] == 3


def test_merge_kernels_agree_on_the_tiny_model(tiny_dir, strong, merged, tmp_path):
    """The whole tiny merge with the numpy reference: every untargeted tensor identical; each targeted tensor of
    each kernel within the arithmetic bound of base + ΔW (the weight check's rule: 1 ulp plus what the rank-r dot's
    summation order can change), so on any CPU."""
    ref = merge.merge_lora(tiny_dir, strong, tmp_path / "numpy", progress=False, kernel="numpy").out_dir
    assert merge.read_merge_info(merged)["kernel"] == "xla" and merge.read_merge_info(ref)["kernel"] == "numpy"
    differ = total = 0
    for shard in sorted(p.name for p in merged.glob("*.safetensors")):
        a, b = shard_tensors(merged / shard), shard_tensors(ref / shard)
        for key in a:
            ulps = safetensors_io.ulp_distance(a[key], b[key])
            if not key.endswith("_proj.weight"):
                assert ulps.max() == 0, key
            differ += int((ulps > 0).sum())
            total += ulps.size
    print(f"tiny model: {differ} of {total} elements differ between the XLA and numpy kernels")
    for out in (merged, ref):
        res = weight_check.verify_weights(tiny_dir, strong, out, progress=False)
        assert res.ok, res.problems[:5]
    with pytest.raises(merge.MergeError, match="kernel must be one of"):
        merge.merge_lora(tiny_dir, strong, tmp_path / "bad", kernel="torch")


def test_merged_logits_match_tunix_base_plus_lora(tiny_dir, strong, merged, mesh):
    from gemma_tpu_helpers.fixes.model import parity

    res = verify.verify_merge(tiny_dir, strong, merged, mesh=mesh)
    print(pd.DataFrame(res.rows).to_string())
    a, b, effect, port = res.rows
    assert res.same_lora_as_merge is True and res.weights.ok and not res.problems
    assert res.ok and a.rel <= res.bound and b.rel <= res.bound
    assert res.bound == verify.PORT_FACTOR * port.rel < parity.DEFAULT_REL_BOUND  # 6 layers: tighter than 1e-4
    assert effect.rel > 100 * parity.DEFAULT_REL_BOUND  # the LoRA moves logits by far more than the bound


def test_verify_catches_a_k_v_swap(tiny_dir, strong, mesh, tmp_path, monkeypatch):
    """The check can fail: merge k's update into v_proj and v's into k_proj, and verify must say so."""
    real_plan = merge_plan.plan_merge

    def swapped(arrays, meta, text):
        deltas = real_plan(arrays, meta, text)
        for d in deltas:
            if d.module.endswith("kv_einsum"):
                d.hf = d.hf.replace("k_proj", "TMP").replace("v_proj", "k_proj").replace("TMP", "v_proj")
        return deltas

    monkeypatch.setattr(merge_plan, "plan_merge", swapped)
    out = merge.merge_lora(tiny_dir, strong, tmp_path / "bad", progress=False).out_dir
    monkeypatch.setattr(merge_plan, "plan_merge", real_plan)
    res = verify.verify_merge(tiny_dir, strong, out, mesh=mesh)
    assert not res.ok and res.rows[0].rel > 1e-2 and res.rows[1].rel > 1e-2
    assert any("k_proj" in p and "ulps from base" in p for p in res.problems)  # and the weights name the tensors


def test_peft_adapter_matches_merged(tiny_dir, strong, merged, tmp_path):
    from safetensors import safe_open

    from gemma_tpu_helpers.fixes.model import parity

    out = peft_export.export_peft_adapter(strong, tmp_path / "adapter", tiny_dir)
    cfg = json.loads((out / "adapter_config.json").read_text())
    meta = lora_checkpoint.read_lora_config(strong)
    assert cfg["peft_type"] == "LORA" and cfg["r"] == meta["rank"] and cfg["lora_alpha"] == meta["alpha"]
    with safe_open(out / "adapter_model.safetensors", framework="np") as f:
        keys = list(f.keys())
        a = f.get_tensor("base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight")
        b = f.get_tensor("base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_B.weight")
    assert len(keys) == 2 * (7 * LOCAL + 6 * GLOBAL) and a.shape == (8, 256) and b.shape == (512, 8)
    assert not [k for k in keys if "layers.5.self_attn.v_proj" in k]
    tokens = parity.sample_tokens(1024, 32)
    peft_logits = peft_export.peft_logits(tiny_dir, out, tokens)
    merged_logits, _ = parity.hf_logits_and_hidden(parity.load_hf(merged), tokens)
    base_logits, _ = parity.hf_logits_and_hidden(parity.load_hf(tiny_dir), tokens)
    scale = np.abs(merged_logits).max()
    assert np.abs(peft_logits - merged_logits).max() / scale <= parity.DEFAULT_REL_BOUND
    assert np.abs(base_logits - merged_logits).max() / scale > 100 * parity.DEFAULT_REL_BOUND


def test_step_and_cli(tiny_dir, trained, tmp_path):
    p = argparse.ArgumentParser()
    commands_train.merge_arguments(p)
    out = tmp_path / "m1"
    assert commands_train.run_merge(p.parse_args(["--base", str(tiny_dir), "--checkpoint", str(trained), "--step",
                                                  str(EVERY), "--out", str(out)])) == 0
    assert merge.read_merge_info(out)["step"] == EVERY
    assert run_cli(commands_train.run_merge, p.parse_args(["--base", str(tiny_dir), "--checkpoint", str(trained),
                                                           "--out", str(out)])) == 2  # not empty, no --overwrite
    assert commands_train.run_merge(p.parse_args(["--base", str(tiny_dir), "--checkpoint", str(trained), "--out",
                                                  str(out), "--overwrite"])) == 0
    assert merge.read_merge_info(out)["step"] == STEPS


# ------------------------------------------------------------------------------------------------ bad input

def test_missing_step(tiny_dir, trained, tmp_path):
    with pytest.raises(lora_checkpoint.LoraCheckpointError, match=rf"no step 7; its steps are \[{EVERY}, {STEPS}\]"):
        merge.merge_lora(tiny_dir, trained, tmp_path / "out", step=7)
    with pytest.raises(lora_checkpoint.LoraCheckpointError, match="does not exist"):
        merge.merge_lora(tiny_dir, tmp_path / "nowhere", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_truncated_orbax_checkpoint(tiny_dir, trained, tmp_path):
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(trained, ckpt)
    data = [p for p in (ckpt / str(STEPS) / "model_params").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data
    for p in data:  # the array data files, cut short
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])
    with pytest.raises(lora_checkpoint.LoraCheckpointError, match="incomplete or damaged"):
        merge.merge_lora(tiny_dir, ckpt, tmp_path / "out", step=STEPS)
    shutil.rmtree(ckpt / str(EVERY) / "model_params")
    with pytest.raises(lora_checkpoint.LoraCheckpointError, match="no model_params"):
        merge.merge_lora(tiny_dir, ckpt, tmp_path / "out", step=EVERY)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_wrong_base_model(trained, tmp_path, monkeypatch):
    from gemma_tpu_helpers.course.config import tiny

    deeper = tiny.write_tiny_model(tmp_path / "deep", layers=12)
    with pytest.raises(merge_plan.LoraMismatchError, match="6-layer base, but this base has 12 layers"):
        merge.merge_lora(deeper, trained, tmp_path / "out")
    monkeypatch.setitem(tiny.TINY_OVERRIDES, "num_attention_heads", 4)
    fewer_heads = tiny.write_tiny_model(tmp_path / "heads", layers=6)
    with pytest.raises(merge_plan.LoraMismatchError, match="do not fit this base"):
        merge.merge_lora(fewer_heads, trained, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_base_without_config_or_index(tiny_dir, trained, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_dir, base)
    (base / hf_checkpoint.INDEX).unlink()
    with pytest.raises(safetensors_io.SafetensorsError, match="no model.safetensors.index.json"):
        merge.merge_lora(base, trained, tmp_path / "out")
    (base / "config.json").unlink()
    with pytest.raises(safetensors_io.SafetensorsError, match="no config.json"):
        merge.merge_lora(base, trained, tmp_path / "out")


def test_out_dir_not_empty(tiny_dir, trained, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(merge.OutputExistsError, match="not empty"):
        merge.merge_lora(tiny_dir, trained, out)
    assert (out / "keep.txt").read_text() == "mine"


def test_disk_full_mid_write_leaves_nothing(tiny_dir, trained, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "previous.txt").write_text("an earlier merge")
    real = safetensors_io.write_merged_shard
    calls = []

    def fill_disk(src, dst, deltas, kernel, ones=()):
        calls.append(src)
        if len(calls) < 3:
            return real(src, dst, deltas, kernel, ones)
        Path(dst).write_bytes(b"\0" * 1000)  # a partial shard, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(safetensors_io, "write_merged_shard", fill_disk)
    with pytest.raises(OSError) as err:
        merge.merge_lora(tiny_dir, trained, out, overwrite=True, progress=False)
    assert err.value.errno == errno.ENOSPC and len(calls) == 3
    assert [p.name for p in out.iterdir()] == ["previous.txt"]  # out_dir untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # temp dir removed


def test_ensure_merged_caches_and_rebuilds_on_new_step(smoke, tiny_dir, trained, tmp_path):
    from gemma_tpu_helpers.course.training import train

    run = tmp_path / "run"
    shutil.copytree(tiny_dir, run / "base")
    shutil.copytree(trained, run / "checkpoints")
    (run / "train").mkdir(parents=True)
    (run / "train" / train.DONE).write_text(json.dumps({"steps": STEPS}))
    out = profile_steps.ensure_merged(smoke, run, progress=False)
    assert out == run / "merged" and merge.read_merge_info(out)["step"] == STEPS
    stamp = (out / hf_checkpoint.MERGE_INFO).stat().st_mtime_ns
    assert profile_steps.ensure_merged(smoke, run, progress=False) == out
    assert (out / hf_checkpoint.MERGE_INFO).stat().st_mtime_ns == stamp  # cached
    shutil.copytree(run / "checkpoints" / str(STEPS), run / "checkpoints" / str(STEPS + 1))  # a newer step appears
    (run / "train" / train.DONE).write_text(json.dumps({"steps": STEPS + 1}))
    profile_steps.ensure_merged(smoke, run, progress=False)
    assert merge.read_merge_info(out)["step"] == STEPS + 1


