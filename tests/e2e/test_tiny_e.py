"""The tiny E2B / E4B replicas: their structure, the KV-sharing map to tunix, parity, and every step in smoke-e."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import support
from gemma_tpu_helpers.course.config import base_model, profiles, tiny
from gemma_tpu_helpers.fixes.core import file_io
from gemma_tpu_helpers.fixes.model import chat_format, gemma4, greedy, model_size, parity
from gemma_tpu_helpers.fixes.serve import vllm_client, vllm_command, vllm_server
from support import REPO, have_iverilog, run_cli

E2B = "e2b"
SERVE_PY = support.serve_python()
N_PARITY = 20


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
    keys = support.model_keys(e2b_dir)
    assert any(k.startswith("model.audio_tower.") for k in keys) and any(k.startswith("model.embed_audio.")
                                                                         for k in keys)
    assert any(k.startswith("model.vision_tower.") for k in keys)
    pre = gemma4.KEY_PREFIX
    assert support.model_tensor(e2b_dir, pre + "embed_tokens_per_layer.weight").shape == (1024, 10 * 32)
    # KV-shared layers keep (unused) k/v weights in the file, as the released E checkpoints do; the MLP is doubled
    assert gemma4.kv_shared_layers(text) == {5: 3, 6: 3, 7: 3, 8: 3, 9: 4}
    assert f"{pre}layers.9.self_attn.v_proj.weight" in keys and f"{pre}layers.9.self_attn.k_norm.weight" in keys
    assert support.model_tensor(e2b_dir, f"{pre}layers.2.mlp.up_proj.weight").shape == (512, 256)
    assert support.model_tensor(e2b_dir, f"{pre}layers.7.mlp.up_proj.weight").shape == (1024, 256)
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


@pytest.fixture(scope="module")
def smoke_e_run(tmp_path_factory):
    """One smoke-e run directory walked once through the CLI steps (one Python process), each with --profile
    smoke-e: LoRA coverage, parity, 2 training steps on 256-token rows, merge, verify. The walk test reads the
    results, the serve and eval tests use its merged replica: CI trains once. A failed step ends the walk (the walk
    test says which)."""
    root = tmp_path_factory.mktemp("runs")
    run = root / "smoke-e"
    return support.walk(root, "smoke-e", [
        ("lora", ("lora", "--profile", "smoke-e"), 600),
        ("parity", ("parity", run / "base", "--profile", "smoke-e", "--seq-len", "24"), 600),
        ("train", ("train", "--profile", "smoke-e", "--max-steps", "2", "--max-seq-len", "256"), 900),
        # --profile alone: base, checkpoints and merged of runs/smoke-e
        ("merge", ("merge", "--profile", "smoke-e"), 600),
        ("verify", ("verify", "--base", run / "base", "--checkpoint", run / "checkpoints", "--merged",
                    run / "merged", "--profile", "smoke-e"), 600),
    ])


def test_smoke_e_walks_lora_train_merge_verify(smoke_e_run):
    """The E replica through the CLI steps in the smoke-e profile: LoRA coverage, 2 training steps, merge, verify."""
    run = smoke_e_run["run"]
    assert "5 (KV-shared)" in support.walk_step(smoke_e_run, "lora").stdout  # no k/v_proj module on the shared layers
    assert "parity: OK" in support.walk_step(smoke_e_run, "parity").stdout
    support.walk_step(smoke_e_run, "train")
    support.walk_step(smoke_e_run, "merge")
    # per-layer embedding tables, the shared layers' unused k/v and every untargeted tensor: bit-identical
    pre = gemma4.KEY_PREFIX
    targeted = (".q_proj.", ".k_proj.", ".v_proj.", ".o_proj.", ".gate_proj.", ".up_proj.", ".down_proj.")
    shared = gemma4.kv_shared_layers(gemma4.read_text_config(run / "base"))
    changed = 0
    for key in support.model_keys(run / "base"):
        a, b = support.model_tensor(run / "base", key), support.model_tensor(run / "merged", key)
        unused_kv = any(key.startswith(f"{pre}layers.{i}.self_attn.{p}") for i in shared for p in ("k_", "v_"))
        if key.startswith(pre) and "layers." in key and any(t in key for t in targeted) and not unused_kv:
            changed += not np.array_equal(a, b)
        else:
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), key
    assert changed == 60  # 5 unshared layers x 7 targets + 5 shared layers x 5 (no k/v there)
    assert "verify: OK" in support.walk_step(smoke_e_run, "verify").stdout


def _tree(pid):
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.fixture(scope="module")
def e_server(smoke_e_run):
    """The merged E replica served by the `serve` CLI with --profile smoke-e (vLLM's CPU build), once for the module.

    vLLM's Gemma4ForCausalLM reads the replica as it reads the released E2B: the text-only override skips the
    audio and vision towers, and its weight mapper drops the k/v tensors the KV-shared layers still ship. The CLI is
    stopped with SIGTERM (its handler stops vLLM's process group); anything left is killed and fails the test."""
    if not SERVE_PY.is_file():
        pytest.skip("no serving venv: run `make serve-venv`")
    support.walk_step(smoke_e_run, "merge")
    merged, port = smoke_e_run["run"] / "merged", vllm_server.free_port()
    log = smoke_e_run["root"] / "serve-cli.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gemma_tpu_helpers", "serve", "--model", str(merged),
                                 "--profile", "smoke-e", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                text=True, env={**os.environ, **smoke_e_run["env"]}, cwd=REPO)
    client = vllm_client.Client(f"http://{vllm_command.HOST}:{port}")
    seen = []
    try:
        yield {"client": client, "merged": merged, "proc": proc, "log": log, "seen": seen, "t0": time.perf_counter()}
    finally:
        seen += [p for p in _tree(proc.pid) if p not in seen]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        left = [p for p in seen if p.is_running()]
        for p in left:
            p.kill()
        assert not left, f"the serve CLI left vLLM processes behind: {left}"


def _wait_ready(e_server, timeout=vllm_server.START_TIMEOUT_S):
    srv = e_server
    deadline = srv["t0"] + timeout
    while not srv["client"].healthy(timeout=2.0):
        srv["seen"] += [p for p in _tree(srv["proc"].pid) if p not in srv["seen"]]
        assert srv["proc"].poll() is None, f"serve exited ({srv['proc'].returncode}):\n{file_io.log_tail(srv['log'])}"
        assert time.perf_counter() < deadline, f"no /health in {timeout:.0f} s:\n{file_io.log_tail(srv['log'])}"
        time.sleep(1.0)
    srv.setdefault("ready_s", time.perf_counter() - srv["t0"])
    return srv["client"]


def test_smoke_e_serves_the_merged_replica_token_for_token(e_server):
    """vLLM (torch CPU, fp32) and tunix (JAX, fp32) on the merged E replica: the same greedy tokens, the same top-2
    gaps. The JAX side runs while vLLM starts."""
    merged = e_server["merged"]
    prof = profiles.get_profile("smoke-e")

    mesh = prof.make_mesh()  # (fsdp=8, tp=1): the same 8 virtual devices as conftest's smoke mesh
    model = gemma4.load_model(merged, mesh, dtype=prof.model.dtype)
    ids = vllm_client.prompt_ids(merged, greedy.PARITY_TEXT, chat_template=False)  # 12 ids: 32 positions > window 16
    jax_tokens, margins = greedy.jax_greedy(model, mesh, ids, N_PARITY, return_margins=True)
    served = _wait_ready(e_server).complete_ids(ids, N_PARITY)
    table = greedy.parity_table(jax_tokens, margins, served)
    summary = greedy.parity_summary(table)
    gap = (table["jax top-2 gap"] - table["vllm top-2 gap"]).abs().max()
    print(f"\nvLLM ready after {e_server['ready_s']:.1f} s; {summary['equal_prefix']}/{summary['n']} greedy tokens "
          f"equal; max top-2 gap difference {gap:.1e}\n{table.to_string(index=False)}")
    assert len(served["token_ids"]) == N_PARITY
    assert gap < 1e-2
    assert summary["equal_prefix"] >= 16, (summary, table.to_string())
    assert len(set(jax_tokens)) > 2, "a degenerate continuation (one token repeated) would be a weak check"


@pytest.mark.skipif(not have_iverilog(), reason="install Icarus Verilog 12: make iverilog")
def test_smoke_e_eval_scores_the_served_replica(e_server, tmp_path):
    """`eval --profile smoke-e` through the same HTTP client: sampled from the server, simulated, scored; the
    profile's run directory holds the calibrations."""
    client = _wait_ready(e_server)
    out = tmp_path / "merged.jsonl"
    tasks = "Prob001_majority3,Prob002_mux3_8bit"
    r = run_cli("eval", "--url", client.base_url, "--model", vllm_command.SERVED_NAME, "--profile", "smoke-e",
                "--tasks", tasks, "--n", "2", "--temperature", "0.8", "--max-tokens", "48", "--k", "1,2",
                "--out", out, env={"GEMMA_TPU_RUNS": str(tmp_path / "runs")})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    print("\n" + r.stdout)
    assert "scored 4 samples on 2 of 2 problems" in r.stdout
    assert "pass@1" in r.stdout and "pass@2" in r.stdout
    assert str(tmp_path / "runs" / "smoke-e" / "eval") in r.stdout  # --profile picked the run directory
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and all(row["completion"] for row in rows)  # the random replica answers, in token soup


@pytest.mark.parametrize("variant", ["e2b", "e4b"])
def test_param_count_is_what_tunix_holds(variant):
    """gemma4.param_count (the memory estimate) against the abstract tunix model of the real E config."""
    import jax
    from flax import nnx
    from tunix.models.gemma4 import model as gm


    cfg = gemma4.to_tunix_config(gemma4.TEXT_CONFIGS[variant], dtype="bfloat16")
    state = nnx.state(nnx.eval_shape(lambda: gm.Gemma4(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    held = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    assert model_size.param_count(gemma4.TEXT_CONFIGS[variant]) == held


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
    from gemma_tpu_helpers.course.budget import plan

    mesh = plan.topology_mesh(profiles.get_profile(name))
    assert mesh.devices.size == 1 and mesh.devices.flat[0].platform == "tpu"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_colab_v6e_plan_compiles_e4b_for_one_chip():
    """The real E4B train step, full depth (42 layers), compiled for v6e:1x1 at a short sequence: minutes."""
    from gemma_tpu_helpers.course.budget import plan

    p = plan.aot_plan("colab-v6e-1", remat="block", seq_len=256)
    assert p.layers == 42 and p.method == "compiled" and p.fits
    assert p.argument_bytes > 14 * 2**30  # the bf16 weights (14.0 GiB) are on the one chip
