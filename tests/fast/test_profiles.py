import importlib.util
import math

import pytest

from gemma_tpu_helpers.course.budget import param_memory, plan
from gemma_tpu_helpers.course.config import profiles, tiny
from gemma_tpu_helpers.fixes.model import gemma4, model_size


def test_unknown_profile_lists_valid_names():
    with pytest.raises(ValueError) as e:
        profiles.get_profile("v5p-9000")
    for name in profiles.PROFILES:
        assert name in str(e.value)


def test_env_var_picks_profile(monkeypatch):
    monkeypatch.setenv(profiles.ENV_VAR, "v6e-8")
    assert profiles.get_profile().name == "v6e-8"
    monkeypatch.delenv(profiles.ENV_VAR)
    monkeypatch.setattr(profiles, "tpu_visible", lambda: False)
    assert profiles.get_profile().name == "smoke"


def test_tpu_without_profile_is_an_error(monkeypatch):
    monkeypatch.delenv(profiles.ENV_VAR, raising=False)
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    monkeypatch.setattr(profiles, "tpu_visible", lambda: True)
    with pytest.raises(ValueError, match=profiles.ENV_VAR):
        profiles.get_profile()


@pytest.mark.parametrize("name", list(profiles.PROFILES))
def test_mesh_fits_devices_and_model(name):
    p = profiles.PROFILES[name]
    assert math.prod(p.mesh_shape) == p.hardware.num_devices
    text = tiny.tiny_text_config() if p.model.source == "tiny" else gemma4.GEMMA4_31B_TEXT_CONFIG
    assert gemma4.head_divisibility_problems(text, dict(p.hardware.mesh)) == []


def test_training_profile_has_the_papers_hyperparameters():
    p = profiles.get_profile("v5p-8")
    assert (p.lora.rank, p.lora.alpha, p.lora.dropout) == (64, 64, 0.05)
    t = p.train
    assert (t.learning_rate, t.warmup_steps, t.schedule, t.weight_decay) == (1e-4, 100, "cosine", 0.001)
    assert (t.micro_batch, t.grad_accum, t.max_seq_len, t.epochs) == (1, 8, 3072, 1)
    assert dict(p.hardware.mesh)["tp"] == 4


def test_configure_jax_sets_device_count(smoke):
    import jax

    assert jax.device_count() == smoke.hardware.num_devices == 8
    assert jax.default_backend() == "cpu"


def test_param_count_matches_the_real_models(tiny_dir):
    from gemma_tpu_helpers.fixes.model.parity import load_hf

    hf = load_hf(tiny_dir)
    real = sum(t.numel() for t in hf.model.language_model.state_dict().values())  # layer_scalar is a buffer
    assert model_size.param_count(gemma4.read_text_config(tiny_dir)) == real
    # The 31B: about 30.7 billion parameters.
    assert 30.5e9 < model_size.param_count(gemma4.GEMMA4_31B_TEXT_CONFIG) < 31.0e9


def test_memory_estimate_scales_with_devices():
    p = profiles.get_profile("v5p-8")
    est = param_memory.memory_estimate(p, gemma4.GEMMA4_31B_TEXT_CONFIG)
    base = est["per_device_bytes"]["base params (sharded)"]
    assert base == pytest.approx(model_size.param_count(gemma4.GEMMA4_31B_TEXT_CONFIG) * 2 / 4)
    assert est["total_per_device_gib"] < p.hardware.hbm_gib_per_chip


def test_a_colab_profile_checks_on_the_replica_of_its_own_model(tmp_path):
    """Parity and probes on colab-v6e-1 run on the tiny E4B (KV-shared layers, per-layer inputs), not the 31B's."""
    from gemma_tpu_helpers.course.config import base_model

    check = base_model.ensure_check_model(profiles.get_profile("colab-v6e-1"), tmp_path)
    text = gemma4.read_text_config(check)
    wanted = tiny.tiny_text_config(None, "e4b")
    assert text["num_kv_shared_layers"] == wanted["num_kv_shared_layers"] > 0
    assert text["hidden_size_per_layer_input"] == wanted["hidden_size_per_layer_input"] > 0


def test_a_colab_runtime_picks_its_profile_by_accelerator_type(monkeypatch):
    monkeypatch.delenv(profiles.ENV_VAR, raising=False)
    monkeypatch.setattr(profiles, "tpu_visible", lambda: True)
    for accel, name in (("v5litepod-1", "colab-v5e-1"), ("v6e-1", "colab-v6e-1"), ("v5p-8", "v5p-8")):
        monkeypatch.setenv("TPU_ACCELERATOR_TYPE", accel)
        assert profiles.get_profile().name == name


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_a_31b_profile_on_one_chip_says_which_profiles_fit():
    """v5p-8's mesh on one (abstract) TPU chip, as on Colab: the error names the one-chip profiles."""
    from gemma_tpu_helpers.fixes.model import mesh as mesh_lib

    one_chip = list(plan.topology_mesh(profiles.get_profile("colab-v5e-1")).devices.flat)
    with pytest.raises(mesh_lib.MeshError, match="needs 4 TPU chips but this runtime has 1") as e:
        profiles.get_profile("v5p-8").make_mesh(devices=one_chip)
    assert "colab-v5e-1" in str(e.value) and "colab-v6e-1" in str(e.value)


def test_a_run_is_resolved_once_and_passed_down(tmp_path, monkeypatch):
    """resolve_run makes a run directory absolute once (relative to where the command runs); a Run handed on is
    returned as it is; a file is refused. (A gs:// run: tests/e2e/test_gcs.py, against a GCS on 127.0.0.1.)"""
    from gemma_tpu_helpers.fixes.core import file_io

    smoke = profiles.get_profile("smoke")
    monkeypatch.chdir(tmp_path)
    run = profiles.resolve_run(smoke, "here")
    assert run.dir == tmp_path / "here" and run.local == run.dir and run.checkpoints == run.dir / "checkpoints"
    monkeypatch.chdir("/")
    assert profiles.resolve_run(smoke, run) is run and smoke.local_dir(run) == tmp_path / "here"
    (tmp_path / "a-file").write_text("")
    with pytest.raises(file_io.PathArgumentError, match="is a file; --run-dir takes a directory"):
        profiles.resolve_run(smoke, tmp_path / "a-file")


def test_the_course_checks_a_base_once_while_its_files_stay(tiny_dir, tmp_path, monkeypatch):
    import shutil

    from gemma_tpu_helpers.course.config import base_model

    base = shutil.copytree(tiny_dir, tmp_path / "base")
    checks = []
    real = gemma4.check_checkpoint
    monkeypatch.setattr(gemma4, "check_checkpoint", lambda d: checks.append(d) or real(d))
    smoke = profiles.get_profile("smoke")
    assert base_model.ensure_base(smoke, base=base) == base == base_model.ensure_base(smoke, base=base)
    assert len(checks) == 1
    shard = sorted(base.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:5000])  # changed files: checked again, and found damaged
    with pytest.raises(gemma4.CheckpointError, match="truncated"):
        base_model.ensure_base(smoke, base=base)
    assert len(checks) == 2
