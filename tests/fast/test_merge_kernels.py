"""The merge's kernels and its errors, without a trained run: the XLA block kernel against the numpy reference
(within the arithmetic bound of two summation orders, on any CPU), special values, ulp distances, the CLI's paths and
error classes. The merge of a trained LoRA, verify and the PEFT export: tests/e2e/test_merge.py."""

import argparse
from pathlib import Path

import numpy as np
import pytest

from gemma_tpu_helpers.course.commands import commands_train
from gemma_tpu_helpers.course.commands.cli import run_cli
from gemma_tpu_helpers.fixes.core.errors import GemmaTpuError
from gemma_tpu_helpers.fixes.export import merge, merge_plan, peft_export, safetensors_io, verify, weight_check
from gemma_tpu_helpers.fixes.model import gemma4
from gemma_tpu_helpers.fixes.train import lora_checkpoint
from support import shard_tensors


def _one_tensor_shard(path: Path, w: np.ndarray, name: str = "w") -> None:
    """A safetensors file holding ``w`` (bf16 or fp32) under ``name``, plus an untargeted neighbour on each side."""
    import ml_dtypes
    from safetensors.numpy import save_file

    save_file({"a_before": np.arange(7, dtype=np.float32), name: w,
               "z_after": np.arange(5, dtype=np.float32).astype(ml_dtypes.bfloat16)}, str(path))


def _kernels_agree(tmp_path, w, scale, rank=16, seed=0):
    """Merge one tensor with the XLA kernel and with the numpy reference; returns (xla, numpy, max |ΔW| each, the
    arithmetic bound of their difference per element)."""
    rng = np.random.default_rng(seed)
    out_dim, in_dim = w.shape
    a = (rng.standard_normal((in_dim, rank)) * 0.05).astype(np.float32)
    b = (rng.standard_normal((rank, out_dim)) * 0.05).astype(np.float32)
    delta = merge_plan.Delta("w", "layers/0/mlp/up_proj", "up_proj", a, b, scale)
    src = tmp_path / "src.safetensors"
    _one_tensor_shard(src, w)
    got, applied = {}, {}
    for kernel in safetensors_io.MERGE_KERNELS:
        applied[kernel] = safetensors_io.write_merged_shard(src, tmp_path / f"{kernel}.safetensors", {"w": delta},
                                                            kernel)["w"]
        got[kernel] = shard_tensors(tmp_path / f"{kernel}.safetensors")
    base = shard_tensors(src)
    for k in ("a_before", "z_after"):  # untargeted: bit for bit with both kernels
        assert got["xla"][k].tobytes() == got["numpy"][k].tobytes() == base[k].tobytes()
    x, n = got["xla"]["w"], got["numpy"]["w"]
    dot = abs(scale) * (np.abs(b).T.astype(np.float64) @ np.abs(a).T.astype(np.float64))  # |scale|·Σ|aᵢbᵢ|, [out, in]
    value = np.maximum(np.abs(x.astype(np.float32)), np.abs(n.astype(np.float32)))
    return x, n, applied, weight_check.allowed_error(value, dot, rank, w.dtype.name)


def _assert_same_up_to_dot_order(x, n, allowed, what):
    """x equals n within the arithmetic bound of two summation orders of the rank-r dot plus one rounding to the
    stored dtype (weight_check.allowed_error, the rule `verify --weights` applies): the same on any CPU, whatever
    order its BLAS sums in. Where W + ΔW nearly cancels, that is many ulps of a tiny result, and allowed."""
    err = np.abs(x.astype(np.float64) - n.astype(np.float64))
    ulps = safetensors_io.ulp_distance(x, n)
    print(f"{what}: {int((ulps > 0).sum())} of {ulps.size} elements differ, max {int(ulps.max())} ulp; "
          f"largest error / bound {float((err / allowed).max()):.3f}")
    assert (err <= allowed).all(), f"{what}: {int((err > allowed).sum())} elements beyond the bound"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_xla_kernel_equals_the_numpy_reference(tmp_path, monkeypatch, dtype):
    """Targeted tensors: the XLA block kernel gives today's fp32-then-round result (a non-power-of-two scale, several
    blocks and a short last one); only the dot's summation order may differ, within its arithmetic bound."""
    import ml_dtypes

    monkeypatch.setattr(safetensors_io, "MERGE_BLOCK_ELEMENTS", 4096)  # 64-row blocks (64 columns): 5, the last short
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((300, 64)) * 0.02).astype(np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else dtype)
    x, n, applied, allowed = _kernels_agree(tmp_path, w, scale=0.3)
    assert safetensors_io.block_rows(64) == 64 and x.dtype == n.dtype == w.dtype
    _assert_same_up_to_dot_order(x, n, allowed, dtype)
    assert applied["xla"] == pytest.approx(applied["numpy"], rel=1e-6) and applied["xla"] > 0
    assert np.abs(x.astype(np.float32) - w.astype(np.float32)).max() > 1e-3  # the LoRA did change it


def test_xla_kernel_keeps_special_values_like_numpy(tmp_path):
    """NaN, ±inf, ±0, the largest finite and subnormal bf16 values come out exactly as with numpy: XLA:CPU flushes
    subnormals, so such blocks go to the numpy reference (one block here holds them, the other does not)."""
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((8, 2 * safetensors_io.MERGE_BLOCK_ELEMENTS // 8)) * 0.02).astype(bf16)
    special = np.array([0x7FC0, 0xFFC0, 0x7F81, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x7F7F, 0x0001, 0x8040],
                       np.uint16).view(bf16)
    w[0, :special.size] = special
    x, n, _, allowed = _kernels_agree(tmp_path, w, scale=1.0)
    head = slice(0, special.size)
    assert x[0, head].view(np.uint16).tolist() == n[0, head].view(np.uint16).tolist()
    assert np.isnan(x[0, :3].astype(np.float32)).all()
    _assert_same_up_to_dot_order(x[1:], n[1:], allowed[1:], "bf16 with special values")


def test_ulp_distance():
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    x = np.array([0x3F80, 0x3F80, 0x8000, 0x0001, 0xBF80], np.uint16).view(bf16)
    y = np.array([0x3F80, 0x3F82, 0x0000, 0x8001, 0xBF81], np.uint16).view(bf16)
    assert safetensors_io.ulp_distance(x, y).tolist() == [0, 2, 0, 2, 1]
    with pytest.raises(ValueError):
        safetensors_io.ulp_distance(x, y.astype(np.float32))


def test_cli_paths_from_the_profile(tmp_path, monkeypatch, capsys):
    """--profile fills what is not given from runs/<profile>/; without it the three paths are required."""
    p = argparse.ArgumentParser()
    commands_train.merge_arguments(p)
    monkeypatch.setenv("GEMMA_TPU_RUNS", str(tmp_path))
    run = tmp_path / "smoke-e"
    assert commands_train.merge_paths(p.parse_args(["--profile", "smoke-e"])) == (run / "base", run / "checkpoints",
                                                                        run / "merged")
    monkeypatch.chdir(tmp_path)  # a path given is taken relative to where the user is, once, as it comes in
    assert commands_train.merge_paths(p.parse_args(["--profile", "smoke-e", "--out", "x"]))[2] == tmp_path / "x"
    assert run_cli(commands_train.run_merge, p.parse_args(["--base", "b", "--checkpoint", "c"])) == 2
    assert "--profile" in capsys.readouterr().err


def test_every_merge_error_is_a_gemma_tpu_error_and_a_value_error():
    """The CLI catches GemmaTpuError once; user code that caught ValueError (what MergeError was) still does."""
    for cls in (lora_checkpoint.LoraCheckpointError, merge_plan.LoraMismatchError, safetensors_io.SafetensorsError,
                merge.MergeError, merge.OutputExistsError, verify.VerifyError):
        assert issubclass(cls, GemmaTpuError) and issubclass(cls, ValueError), cls


@pytest.mark.slow  # ~55 s; test_tiny_e's smoke-e CLI walk covers the same path through training in the default run
def test_e2b_merge_verify_and_peft_export_follow_the_layout(tmp_path):
    """The E2B replica (KV-shared layers with no k/v, a double-wide MLP there) with a synthetic LoRA on every target:
    the merge touches exactly the table's HF tensors, and both checks and PEFT agree with tunix base + LoRA."""
    from gemma_tpu_helpers.course.config import profiles, tiny
    from gemma_tpu_helpers.fixes.model import layout, parity

    mesh = profiles.get_profile("smoke-e").make_mesh()  # tp=1: the replica has one KV head
    base = tiny.write_tiny_model(tmp_path / "base", variant="e2b")
    text = gemma4.read_text_config(base)
    arrays = layout.synthetic_lora(text, layout.TARGETS, 4, std=0.05)
    meta = {"targets": list(layout.TARGETS), "rank": 4, "alpha": 8.0, "num_layers": text["num_hidden_layers"]}
    ckpt = lora_checkpoint.write_lora_checkpoint(tmp_path / "ckpt", arrays, meta, step=1)
    result = merge.merge_lora(base, ckpt, tmp_path / "merged", progress=False)
    expected = {layout.hf_key(L.index, r) for L in layout.layers(text) for r in layout.rows_for(L)}
    assert result.merged_tensors == len(expected)
    assert {d.hf for d in merge_plan.plan_merge(arrays, meta, text)} == expected
    assert not [k for k in expected if int(k.split(".")[3]) in gemma4.kv_shared_layers(text) and "_proj" in k
                and k.split(".")[-2] in ("k_proj", "v_proj")]
    res = verify.verify_merge(base, ckpt, result.out_dir, mesh=mesh)
    assert res.ok and res.lora_effect_rel > 100 * parity.DEFAULT_REL_BOUND, res.rows
    adapter = peft_export.export_peft_adapter(ckpt, tmp_path / "adapter", base)
    tokens = parity.sample_tokens(text["vocab_size"], 24)
    merged_logits, _ = parity.hf_logits_and_hidden(parity.load_hf(result.out_dir), tokens)
    gap = np.abs(peft_export.peft_logits(base, adapter, tokens) - merged_logits).max() / np.abs(merged_logits).max()
    assert gap <= parity.DEFAULT_REL_BOUND
