"""The memory plan: the analytic estimate, and the AOT compile of the LoRA train step for a TPU topology on this CPU
(libtpu's abstract devices, in the same process as the 8 virtual CPU devices)."""

import importlib.util

import pytest

from gemma_tpu_helpers import gemma4, plan, profiles, tiny

from conftest import run_cli

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
TINY = tiny.tiny_text_config(6)


def test_memory_estimate_unchanged():
    est = plan.memory_estimate(profiles.get_profile("v5p-8"), gemma4.GEMMA4_31B_TEXT_CONFIG)
    assert 30e9 < est["params"] < 34e9 and est["devices"] == 4
    assert list(plan.memory_table(est)["what"])[-1] == "total (before activations)"


def test_with_layers_keeps_the_pattern():
    c = plan.with_layers(gemma4.GEMMA4_31B_TEXT_CONFIG, 12)
    assert c["num_hidden_layers"] == 12 and gemma4.layer_kinds(c).count("global") == 2
    assert c["hidden_size"] == 5376 and gemma4.GEMMA4_31B_TEXT_CONFIG["num_hidden_layers"] == 60  # a copy


def test_extrapolation_is_an_exact_line_fit():
    mk = lambda n, fixed, per: {"layers": n, **{k: fixed + n * per for k in plan._FIGURES}}  # noqa: E731
    out = plan.extrapolate([mk(6, 1000, 10), mk(12, 1000, 10)], 60)
    assert out["temp_bytes"] == 1600 and out["temp_bytes_per_layer"] == 10 and out["temp_bytes_fixed"] == 1000


def test_unknown_policy_is_a_clear_error(capsys):
    assert plan.main_plan("v5p-8", aot=True, remat="selective") == 2
    err = capsys.readouterr().err
    assert "Unknown remat policy 'selective'" in err and "none, block, decoder, dots, dots_no_batch" in err


def test_missing_libtpu_says_pip_install(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    assert plan.main_plan("v5p-8", aot=True, remat="block") == 2
    assert "pip install libtpu" in capsys.readouterr().err


def test_plan_without_aot_prints_the_estimate(capsys):
    assert plan.main_plan("v5p-8", aot=False) == 0
    out = capsys.readouterr().out
    assert "LoRA params (replicated)" in out and "--aot" in out


@needs_libtpu
# runs in CI (not slow): notebook 04 compiles for a TPU only with GEMMA_TPU_AOT=1
def test_aot_compile_for_v5p_in_this_process(smoke):
    """The tiny config (2 layers) train step compiled for the v5p-8 topology next to the 8 virtual CPU devices: XLA's
    per-chip arguments match the sharded parameter bytes, the LoRA state is donated, and DECODER remat needs less
    temp memory than none."""
    import jax

    v5p = profiles.get_profile("v5p-8")
    kw = dict(text_config=TINY, batch=1, rank=8, alpha=16.0, dtype="bfloat16")
    none = plan.compile_train_step(v5p, "none", 1024, 2, **kw)
    dec = plan.compile_train_step(v5p, "decoder", 1024, 2, **kw)
    assert jax.device_count() == 8 and jax.devices()[0].platform == "cpu"  # the CPU platform is untouched
    two = plan.with_layers(TINY, 2)
    lora = plan.lora_param_count(two, 8, profiles.get_profile("smoke").lora.targets)
    base = plan.param_count(two)
    # base weights sharded over tp=4, LoRA + AdamW mu/nu replicated, all bf16. XLA's TPU layouts pad small minor
    # dims to 128 lanes (LoRA A's rank 8), so the compiled figure is somewhat above the element count.
    expected = base * 2 / 4 + lora * 2 * 3
    assert expected <= none["argument_bytes"] < 1.3 * expected
    assert none["alias_bytes"] == pytest.approx(none["output_bytes"], rel=0.01)  # LoRA + optimizer state donated
    print(f"tiny on v5p: temp none {none['temp_bytes'] / 2**20:.1f} MiB, decoder {dec['temp_bytes'] / 2**20:.1f} MiB")
    assert dec["temp_bytes"] < none["temp_bytes"]  # tiny activations: 10.5 vs 11.5 MiB here


@needs_libtpu
@pytest.mark.slow
def test_cli_plan_31b_six_layers_short_sequence():
    """The real 31B per-layer shapes (6 layers, seq 512) through the CLI entry point, in a subprocess."""
    r = run_cli("plan", "--profile", "v5p-8", "--aot", "--remat", "block", "--seq-len", "512", "--layers", "6",
                env={"GEMMA_TPU_PROFILE": "v5p-8"}) if _cli_wired() else None
    if r is None:
        rc = plan.main_plan("v5p-8", aot=True, remat="block", seq_len=512, layers=6)
        assert rc == 0
        return
    assert r.returncode == 0, r.stderr[-2000:]
    assert "FITS" in r.stdout and "compiled   6 layers" in r.stdout


def _cli_wired() -> bool:
    from gemma_tpu_helpers import __main__

    return "plan" in __main__.build_parser()._subparsers._group_actions[0].choices


@needs_libtpu
def test_v5p16_profile_mesh_spans_two_hosts_with_tp_inside_each():
    """The pod profile's mesh on libtpu's own v5p:2x2x2 topology: 8 chips in 2 processes, tp never crosses a host."""
    p = profiles.get_profile("v5p-16")
    mesh = plan.topology_mesh(p)
    assert dict(mesh.shape) == {"fsdp": 2, "tp": 4}
    assert {d.process_index for d in mesh.devices.flat} == {0, 1}
    for row in mesh.devices:  # one fsdp shard: its tp group
        assert len({d.process_index for d in row}) == 1
    assert p.train.micro_batch * p.train.grad_accum == 8 and p.train.micro_batch % 2 == 0
    est = plan.memory_estimate(p, gemma4.GEMMA4_31B_TEXT_CONFIG)
    assert est["total_per_device_gib"] < p.hardware.hbm_gib_per_chip
