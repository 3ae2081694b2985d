"""The tiny checkpoint's tokenizer files are a replica of google/gemma-4-31B-it's,
and the loss mask is exact on them."""

import json
import re
import shutil

import numpy as np
import pytest

from gemma_tpu_helpers.course.config import paths, tiny
from gemma_tpu_helpers.course.views import data_views, model_views
from gemma_tpu_helpers.fixes.model import chat_format, gemma4
from gemma_tpu_helpers.fixes.train import chat_tokens, data
from support import REPO

DESIGN = REPO.parent / "shared" / "DESIGN.md"
ANSWER = "```verilog\nmodule inv(input a, output y);\n  assign y = ~a;\nendmodule\n```"
CHAT = [{"role": "system", "content": "Be terse."},
        {"role": "user", "content": "  Write a module named inv with input a and output y.  "},
        {"role": "assistant", "content": ANSWER}]


@pytest.fixture(scope="module")
def gemma3_tokenizer(tiny_dir, tmp_path_factory):
    """A Gemma 3-style tokenizer: <start_of_turn>/<end_of_turn> tokens, no named eot_token (the end of turn comes
    from generation_config.json, as for the real Gemma 3) and Gemma 3's template."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("gemma3")
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.add_special_tokens({"additional_special_tokens": list(chat_format.GEMMA3_TURN_TOKENS)})
    tok.chat_template = chat_format.GEMMA3_CHAT_TEMPLATE
    tok.save_pretrained(out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.pop("eot_token")
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, eot]}))
    return AutoTokenizer.from_pretrained(out)


def _design_special_ids() -> dict[str, int]:
    text = DESIGN.read_text()
    para = text[text.index("Special tokens\n  (id):"):]
    para = para[: para.index("image/audio tokens")]
    return {tok: int(i) for tok, i in re.findall(r"`(<[^`]+>)` (\d+)", para)}


def test_special_token_ids_are_the_real_ones(tokenizer):
    ours = {tok: i for i, tok in chat_format.SPECIAL_TOKEN_IDS.items()}
    if DESIGN.is_file():  # the facts as DESIGN.md records them: the table in chat_format must not drift from it
        design = _design_special_ids()
        assert len(design) == 15 and {t: ours[t] for t in design} == design
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in ours} == ours
    for t in chat_format.GEMMA3_TURN_TOKENS:  # Gemma 4 has no Gemma 3 turn tokens
        assert t not in tokenizer.get_vocab()
    assert len(tokenizer) == gemma4.read_text_config(tokenizer.name_or_path)["vocab_size"]
    assert tokenizer.decode(tokenizer("module counter; // é").input_ids) == "module counter; // é"  # byte fallback


def test_file_set_and_tokenizer_config_are_the_real_ones(tiny_dir, tokenizer):
    for name in (*chat_format.TOKENIZER_FILES, "config.json", "generation_config.json", "processor_config.json",
                 "model.safetensors.index.json"):
        assert (tiny_dir / name).is_file(), name
    for name in chat_format.ABSENT_FILES:
        assert not (tiny_dir / name).exists(), name
    cfg = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert "chat_template" not in cfg
    assert {k: cfg[k] for k in chat_format.TOKENIZER_CONFIG} == chat_format.TOKENIZER_CONFIG
    assert {k: cfg[k] for k in chat_format.NAMED_TOKENS} == chat_format.NAMED_TOKENS
    assert tokenizer.eot_token == "<turn|>" and tokenizer.padding_side == "left"
    assert tokenizer("hello").input_ids[0] != tokenizer.bos_token_id  # add_bos_token false: the template writes it
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert {k: gen[k] for k in chat_format.GENERATION_CONFIG} == chat_format.GENERATION_CONFIG
    assert chat_tokens.stop_token_ids(tokenizer) == [1, 106, 50]


def test_vision_tower_and_multimodal_ids_as_in_the_31b(tiny_dir, tokenizer):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma4ForConditionalGeneration"] and cfg["vision_config"]
    assert cfg["audio_config"] is None  # the 31B has no audio tower
    big = gemma4.GEMMA4_31B_TEXT_CONFIG
    for field in ("rope_parameters", "use_bidirectional_attention", "attention_k_eq_v", "final_logit_softcapping",
                  "hidden_size_per_layer_input", "num_kv_shared_layers", "tie_word_embeddings"):
        assert cfg["text_config"][field] == big[field], field
    for name, _, tok in chat_format.MULTIMODAL_TOKENS:
        assert tokenizer.convert_ids_to_tokens(cfg[name]) == tok, name
    keys = json.loads((tiny_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.startswith("model.vision_tower.encoder.layers.0.") for k in keys)
    assert any(k.startswith("model.embed_vision.") for k in keys)
    assert gemma4.check_checkpoint(tiny_dir)["num_hidden_layers"] == 6  # the towers are not a wrong layout


def test_a_plain_causal_lm_layout_is_still_refused(tiny_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.up_proj.weight"] = next(iter(index["weight_map"].values()))
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(gemma4.CheckpointError, match="model.layers.0.mlp.up_proj.weight"):
        gemma4.check_checkpoint(bad)


def test_chat_template_renders_gemma4_turns(tokenizer):
    text = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert text == ("<bos><|turn>system\nBe terse.<turn|>\n<|turn>user\nWrite a module named inv with input a and "
                    "output y.<turn|>\n<|turn>model\n" + ANSWER + "<turn|>\n")
    prompt = tokenizer.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|turn>model\n<|channel>thought\n<channel|>")  # the 31B's empty thought channel
    thinking = tokenizer.apply_chat_template(CHAT[1:2], tokenize=False, add_generation_prompt=True,
                                             enable_thinking=True)
    assert thinking == "<bos><|turn>system\n<|think|><turn|>\n<|turn>user\nWrite a module named inv with input a " \
                       "and output y.<turn|>\n<|turn>model\n"
    e = tokenizer.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True,
                                      chat_template=chat_format.GEMMA4_E_CHAT_TEMPLATE)
    assert e.endswith("<|turn>model\n")  # E2B/E4B: no thought channel
    history = [CHAT[1], {"role": "assistant", "content": "<|channel>thought\nlet me think<channel|>Done."},
               {"role": "user", "content": "Again."}]
    rendered = tokenizer.apply_chat_template(history, tokenize=False)
    assert "<|turn>model\nDone.<turn|>" in rendered and "let me think" not in rendered


@pytest.mark.parametrize("variant", ["31b", "e", "gemma3"])
def test_loss_mask_is_exactly_the_answer_and_its_end_of_turn(variant, tokenizer, gemma3_tokenizer):
    tok = gemma3_tokenizer if variant == "gemma3" else tokenizer
    template = None if variant == "gemma3" else chat_format.CHAT_TEMPLATES[variant]
    ids, mask = chat_tokens.tokenize_example(tok, CHAT, chat_template=template)
    eot = {"gemma3": "<end_of_turn>"}.get(variant, "<turn|>")
    assert tok.decode(ids[mask == 1]) == ANSWER + eot
    assert list(ids).count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    first = int(np.argmax(mask))
    assert mask[first:].all() and not mask[:first].any()  # one contiguous span, ending the example
    prompt = tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True, chat_template=template)
    assert tok.decode(ids[:first]) == prompt  # the context is exactly the inference prompt
    if variant == "31b":
        assert tok.decode(ids[:first]).endswith("<|channel>thought\n<channel|>")  # in the context, not trained
    if variant == "gemma3":
        assert "<start_of_turn>user\nBe terse.\n\nWrite a module" in prompt  # Gemma 3 folds the system prompt


def test_a_wrong_format_fails_loudly_naming_the_template(tokenizer):
    with pytest.raises(data.DataError, match="the chat template passed in.*'<turn\\|>'.*Gemma 3"):
        chat_tokens.tokenize_example(tokenizer, CHAT, chat_template=chat_format.GEMMA3_CHAT_TEMPLATE)
    no_close = chat_format.GEMMA4_31B_CHAT_TEMPLATE.replace("{{- '<turn|>\\n' -}}\n{%- endfor -%}", "{%- endfor -%}")
    assert no_close != chat_format.GEMMA4_31B_CHAT_TEMPLATE
    with pytest.raises(data.DataError, match="end-of-turn"):
        chat_tokens.tokenize_example(tokenizer, CHAT, chat_template=no_close)
    with pytest.raises(data.DataError, match="last message must be the assistant"):
        chat_tokens.tokenize_example(tokenizer, CHAT[:2])
    table = data_views.compare_chat_formats(tokenizer, CHAT)
    assert table["loss mask"][0].endswith("tokens trained") and table["loss mask"][1].startswith("DataError")
    assert table["tokens of the marker"][0] == 1 and table["tokens of the marker"][1] > 1


def test_show_example_marks_the_trained_span(tokenizer):
    view = chat_tokens.show_example(tokenizer, CHAT)
    assert view["text"].endswith("<|channel>thought\n<channel|>\u27e6" + ANSWER + "<turn|>\u27e7")
    assert view["tokens"] == view["trained_tokens"] + view["prompt_tokens"] and view["trained_tokens"] > 5


def test_cached_tiny_model_of_the_old_format_is_rebuilt(tiny_dir, tmp_path):
    out = tmp_path / "base"
    shutil.copytree(tiny_dir, out)
    (out / tiny.BUILT_BY).write_text(json.dumps({"seed": 0, "layers": 6}))  # a format-1 cache (Gemma 3 tokens)
    tiny.ensure_tiny_model(out, seed=0, layers=6)
    assert json.loads((out / tiny.BUILT_BY).read_text())["format"] == tiny.FORMAT


def test_the_prompt_the_server_sees_and_the_code_it_answers(tiny_dir):
    from gemma_tpu_helpers.fixes.eval import eval_problems
    from gemma_tpu_helpers.fixes.serve import vllm_client

    problem = eval_problems.load_problems(paths.SHIPPED_EVAL)[0]
    text = vllm_client.rendered_prompt(tiny_dir, eval_problems.prompt_messages(problem))
    assert text.startswith("<bos><|turn>system\n" + eval_problems.SYSTEM_PROMPT + "<turn|>\n<|turn>user\n")
    assert text.endswith("<turn|>\n<|turn>model\n<|channel>thought\n<channel|>")
    ids = vllm_client.prompt_ids(tiny_dir, "Hi")
    assert ids.count(2) == 1 and ids[0] == 2
    raw = vllm_client.prompt_ids(tiny_dir, "module m;", chat_template=False)
    assert raw[0] == 2 and raw.count(2) == 1
    # a thought channel in an answer (special tokens kept) is not code, wherever it is
    code = "module TopModule(input a, output y); assign y = a; endmodule"
    assert eval_problems.extract_verilog("<|channel>thought\nmodule Draft; endmodule<channel|>"
                                         f"```verilog\n{code}\n```<turn|>") == code
    assert eval_problems.extract_verilog("<|channel>thought\nmodule Draft; endmodule") is None  # cut off while thinking
    assert eval_problems.extract_verilog(code + "<turn|>") == code


def test_peft_targets_are_the_language_models_not_the_vision_towers(tiny_dir):
    import torch
    from transformers import AutoModelForImageTextToText

    from gemma_tpu_helpers.fixes.train import lora

    names = [n for n, _ in AutoModelForImageTextToText.from_pretrained(tiny_dir, dtype=torch.float32).named_modules()]
    hits = [n for n in names if re.fullmatch(lora.peft_target_modules(), n)]
    kinds = gemma4.layer_kinds(gemma4.read_text_config(tiny_dir))
    assert len(hits) == sum(7 if k == "local" else 6 for k in kinds)  # no v_proj on the global k=v layers
    assert all(".language_model." in n for n in hits)
    # plain names, PEFT's usual form, would reach into the vision tower too
    assert any("vision_tower" in n and n.endswith(".q_proj") for n in names)
    local_k = lora.peft_target_modules(k_layers=[i for i, k in enumerate(kinds) if k == "local"])
    assert not any(re.fullmatch(local_k, n) for n in names
                   if n.endswith(f"layers.{kinds.index('global')}.self_attn.k_proj"))


def test_the_replica_has_every_file_of_the_real_checkpoint(tiny_dir, tokenizer):
    assert model_views.checkpoint_files_table(tiny_dir)["this checkpoint has it"].all()
    prompts = data_views.render_formats(tokenizer, CHAT[:2])["generation prompt"]
    assert prompts["Gemma 4 26B/31B"] == prompts["Gemma 4 E2B/E4B"] + "<|channel>thought\n<channel|>"
    assert prompts["Gemma 3"].startswith("<bos><start_of_turn>user\nBe terse.\n\n")


def test_data_stats_shows_an_example_as_it_is_trained(tiny_dir):
    from support import run_cli

    out = run_cli("data-stats", "--profile", "smoke", "--base", tiny_dir, "--show-example", "0")
    assert out.returncode == 0, out.stderr
    assert "<|turn>model\n<|channel>thought\n<channel|>\u27e6" in out.stdout and out.stdout.count("<turn|>\u27e7") == 1
    assert re.search(r"\d+ tokens: \d+ of prompt \(no loss\), \d+ trained", out.stdout)
    bad = run_cli("data-stats", "--profile", "smoke", "--base", tiny_dir, "--show-example", "100000")
    assert bad.returncode == 2 and "the data has rows 0 to" in bad.stderr and "Traceback" not in bad.stderr


def test_skipped_tower_keys_do_not_flood_the_log_but_other_skips_warn():
    import logging

    f = gemma4.TowerSkipFilter()

    def record(msg):
        return logging.LogRecord("absl", logging.WARNING, __file__, 1, msg, None, None)

    towers = ("Skipped loading 2 keys because ... Missing keys: "
              "[model.vision_tower.a.weight, model.embed_vision.b.weight]")
    other = ("Skipped loading 2 keys because ... Missing keys: "
             "[model.vision_tower.a.weight, model.language_model.x.weight]")
    assert not f.filter(record(towers)) and f.filter(record(other)) and f.filter(record("something else"))
