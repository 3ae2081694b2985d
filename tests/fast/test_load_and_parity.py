import json
import shutil

import pytest

from gemma_tpu_helpers.fixes.model import gemma4, parity
from gemma_tpu_helpers.fixes.model import mesh as mesh_lib


def test_loaded_model_is_sharded_on_the_mesh(tunix_model, mesh):
    from flax import nnx

    state = nnx.state(tunix_model)
    q = tunix_model.layers[0].attn.q_einsum.w
    assert q.shape == (8, 256, 64)  # (heads, hidden, head_dim)
    assert tunix_model.layers[5].attn.k_einsum.w.shape == (4, 256, 128)  # global k=v: (global kv heads, hidden, 128)
    assert not hasattr(tunix_model.layers[5].attn, "kv_einsum")
    assert len(jax_leaves(state)) > 0


def jax_leaves(state):
    import jax

    return jax.tree_util.tree_leaves(state)


def test_logits_match_transformers(tiny_dir, mesh, tunix_model):
    stats = parity.compare_logits(tiny_dir, mesh, seq_len=40, model=tunix_model)
    print(f"parity: max |dlogit| {stats['max_abs']:.3e}, scale {stats['scale']:.3f}, relative {stats['rel']:.3e}")
    assert stats["scale"] > 1.0  # the model is not degenerate: the logits carry signal
    assert stats["rel"] <= parity.DEFAULT_REL_BOUND
    assert len(stats["per_position"]) == 40  # beyond the sliding window (16): local layers are exercised


def test_residual_is_float32_rounding(tiny_dir, mesh, tunix_model):
    table = {r["comparison"]: r["rel"] for r in parity.rounding_budget(tiny_dir, mesh, model=tunix_model)}
    print(table)
    # tunix fp32 is no further from a float64 reference than transformers' own fp32 run (2x margin).
    assert table["tunix fp32 vs transformers fp64"] <= 2 * table["transformers fp32 vs transformers fp64"]


def test_layer_comparison_localises_a_port_bug(tiny_dir, mesh, tunix_model):
    import torch

    hf = parity.load_hf(tiny_dir)
    clean = parity.compare_layers(tiny_dir, mesh, model=tunix_model, hf_model=hf)
    assert all(r["rel"] <= parity.DEFAULT_REL_BOUND for r in clean)
    # A port bug: layer 3's query heads swapped in the reference (what a wrong reshape does).
    with torch.no_grad():
        w = hf.model.language_model.layers[3].self_attn.q_proj.weight
        w.copy_(w.view(8, 64, 256).flip(0).reshape(512, 256))
    broken = parity.compare_layers(tiny_dir, mesh, model=tunix_model, hf_model=hf)
    first_bad = next(r for r in broken if r["rel"] > parity.DEFAULT_REL_BOUND)
    assert first_bad["after"] == "layer 3 (local)"
    assert parity.compare_logits(tiny_dir, mesh, model=tunix_model, hf_model=hf)["rel"] > parity.DEFAULT_REL_BOUND


def test_wrong_key_layout_names_the_tensor(tiny_dir, tmp_path, mesh):
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "plain"
    shutil.copytree(tiny_dir, bad)
    index_path = bad / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(bad / shard)
        save_file({k.replace("model.language_model.", "model."): v for k, v in tensors.items()}, bad / shard,
                  metadata={"format": "pt"})
    index["weight_map"] = {k.replace("model.language_model.", "model."): v for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    with pytest.raises(gemma4.CheckpointError, match=r"model\.layers\.\d+\..*model\.language_model\."):
        gemma4.load_model(bad, mesh)


def test_missing_or_empty_checkpoint_dir(tmp_path, mesh):
    with pytest.raises(gemma4.CheckpointError, match="does not exist"):
        gemma4.load_model(tmp_path / "nope", mesh)
    (tmp_path / "empty").mkdir()
    with pytest.raises(gemma4.CheckpointError, match="no config.json"):
        gemma4.load_model(tmp_path / "empty", mesh)


def test_tp8_fails_on_global_kv_heads_with_a_clear_error(tiny_dir):
    mesh8 = mesh_lib.make_mesh((1, 8), ("fsdp", "tp"))
    with pytest.raises(gemma4.CheckpointError) as e:
        gemma4.load_model(tiny_dir, mesh8)
    msg = str(e.value)
    assert "global KV heads" in msg and "'tp'" in msg and "size 8" in msg and "[1, 2, 4]" in msg


def test_31b_valid_tp_sizes():
    assert gemma4.valid_tp_sizes(gemma4.GEMMA4_31B_TEXT_CONFIG, 8) == [1, 2, 4]


def test_mesh_must_fit_the_devices():
    with pytest.raises(mesh_lib.MeshError, match="needs 16 devices but 8"):
        mesh_lib.make_mesh((4, 4), ("fsdp", "tp"))


def test_config_mapping_for_the_31b():
    cfg = gemma4.to_tunix_config(gemma4.GEMMA4_31B_TEXT_CONFIG, dtype="bfloat16")
    from tunix.models.gemma4 import model as gm

    ref = gm.ModelConfig.gemma4_31b()  # tunix's own preset
    for field in ("num_layers", "num_embed", "embed_dim", "hidden_dim", "num_heads", "head_dim", "num_kv_heads",
                  "num_global_kv_heads", "sliding_window_size", "k_eq_v_global", "global_key_size",
                  "final_logit_softcap", "global_rope_proportion", "local_base_frequency", "global_base_frequency"):
        assert getattr(cfg, field) == getattr(ref, field), field
    assert cfg.attention_pattern == ref.attention_pattern * 10


