import json

import pytest

from gemma_tpu_helpers.course.config import tiny
from gemma_tpu_helpers.fixes.model import gemma4, hf_checkpoint
from support import run_cli


def test_layout_is_the_real_checkpoints(tiny_dir):
    shards = sorted(tiny_dir.glob("*.safetensors"))
    assert len(shards) >= 2
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert all(k.startswith(("model.language_model.", *gemma4.MULTIMODAL_PREFIXES)) for k in index["weight_map"])
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_dir / name).is_file(), name


def test_structure_follows_the_31b(tiny_dir):
    c = gemma4.read_text_config(tiny_dir)
    big = gemma4.GEMMA4_31B_TEXT_CONFIG
    assert c["layer_types"] == list(hf_checkpoint.PATTERN) * (c["num_hidden_layers"] // 6)
    assert c["attention_k_eq_v"] is True
    assert c["num_global_key_value_heads"] < c["num_key_value_heads"] <= c["num_attention_heads"]
    assert c["num_global_key_value_heads"] == big["num_global_key_value_heads"]
    assert c["final_logit_softcapping"] == big["final_logit_softcapping"]
    assert c["tie_word_embeddings"] is True
    assert c["hidden_size"] not in (c["head_dim"], c["global_head_dim"])
    # 4 global KV heads as in the 31B: the same tp sizes are valid.
    assert gemma4.valid_tp_sizes(c, 8) == gemma4.valid_tp_sizes(big, 8) == [1, 2, 4]
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())["weight_map"]
    globals_ = [i for i, k in enumerate(gemma4.layer_kinds(c)) if k == "global"]
    assert globals_ and all(f"model.language_model.layers.{i}.self_attn.v_proj.weight" not in index for i in globals_)


def test_transformers_reloads_without_missing_keys(tiny_dir):
    from transformers import AutoModelForImageTextToText

    _, info = AutoModelForImageTextToText.from_pretrained(tiny_dir, output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"]


def test_deterministic_for_a_seed(tiny_dir, tmp_path):
    again = tiny.write_tiny_model(tmp_path / "again", seed=0)
    other = tiny.write_tiny_model(tmp_path / "other", seed=1)
    for f in sorted(tiny_dir.iterdir()):
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
    shard = sorted(tiny_dir.glob("*.safetensors"))[0].name
    assert (other / shard).read_bytes() != (tiny_dir / shard).read_bytes()


@pytest.mark.parametrize("layers", [0, 5, 7, 13])
def test_layers_must_be_a_multiple_of_the_pattern(layers, tmp_path):
    with pytest.raises(ValueError, match="multiple of 6"):
        tiny.write_tiny_model(tmp_path / "x", layers=layers)
    assert not (tmp_path / "x").exists()


def test_refuses_to_clobber_without_overwrite(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite=True") as e:
        tiny.write_tiny_model(out)
    assert e.value.params == ("overwrite",)  # the CLI says --overwrite (test_cli_tiny_model)
    assert (out / "precious.txt").read_text() == "keep me"
    tiny.write_tiny_model(out, overwrite=True)
    assert not (out / "precious.txt").exists() and (out / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp dirs left behind


def test_cli_tiny_model(tmp_path):
    r = run_cli("tiny-model", "--help")
    assert "multiple of 6" in r.stdout
    r = run_cli("tiny-model", tmp_path / "bad", "--layers", "8")
    assert r.returncode == 2 and "multiple of 6" in r.stderr
    r = run_cli("tiny-model", tmp_path / "m", "--layers", "12")
    assert r.returncode == 0, r.stderr
    assert gemma4.read_text_config(tmp_path / "m")["num_hidden_layers"] == 12
    r = run_cli("tiny-model", tmp_path / "m")
    assert r.returncode == 2 and "--overwrite" in r.stderr


_ENSURE = """
import os, sys
from gemma_tpu_helpers.course.config import tiny
out = tiny.ensure_tiny_model(sys.argv[1], seed=0, layers=6)
print(os.stat(out / "model.safetensors.index.json").st_ino)
"""


def test_two_processes_asking_at_once_build_it_once(tmp_path):
    """Two notebooks starting together (a workshop's two kernels, CI's two notebook runs) share runs/<profile>/base:
    the second waits for the first and uses its checkpoint instead of building one and renaming it over the first."""
    import subprocess
    import sys

    out = tmp_path / "base"
    procs = [subprocess.Popen([sys.executable, "-c", _ENSURE, str(out)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    inodes = [p.communicate(timeout=300)[0].split()[-1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert inodes[0] == inodes[1], "the checkpoint was built twice"
    gemma4.check_checkpoint(out)


# The ids google/gemma-4-*-it ship (DESIGN.md: firm across every published copy), written here as literals, not read
# from chat_format's table: a shifted entry there would move the replica and an expectation built from it together.
REAL_IDS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<|tool_response>": 50, "<|turn>": 105, "<turn|>": 106}


def test_special_token_ids_are_the_real_releases(tiny_dir, tokenizer):
    tok = tokenizer
    assert {t: tok.convert_tokens_to_ids(t) for t in REAL_IDS} == REAL_IDS
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 106, 50]
    assert tok.convert_ids_to_tokens(generation["eos_token_id"]) == ["<eos>", "<turn|>", "<|tool_response>"]
