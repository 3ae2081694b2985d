"""The tiny E2B / E4B replicas: their structure, the KV-sharing map to tunix, parity, and every step in smoke-e."""

import importlib.util
import json

import numpy as np
import pytest
from conftest import run_cli
from safetensors import safe_open

from gemma_tpu_helpers import base_model, chat_format, gemma4, parity, profiles, tiny

E2B = "e2b"


@pytest.fixture(scope="module")
def e2b_dir(tmp_path_factory):
    return tiny.write_tiny_model(tmp_path_factory.mktemp("e2b") / "base", variant=E2B)


def _keys(model_dir):
    return json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]


def _tensor(model_dir, key):
    shard = _keys(model_dir)[key]
    with safe_open(model_dir / shard, framework="np") as f:
        return f.get_tensor(key)


def test_e2b_replica_has_the_e_structure(e2b_dir):
    text = gemma4.read_text_config(e2b_dir)
    real = gemma4.GEMMA4_E2B_TEXT_CONFIG
    for field in ("attention_k_eq_v", "use_double_wide_mlp", "final_logit_softcapping", "rope_parameters",
                  "tie_word_embeddings", "hidden_activation"):
        assert text[field] == real[field], field
    assert text["layer_types"][:5] == real["layer_types"][:5]  # E2B's 4:1 period, not the 31B's 5:1
    assert text["num_kv_shared_layers"] == 5 and text["num_hidden_layers"] == 10
    assert text["num_key_value_heads"] == 1 and text["hidden_size_per_layer_input"] == 32
    cfg = json.loads((e2b_dir / "config.json").read_text())
    assert cfg["audio_config"] and cfg["vision_config"]
    keys = _keys(e2b_dir)
    assert any(k.startswith("model.audio_tower.") for k in keys) and any(k.startswith("model.embed_audio.")
                                                                         for k in keys)
    assert any(k.startswith("model.vision_tower.") for k in keys)
    pre = gemma4.KEY_PREFIX
    assert _tensor(e2b_dir, pre + "embed_tokens_per_layer.weight").shape == (1024, 10 * 32)
    # KV-shared layers keep (unused) k/v weights in the file, as the released E checkpoints do; the MLP is doubled
    assert gemma4.kv_shared_layers(text) == {5: 3, 6: 3, 7: 3, 8: 3, 9: 4}
    assert f"{pre}layers.9.self_attn.v_proj.weight" in keys and f"{pre}layers.9.self_attn.k_norm.weight" in keys
    assert _tensor(e2b_dir, f"{pre}layers.2.mlp.up_proj.weight").shape == (512, 256)
    assert _tensor(e2b_dir, f"{pre}layers.7.mlp.up_proj.weight").shape == (1024, 256)
    assert (e2b_dir / "chat_template.jinja").read_text() == chat_format.GEMMA4_E_CHAT_TEMPLATE


def test_transformers_reloads_e2b_with_no_missing_keys(e2b_dir):
    from transformers import Gemma4ForConditionalGeneration

    _, info = Gemma4ForConditionalGeneration.from_pretrained(e2b_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # the only keys it does not use are the KV-shared layers' k/v weights (its own ignore list)
    assert all(".self_attn.k_" in k or ".self_attn.v_proj" in k for k in info["unexpected_keys"])


@pytest.mark.parametrize("variant,tunix_preset", [("e2b", "gemma4_e2b"), ("e4b", "gemma4_e4b")])
def test_kv_sharing_maps_to_tunix_presets(variant, tunix_preset):
    from tunix.models.gemma4 import model as gm

    ours = gemma4.to_tunix_config(gemma4.TEXT_CONFIGS[variant], dtype="bfloat16")
    ref = getattr(gm.ModelConfig, tunix_preset)()
    for field in ("num_layers", "num_embed", "embed_dim", "hidden_dim", "num_heads", "head_dim", "num_kv_heads",
                  "sliding_window_size", "per_layer_input_dim", "frac_shared_layers", "override_kv_shared_ffw_hidden",
                  "k_eq_v_global", "global_key_size"):
        assert getattr(ours, field) == getattr(ref, field), field
    n = ours.num_layers
    assert ours.attention_pattern == (ref.attention_pattern * n)[:n]


def test_a_sharing_tunix_cannot_express_is_an_error():
    bad = dict(gemma4.GEMMA4_E2B_TEXT_CONFIG, num_kv_shared_layers=21)  # last unshared layer is then sliding
    with pytest.raises(gemma4.CheckpointError, match="tunix would share"):
        gemma4.to_tunix_config(bad)


def test_layers_must_leave_a_shared_period():
    with pytest.raises(ValueError, match="multiple of 5 for e2b"):
        tiny.tiny_text_config(5, "e2b")
    with pytest.raises(ValueError, match="--variant"):
        tiny.tiny_text_config(6, "e9b")


@pytest.mark.parametrize("variant", ["e2b", "e4b"])
def test_e_logits_match_transformers(variant, tmp_path, e2b_dir):
    import jax

    d = e2b_dir if variant == E2B else tiny.write_tiny_model(tmp_path / variant, variant=variant)
    tp = tiny.TINY_E_KV_HEADS[variant]  # E2B has one KV head: tp=1 only
    mesh = jax.make_mesh((8 // tp, tp), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    stats = parity.compare_logits(d, mesh, seq_len=40)
    print(f"{variant} parity: max |dlogit| {stats['max_abs']:.3e}, scale {stats['scale']:.3f}, "
          f"relative {stats['rel']:.3e}")
    assert stats["scale"] > 1.0
    assert stats["rel"] <= parity.DEFAULT_REL_BOUND


def test_smoke_e_walks_lora_train_merge_verify(tmp_path):
    """The E replica through the CLI steps in the smoke-e profile: LoRA coverage, 2 training steps, merge, verify."""
    env = {"GEMMA_TPU_RUNS": str(tmp_path)}
    run = tmp_path / "smoke-e"
    r = run_cli("lora", "--profile", "smoke-e", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "5 (KV-shared)" in r.stdout  # k_proj / v_proj have no module on the 5 shared layers
    r = run_cli("parity", run / "base", "--profile", "smoke-e", "--seq-len", "24", env=env)
    assert r.returncode == 0 and "parity: OK" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    r = run_cli("train", "--profile", "smoke-e", "--max-steps", "2", env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli("merge", "--base", run / "base", "--checkpoint", run / "checkpoints", "--out", run / "merged", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    # per-layer embedding tables, the shared layers' unused k/v and every untargeted tensor: bit-identical
    pre = gemma4.KEY_PREFIX
    targeted = (".q_proj.", ".k_proj.", ".v_proj.", ".o_proj.", ".gate_proj.", ".up_proj.", ".down_proj.")
    shared = gemma4.kv_shared_layers(gemma4.read_text_config(run / "base"))
    changed = 0
    for key in _keys(run / "base"):
        a, b = _tensor(run / "base", key), _tensor(run / "merged", key)
        unused_kv = any(key.startswith(f"{pre}layers.{i}.self_attn.{p}") for i in shared for p in ("k_", "v_"))
        if key.startswith(pre) and "layers." in key and any(t in key for t in targeted) and not unused_kv:
            changed += not np.array_equal(a, b)
        else:
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), key
    assert changed == 60  # 5 unshared layers x 7 targets + 5 shared layers x 5 (no k/v there)
    r = run_cli("verify", "--base", run / "base", "--checkpoint", run / "checkpoints", "--merged", run / "merged",
                "--profile", "smoke-e", env=env)
    assert r.returncode == 0 and "verify: OK" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.parametrize("variant", ["e2b", "e4b"])
def test_param_count_is_what_tunix_holds(variant):
    """gemma4.param_count (the memory estimate) against the abstract tunix model of the real E config."""
    import jax
    from flax import nnx
    from tunix.models.gemma4 import model as gm


    cfg = gemma4.to_tunix_config(gemma4.TEXT_CONFIGS[variant], dtype="bfloat16")
    state = nnx.state(nnx.eval_shape(lambda: gm.Gemma4(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    held = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    assert gemma4.param_count(gemma4.TEXT_CONFIGS[variant]) == held


@pytest.mark.parametrize("name,chip,model", [("colab-v5e-1", "v5e", "google/gemma-4-E2B-it"),
                                             ("colab-v6e-1", "v6e", "google/gemma-4-E4B-it")])
def test_colab_profiles_are_one_chip_e_models(name, chip, model):
    p = profiles.get_profile(name)
    assert p.hardware.num_devices == 1 and p.mesh_shape == (1, 1) and p.hardware.chip == chip
    assert p.hardware.tpu_topology == f"{chip}:1x1" and p.model.source == model
    text = base_model.profile_text_config(p)
    assert text["num_kv_shared_layers"] and not gemma4.head_divisibility_problems(text, dict(p.hardware.mesh))


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
@pytest.mark.parametrize("name", ["colab-v5e-1", "colab-v6e-1"])
def test_colab_topology_is_one_abstract_chip(name):
    from gemma_tpu_helpers import plan

    mesh = plan.topology_mesh(profiles.get_profile(name))
    assert mesh.devices.size == 1 and mesh.devices.flat[0].platform == "tpu"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_colab_v6e_plan_compiles_e4b_for_one_chip():
    """The real E4B train step, full depth (42 layers), compiled for v6e:1x1 at a short sequence: minutes."""
    from gemma_tpu_helpers import plan

    p = plan.aot_plan("colab-v6e-1", remat="block", seq_len=256)
    assert p["layers"] == 42 and p["method"] == "compiled" and p["fits"]
    assert p["argument_bytes"] > 14 * 2**30  # the bf16 weights (14.0 GiB) are on the one chip
