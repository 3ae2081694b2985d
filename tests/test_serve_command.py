"""The v6e-8 serving command, checked against vLLM itself: its engine flags go through vLLM 0.32's own `vllm serve`
parser (the CPU build in .venv-serve, the same vLLM as vllm-tpu 0.32), and its HBM arithmetic per chip adds up."""

import dataclasses
import os
from pathlib import Path

import pytest

from gemma_tpu_helpers import profiles, serve

REPO = Path(__file__).resolve().parent.parent
SERVE_PY = Path(os.environ.get(serve.SERVE_PYTHON_ENV) or REPO / ".venv-serve" / "bin" / "python")
needs_venv = pytest.mark.skipif(not SERVE_PY.is_file(), reason="no serving venv: run `make serve-venv`")


@pytest.fixture(scope="module")
def v6e():
    return profiles.get_profile("v6e-8")


@pytest.fixture(scope="module")
def tpu_argv(v6e):
    return serve.tpu_vllm_argv(serve.command(v6e, "/data/merged", port=8123))


def _misspell(argv, flag, wrong):
    return [wrong if a == flag else a for a in argv]


@pytest.fixture(scope="module")
def parsed(tpu_argv):
    """One serving-venv process parses the real command and its broken variants (vLLM's import takes ~20 s)."""
    variants = {
        "real": tpu_argv,
        "misspelled": _misspell(tpu_argv, "--max-num-batched-tokens", "--max-num-batch-tokens"),
        "extra_s": _misspell(tpu_argv, "--disable-chunked-mm-input", "--disable-chunked-mm-inputs"),
        "removed_in_032": tpu_argv + ["--disable-log-requests"],
        "abbreviated": _misspell(tpu_argv, "--tensor-parallel-size", "--tensor-parallel-siz"),
    }
    return dict(zip(variants, serve.vllm_parse(list(variants.values()))))


def test_the_command_has_the_recipe_flags(v6e, tpu_argv):
    s = v6e.serve
    assert tpu_argv[:2] == ["serve", serve.CONTAINER_MODEL_DIR]
    assert "--disable-chunked-mm-input" in tpu_argv  # the 31B-it is multimodal
    assert s.tensor_parallel == v6e.hardware.num_devices == 8  # no idle chips
    assert s.image == "vllm/vllm-tpu:gemma4" and s.pip_version == "0.32.0"


@needs_venv
def test_v6e_command_parses_with_vllm_032s_own_parser(v6e, parsed):
    real = parsed["real"]
    assert real["ok"], real.get("error")
    assert real["inexact"] == [], "every flag is an exact option name (no abbreviation)"
    got, s = real["values"], v6e.serve
    assert got["model"] == serve.CONTAINER_MODEL_DIR and got["served_model_name"] == [serve.SERVED_NAME]
    assert (got["tensor_parallel_size"], got["data_parallel_size"]) == (s.tensor_parallel, 1)
    assert (got["max_model_len"], got["max_num_batched_tokens"]) == (s.max_model_len, s.max_num_batched_tokens)
    assert got["gpu_memory_utilization"] == s.gpu_memory_utilization
    assert (got["kv_cache_dtype"], got["dtype"]) == (s.kv_cache_dtype, v6e.model.dtype)
    assert got["disable_chunked_mm_input"] is True
    assert (got["host"], got["port"]) == (serve.HOST, 8123)


@needs_venv
@pytest.mark.parametrize("variant, flag", [("misspelled", "--max-num-batch-tokens"),
                                           ("extra_s", "--disable-chunked-mm-inputs"),
                                           ("removed_in_032", "--disable-log-requests")])
def test_an_unknown_flag_fails_vllms_parser(parsed, variant, flag):
    result = parsed[variant]
    assert not result["ok"] and "unrecognized arguments" in result["error"] and flag in result["error"]


@needs_venv
def test_an_abbreviated_flag_is_caught_although_argparse_accepts_it(parsed):
    result = parsed["abbreviated"]
    assert result["inexact"] == ["--tensor-parallel-siz"]


def test_hbm_per_chip_arithmetic(v6e):
    """The figures in the v6e-8 profile's comment: 31B text weights and one full-length sequence's KV per chip."""
    hbm = serve.hbm_per_chip(v6e)
    assert hbm["params"] == 30_697_345_340
    # K and V per token per chip: 50 sliding layers x 2 x (16/8 heads) x 256 x 2 B + 10 global x 2 x 1 x 512 x 2 B
    assert hbm["kv_bytes_per_token"] == 50 * 2 * 2 * 256 * 2 + 10 * 2 * 1 * 512 * 2 == 122_880
    assert hbm["kv_gib_per_sequence"] == 122_880 * 16384 / 2**30 == 1.875
    assert hbm["kv_gib_per_sequence_windowed"] == pytest.approx((50 * 2 * 2 * 256 * 2 * 1024 + 20_480 * 16384) / 2**30)
    assert hbm["weights_gib"] == pytest.approx(7.17, abs=0.005)
    assert hbm["budget_gib"] == pytest.approx(32 * 0.90)
    assert hbm["fits"] and hbm["full_length_sequences"] == 11 and hbm["full_length_sequences_windowed"] == 52


def test_hbm_arithmetic_fails_where_it_should(v6e):
    # all 16K-token sequences at the bound do not fit when the weights take most of the chip: bf16 on TP2
    tp2 = dataclasses.replace(v6e, serve=dataclasses.replace(v6e.serve, tensor_parallel=2))
    assert serve.hbm_per_chip(tp2)["weights_gib"] > 28 and not serve.hbm_per_chip(tp2)["fits"]
    # the alternative reported working: TP4 with fp8 weights and fp8 KV also fits (one replica of two)
    tp4 = dataclasses.replace(v6e, serve=dataclasses.replace(v6e.serve, tensor_parallel=4, kv_cache_dtype="fp8"))
    assert serve.hbm_per_chip(tp4, weight_dtype="fp8")["fits"]
    with pytest.raises(serve.ServeError, match="tensor_parallel=6 does not divide 16 KV heads"):
        serve.hbm_per_chip(dataclasses.replace(v6e, serve=dataclasses.replace(v6e.serve, tensor_parallel=6)))
    with pytest.raises(serve.ServeError, match="not a TPU profile"):
        serve.hbm_per_chip(profiles.get_profile("smoke"))


def test_every_tpu_profile_serves_on_one_hosts_chips_and_fits():
    for name, prof in profiles.PROFILES.items():
        if prof.hardware.platform != "tpu":
            continue
        chips = prof.hardware.num_devices // prof.hardware.hosts
        assert prof.serve.tensor_parallel <= chips, name
        assert serve.hbm_per_chip(prof)["fits"], name
        assert serve.command(prof, "/data/merged")[:2] == ["docker", "run"]
    v5p = profiles.get_profile("v5p-8")
    assert serve.hbm_per_chip(v5p)["weights_gib"] == pytest.approx(14.3, abs=0.05)
    too_wide = dataclasses.replace(v5p, serve=dataclasses.replace(v5p.serve, tensor_parallel=8))
    with pytest.raises(serve.ServeError, match="one of its hosts has 4 chips"):
        serve.command(too_wide, "/data/merged")
