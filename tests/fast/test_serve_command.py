"""The TPU serving commands, checked against vLLM itself: the v6e-8 docker line and the Colab pip route's `vllm serve`
go through vLLM 0.32's own `vllm serve` parser (the CPU build in .venv-serve, the same vLLM as vllm-tpu 0.32), their
HBM arithmetic per chip adds up, and the vllm-tpu wheel the Colab route installs resolves for Python 3.12."""

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import support
from gemma_tpu_helpers.course.config import paths, profiles
from gemma_tpu_helpers.course.training import profile_steps
from gemma_tpu_helpers.fixes.serve import vllm_command, vllm_server
from support import run_cli

SERVE_PY = support.SERVE_PY
COLAB = ("colab-v5e-1", "colab-v6e-1")
UV = Path(sys.executable).parent / "uv"


# vLLM's own `vllm serve` parser, run in the serving venv: the CLI's subcommand parser, its post-parse checks, and
# the engine arguments built from the result. Input: a JSON list of argvs (each starting with "serve").
_PARSE_SCRIPT = r"""
import contextlib, io, json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
from vllm.engine.arg_utils import AsyncEngineArgs

FIELDS = ("model", "served_model_name", "dtype", "tensor_parallel_size", "data_parallel_size", "max_model_len",
          "max_num_batched_tokens", "max_num_seqs", "gpu_memory_utilization", "kv_cache_dtype",
          "disable_chunked_mm_input", "enforce_eager")
results = []
for argv in json.load(sys.stdin):
    parser = FlexibleArgumentParser(prog="vllm")
    sub = ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    known = set(sub._option_string_actions)
    inexact = [a.split("=", 1)[0] for a in argv if a.startswith("--") and a.split("=", 1)[0] not in known]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
            validate_parsed_serve_args(args)
        if args.model_tag is not None:
            args.model = args.model_tag
        engine = AsyncEngineArgs.from_cli_args(args)
        values = {f: getattr(engine, f) for f in FIELDS}
        values.update(host=args.host, port=args.port)
        results.append({"ok": True, "inexact": inexact, "values": values})
    except (SystemExit, Exception) as e:
        results.append({"ok": False, "inexact": inexact, "error": (err.getvalue() + " " + repr(e)).strip()})
print(json.dumps(results, default=str))
"""


def vllm_parse(argvs: list[list[str]], python, timeout: float = 300) -> list[dict]:
    """Parse ``serve ...`` argument lists with the vLLM of ``python`` (one process). Each result has ``ok``,
    ``values`` (the engine arguments) or ``error`` (argparse's message), and ``inexact``: flags argparse would accept
    only as an abbreviation, which hides a typo."""
    proc = subprocess.run([str(python), "-c", _PARSE_SCRIPT], input=json.dumps(argvs), capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    if proc.returncode != 0:
        raise vllm_command.ServeError(f"vLLM's parser did not run in {python} (exit {proc.returncode}): "
                                      f"{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tpu_vllm_argv(argv: list[str]) -> list[str]:
    """The ``serve ...`` part of a TPU ``serve_command``: what follows ``vllm`` (docker) or ``bin/vllm`` (pip)."""
    for at, arg in enumerate(argv[:-1]):
        if Path(arg).name == "vllm" and argv[at + 1] == "serve":
            return argv[at + 1:]
    raise vllm_command.ServeError(f"not a `vllm serve` command: {shlex.join(argv)}")


@pytest.fixture(scope="module")
def v6e():
    return profiles.get_profile("v6e-8")


@pytest.fixture(scope="module")
def tpu_argv(v6e):
    return tpu_vllm_argv(vllm_command.serve_command(v6e.serving, "/data/merged", port=8123))


def _misspell(argv, flag, wrong):
    return [wrong if a == flag else a for a in argv]


def colab_argv(name):
    return vllm_command.serve_command(profiles.get_profile(name).serving, "/data/merged", port=8123)


def smoke_as_serve_argv():
    """The smoke profile's CPU command (``python -m vllm.entrypoints.openai.api_server --model DIR FLAGS``) as
    ``vllm serve DIR FLAGS``, the form the parser takes: the same engine flags."""
    argv = vllm_command.serve_command(profiles.get_profile("smoke").serving, "/data/merged", port=8123)
    i = argv.index("--model")
    return ["serve", argv[i + 1], *argv[i + 2:]]


@pytest.fixture(scope="module")
def parsed(tpu_argv):
    """One serving-venv process parses the real commands and broken variants (vLLM's import takes ~20 s)."""
    variants = {
        "real": tpu_argv,
        "smoke": smoke_as_serve_argv(),
        **{name: tpu_vllm_argv(colab_argv(name)) for name in COLAB},
        "misspelled": _misspell(tpu_argv, "--max-num-batched-tokens", "--max-num-batch-tokens"),
        "extra_s": _misspell(tpu_argv, "--disable-chunked-mm-input", "--disable-chunked-mm-inputs"),
        "removed_in_032": tpu_argv + ["--disable-log-requests"],
        "abbreviated": _misspell(tpu_argv, "--tensor-parallel-size", "--tensor-parallel-siz"),
    }
    return dict(zip(variants, vllm_parse(list(variants.values()), python=SERVE_PY)))


def test_the_command_has_the_recipe_flags(v6e, tpu_argv):
    s = v6e.serve
    assert tpu_argv[:2] == ["serve", vllm_command.CONTAINER_MODEL_DIR]
    assert "--disable-chunked-mm-input" in tpu_argv  # the 31B-it is multimodal
    assert s.tensor_parallel == v6e.hardware.num_devices == 8  # no idle chips
    assert s.image == "vllm/vllm-tpu:gemma4" and s.pip_version == "0.32.0"


@support.needs_serve_venv
def test_v6e_command_parses_with_vllm_032s_own_parser(v6e, parsed):
    real = parsed["real"]
    assert real["ok"], real.get("error")
    assert real["inexact"] == [], "every flag is an exact option name (no abbreviation)"
    got, s = real["values"], v6e.serve
    assert got["model"] == vllm_command.CONTAINER_MODEL_DIR and got["served_model_name"] == [vllm_command.SERVED_NAME]
    assert (got["tensor_parallel_size"], got["data_parallel_size"]) == (s.tensor_parallel, 1)
    assert (got["max_model_len"], got["max_num_batched_tokens"]) == (s.max_model_len, s.max_num_batched_tokens)
    assert got["gpu_memory_utilization"] == s.gpu_memory_utilization
    assert (got["kv_cache_dtype"], got["dtype"]) == (s.kv_cache_dtype, v6e.model.dtype)
    assert got["disable_chunked_mm_input"] is True
    assert (got["host"], got["port"]) == (vllm_command.HOST, 8123)


@support.needs_serve_venv
def test_smoke_command_serves_eager(parsed):
    """The CPU build skips torch.compile (53 s of a 90 s start for the replica); vLLM's parser reads the flag."""
    smoke = parsed["smoke"]
    assert smoke["ok"] and smoke["inexact"] == [], smoke
    assert smoke["values"]["enforce_eager"] is True and smoke["values"]["dtype"] == "float32"
    assert parsed["real"]["values"]["enforce_eager"] is False  # the TPU line compiles, as vllm-tpu must


@support.needs_serve_venv
@pytest.mark.parametrize("variant, flag", [("misspelled", "--max-num-batch-tokens"),
                                           ("extra_s", "--disable-chunked-mm-inputs"),
                                           ("removed_in_032", "--disable-log-requests")])
def test_an_unknown_flag_fails_vllms_parser(parsed, variant, flag):
    result = parsed[variant]
    assert not result["ok"] and "unrecognized arguments" in result["error"] and flag in result["error"]


@support.needs_serve_venv
def test_an_abbreviated_flag_is_caught_although_argparse_accepts_it(parsed):
    result = parsed["abbreviated"]
    assert result["inexact"] == ["--tensor-parallel-siz"]


def test_hbm_per_chip_arithmetic(v6e):
    """The figures in the v6e-8 profile's comment: 31B text weights and one full-length sequence's KV per chip."""
    hbm = profile_steps.hbm_per_chip(v6e)
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
    assert profile_steps.hbm_per_chip(tp2)["weights_gib"] > 28 and not profile_steps.hbm_per_chip(tp2)["fits"]
    # the alternative reported working: TP4 with fp8 weights and fp8 KV also fits (one replica of two)
    tp4 = dataclasses.replace(v6e, serve=dataclasses.replace(v6e.serve, tensor_parallel=4, kv_cache_dtype="fp8"))
    assert profile_steps.hbm_per_chip(tp4, weight_dtype="fp8")["fits"]
    with pytest.raises(vllm_command.ServeError, match="tensor_parallel=6 does not divide 16 KV heads"):
        profile_steps.hbm_per_chip(dataclasses.replace(v6e, serve=dataclasses.replace(v6e.serve, tensor_parallel=6)))
    with pytest.raises(vllm_command.ServeError, match="not a TPU profile"):
        profile_steps.hbm_per_chip(profiles.get_profile("smoke"))


def test_every_tpu_profile_serves_on_one_hosts_chips_and_fits():
    for name, prof in profiles.PROFILES.items():
        if prof.hardware.platform != "tpu":
            continue
        target = prof.serving  # a profile that trains where its model does not fit to serve names its serving slice
        assert prof.serve_on is None or (target.chips, prof.serve) == (
            profiles.get_profile(prof.serve_on).hardware.num_devices, profiles.get_profile(prof.serve_on).serve), name
        assert prof.serve.tensor_parallel <= target.chips // target.hosts, name
        assert profile_steps.hbm_per_chip(prof)["fits"], name
        argv = vllm_command.serve_command(prof.serving, "/data/merged")
        if name.startswith("colab-") and not prof.serve_on:  # no Docker on Colab
            assert vllm_command.route(prof.serving) == "pip" and "docker" not in argv and argv[1] == "serve", name
        else:
            assert vllm_command.route(prof.serving) == "docker" and argv[:2] == ["docker", "run"], name
    v5p = profiles.get_profile("v5p-8")
    assert profile_steps.hbm_per_chip(v5p)["weights_gib"] == pytest.approx(14.3, abs=0.05)
    too_wide = dataclasses.replace(v5p, serve=dataclasses.replace(v5p.serve, tensor_parallel=8))
    with pytest.raises(vllm_command.ServeError, match="one of its hosts has 4 chips"):
        vllm_command.serve_command(too_wide.serving, "/data/merged")


# ------------------------------------------------------------------------------- Colab: one chip, no Docker


@pytest.mark.parametrize("name", COLAB)
def test_colab_command_is_a_plain_vllm_serve_from_the_serving_venv(name):
    prof = profiles.get_profile(name)
    argv = colab_argv(name)
    assert not prof.serve.docker and vllm_command.route(prof.serving) == "pip" and vllm_command.runs_here(prof.serving)
    assert argv[0] == str(paths.serve_python().parent / "vllm") and argv[1:3] == ["serve", "/data/merged"]
    assert not {"docker", "--hf-overrides", "--api-key"} & set(argv)  # multimodal as released; the key by env only
    s = prof.serve
    for flag, value in (("--tensor-parallel-size", 1), ("--max-model-len", s.max_model_len),
                        ("--max-num-seqs", s.max_num_seqs), ("--gpu-memory-utilization", s.gpu_memory_utilization),
                        ("--host", vllm_command.HOST), ("--dtype", "bfloat16")):
        assert argv[argv.index(flag) + 1] == str(value), flag
    env = vllm_command.environment(prof.serving, api_key="k", lora=True)
    assert env == {"VLLM_XLA_CACHE_PATH": os.path.expanduser(vllm_command.HOST_COMPILE_CACHE),
                   "MODEL_IMPL_TYPE": "vllm", "VLLM_API_KEY": "k"}
    line = vllm_command.shell_line(prof.serving, "/data/merged", api_key="sk-secret")
    assert "VLLM_API_KEY=$VLLM_API_KEY" in line and "sk-secret" not in line


@support.needs_serve_venv
@pytest.mark.parametrize("name", COLAB)
def test_colab_command_parses_with_vllm_032s_own_parser(parsed, name):
    result, s = parsed[name], profiles.get_profile(name).serve
    assert result["ok"], result.get("error")
    assert result["inexact"] == []
    got = result["values"]
    assert got["model"] == "/data/merged" and got["served_model_name"] == [vllm_command.SERVED_NAME]
    assert (got["tensor_parallel_size"], got["data_parallel_size"]) == (1, 1)
    assert (got["max_model_len"], got["max_num_batched_tokens"], got["max_num_seqs"]) == (
        s.max_model_len, s.max_num_batched_tokens, s.max_num_seqs)
    assert got["gpu_memory_utilization"] == s.gpu_memory_utilization and got["disable_chunked_mm_input"] is True
    assert (got["host"], got["port"]) == (vllm_command.HOST, 8123)


def test_colab_serving_fits_one_chip_with_room_for_an_eval():
    """One chip: the bf16 text weights and the KV cache of a 4096-token sequence (prompt + 2048 new tokens)."""
    e2b, e4b = (profile_steps.hbm_per_chip(profiles.get_profile(n)) for n in COLAB)
    assert e2b["chips"] == e4b["chips"] == 1 and e2b["max_model_len"] == 4096
    assert e2b["weights_gib"] == pytest.approx(8.66, abs=0.01) and e2b["budget_gib"] == pytest.approx(16 * 0.85)
    assert e4b["weights_gib"] == pytest.approx(14.00, abs=0.01) and e4b["budget_gib"] == pytest.approx(32 * 0.85)
    # the eval's 8 requests x n=5 samples in flight, even with every sliding layer holding all 4096 tokens; the
    # --max-num-seqs 64 cap with the sliding layers at their window (vLLM's hybrid KV cache manager)
    for hbm in (e2b, e4b):
        assert hbm["full_length_sequences"] >= 8 * 5 and hbm["full_length_sequences_windowed"] >= 64, hbm


def test_serve_cli_prints_the_colab_route_not_docker():
    r = run_cli("serve", "--model", "/content/gemma-tpu/runs/colab-v5e-1/merged", "--profile", "colab-v5e-1")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "docker" not in out.lower().replace("no docker", "")
    assert f"vllm-tpu=={profiles.get_profile('colab-v5e-1').serve.pip_version}" in out
    assert "uv venv --python 3.12" in out
    assert "/bin/vllm serve /content/gemma-tpu/runs/colab-v5e-1/merged" in out and "--tensor-parallel-size 1" in out
    assert (f"eval --url http://127.0.0.1:{vllm_command.DEFAULT_PORT} --model {vllm_command.SERVED_NAME} "
            "--profile colab-v5e-1") in out


def test_a_step_that_needs_more_chips_than_colab_has_says_so():
    prof = profiles.get_profile("colab-v5e-1")
    four = dataclasses.replace(prof, serve=dataclasses.replace(prof.serve, tensor_parallel=4))
    with pytest.raises(vllm_command.ServeError, match="tensor_parallel=4, but this runtime has 1 chip. Lower"):
        vllm_command.serve_command(four.serving, "/data/merged")
    with pytest.raises(vllm_command.ServeError, match="Docker image on its TPU VM"):  # docker route: not started here
        vllm_server.start(profiles.get_profile("v6e-8").serving, "/data/merged")


@pytest.mark.skipif(profiles.tpu_visible(), reason="a TPU is visible: start() would try vllm-tpu for real")
def test_colab_start_without_a_tpu_says_what_to_do(tmp_path):
    with pytest.raises(vllm_command.ServeError, match="no TPU is visible here.*rehearse with a CPU target"):
        vllm_server.start(profiles.get_profile("colab-v5e-1").serving, tmp_path, log_path=tmp_path / "log")
    assert vllm_server.tpu_held_by_this_process() == []  # a CPU machine: nothing to hold


