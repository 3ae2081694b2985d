import numpy as np
import pytest

from gemma_tpu_helpers.fixes.model import forward_inputs
from gemma_tpu_helpers.fixes.train import chat_tokens, data, packing
from support import SHIPPED, run_cli

ROW = {"prompt": "Write a module named inv with input a and output y.",
       "response": "<think>Just invert.</think>\nHere it is.\n```verilog\nmodule inv(input a, output y);\n"
                   "  assign y = ~a;\nendmodule\n```"}


def _examples(tokenizer, n=12):
    rows = data.load_rows(**SHIPPED).select(range(n))
    return chat_tokens.tokenize_rows(rows, tokenizer, progress=False)


def test_batched_tokenize_rows_equals_tokenize_example_per_row(tokenizer, monkeypatch):
    """The batched tokenizer calls give exactly the per-row ids and masks, across batch boundaries (5 + 5 + 2)."""
    from gemma_tpu_helpers.course.config import profiles

    monkeypatch.setattr(chat_tokens, "TOKENIZE_BATCH", 5)
    rows = data.load_rows(**SHIPPED).select(range(12))
    for spec in (None, profiles.get_profile("v5p-8").data):
        got = chat_tokens.tokenize_rows(rows, tokenizer, progress=False, spec=spec)
        chat = [chat_tokens.spec_messages(r, spec) if spec else chat_tokens.to_messages(r) for r in rows]
        want = [chat_tokens.tokenize_example(tokenizer, c) for c in chat]
        assert len(got) == len(want) == 12
        for (ids, mask), (ids2, mask2) in zip(got, want):
            assert ids.tolist() == ids2.tolist() and mask.tolist() == mask2.tolist()
            assert ids.dtype == np.int32 and mask.dtype == np.int8 and mask.sum() > 0
    assert chat_tokens.tokenize_rows(rows.select([]), tokenizer, progress=False) == []


def test_packing_keeps_every_token_once_with_its_own_positions(tokenizer):
    ex = _examples(tokenizer)
    packed = packing.pack(ex, max_seq_len=768)
    assert packed.stats["kept"] == len(ex) and packed.stats["rows"] < len(ex)
    seen = []
    for r in range(len(packed)):
        for s in range(1, packed.segment_ids[r].max() + 1):
            sel = packed.segment_ids[r] == s
            assert (packed.positions[r][sel] == np.arange(sel.sum())).all()
            seen.append((tuple(packed.tokens[r][sel]), tuple(packed.loss_mask[r][sel])))
    assert sorted(seen) == sorted((tuple(i), tuple(m)) for i, m in ex)
    assert packed.stats["real_tokens"] == sum(len(i) for i, _ in ex)


def test_attention_mask_is_block_diagonal_causal():
    seg = np.array([[1, 1, 2, 2, 2, 0]])
    m = np.asarray(forward_inputs.attention_mask_from_segments(seg))[0]
    expected = np.array([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0],
                         [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]], bool)
    assert (m == expected).all()


def test_packed_loss_equals_sum_of_per_example_losses(tokenizer, tunix_model, mesh):
    import jax.numpy as jnp

    from gemma_tpu_helpers.fixes.model.parity import forward
    from gemma_tpu_helpers.fixes.train import sft

    ex = _examples(tokenizer, 3)
    packed = packing.pack(ex, max_seq_len=sum(len(i) for i, _ in ex))  # all three in one row
    assert packed.stats["rows"] == 1

    def nll(tokens, mask, seg, pos):
        inputs = sft.model_inputs({"tokens": tokens, "loss_mask": mask, "segment_ids": seg, "positions": pos})
        logits = forward(tunix_model, inputs["input_tokens"], inputs["positions"], inputs["attention_mask"], mesh)
        return sft.masked_token_nll(logits, inputs["input_tokens"], inputs["loss_mask"], inputs["segment_ids"])

    total, count = nll(packed.tokens, packed.loss_mask, packed.segment_ids, packed.positions)
    parts = [nll(i[None], m[None], np.ones((1, len(i)), np.int32), np.arange(len(i))[None]) for i, m in ex]
    assert float(count) == sum(float(c) for _, c in parts) == sum(int(m[1:].sum()) for _, m in ex)
    assert float(total) == pytest.approx(sum(float(t) for t, _ in parts), rel=1e-5)
    # and without the block-diagonal mask the examples would see each other: the loss changes
    leaky = {"tokens": packed.tokens, "loss_mask": packed.loss_mask, "segment_ids": np.ones_like(packed.segment_ids),
             "positions": packed.positions}
    inputs = sft.model_inputs(leaky)
    logits = forward(tunix_model, inputs["input_tokens"], inputs["positions"], inputs["attention_mask"], mesh)
    leaky_total = sft.masked_token_nll(logits, inputs["input_tokens"], jnp.asarray(packed.loss_mask),
                                         jnp.asarray(packed.segment_ids))[0]
    assert abs(float(leaky_total) - float(total)) > 1e-3


def test_overlong_examples_dropped_or_trimmed_and_counted(tokenizer):
    ex = _examples(tokenizer, 12)
    limit = int(np.median([len(i) for i, _ in ex]))
    longer = sum(len(i) > limit for i, _ in ex)
    dropped = packing.pack(ex, limit, overlong="drop")
    trimmed = packing.pack(ex, limit, overlong="trim")
    assert dropped.stats["dropped"] == longer and dropped.stats["kept"] == len(ex) - longer
    assert trimmed.stats["trimmed"] == longer and trimmed.stats["kept"] == len(ex)
    assert dropped.tokens.shape[1] == trimmed.tokens.shape[1] == limit


def test_max_seq_len_below_the_shortest_example(tokenizer):
    ex = _examples(tokenizer, 4)
    with pytest.raises(data.DataError, match="No example fits max_seq_len=8: the shortest has"):
        packing.pack(ex, 8)


def test_batches_are_deterministic_and_reiterable(tokenizer):
    packed = packing.pack(_examples(tokenizer, 24), 512)
    ds = packing.batches(packed, global_batch=4, seed=3, epochs=2)
    first = [b["tokens"].tolist() for b in ds]
    assert first == [b["tokens"].tolist() for b in ds]  # re-iterable, same order
    assert len(first) == (2 * len(packed)) // 4
    other = [b["tokens"].tolist() for b in packing.batches(packed, global_batch=4, seed=4, epochs=2)]
    assert other != first


def test_split_is_deterministic_and_disjoint():
    rows = data.load_rows(**SHIPPED)
    tr, ev = data.split_rows(rows, 0.1, seed=0)
    assert len(ev) == 27 and len(tr) + len(ev) == len(rows)
    assert not set(tr["id"]) & set(ev["id"])
    assert data.split_rows(rows, 0.1, seed=0)[1]["id"] == ev["id"]


def test_codev_like_lengths_and_token_use():
    lengths = packing.codev_like_lengths(5000)
    assert abs(lengths.mean() - 922) / 922 < 0.05 and abs(np.percentile(lengths, 99) - 2553) / 2553 < 0.1
    use = packing.token_use_for_lengths(lengths, 3072)
    assert 0 < use["pad_to_max"] < use["packed"] <= 1
    assert use["pad_to_max"] == pytest.approx(lengths[lengths <= 3072].sum() / (use["padded_rows"] * 3072))


def test_cli_data_stats(tiny_dir):
    r = run_cli("data-stats", "--base", tiny_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    packed = float(r.stdout.split("packed token use: ")[1].split("%")[0])
    padded = float(r.stdout.split("pad-to-max token use: ")[1].split("%")[0])
    assert 0 < padded < packed <= 100


# Text that could trip a fast path: the templates' own markers and special tokens, placeholder-like strings, Jinja
# syntax and braces, whitespace that the templates trim, the reasoning and answer tags, unicode, and nothing at all.
TRICKY = ["", " ", "  padded  ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u200b", "<turn|>", "<|turn>model\n",
          "<|turn>user\n", "<|turn>system\n", "<|channel>thought\n<channel|>", "<|channel>", "<channel|>", "<|think|>",
          "<eos>", "<pad>", "<unused7>", "<|tool_call>", "<0x0A>", "<end_of_turn>", "<start_of_turn>model\n",
          "{{ messages }}", "{% if add_generation_prompt %}x{% endif %}", "{#", "#}", "{", "}}", "{{- bos_token -}}",
          "%s {0} $x \\n", "\x00P0\x00", "__CONTENT__", "{content}", "<<PLACEHOLDER>>", "\u2581", "\u2581\u2581", "é",
          "e\u0301", "日本語", "🙂", "<think>", "</think>", "<answer>", "</answer>", "```verilog\n", "```",
          "module m(input a, output y); assign y = a; endmodule", "Write a module.", "ANSWER", "<bos>"]


def _tricky_rows(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)

    def text(most=6):
        return "".join(rng.choice(TRICKY) for _ in range(rng.randint(0, most)))

    forms = [lambda: text(), lambda: f"<think>{text()}</think>\n{text()}",
             lambda: f"<think>{text()}</think><answer>{text()}```verilog\n{text()}\n```{text()}</answer>{text()}",
             lambda: f"<answer>{text()}```systemverilog x\n{text()}```\n```verilog\n{text()}```",  # unclosed answer
             lambda: f"{text()}<think>{text()}"]  # reasoning cut off
    rows = []
    for _ in range(n):
        row = {"prompt": text(8), "response": rng.choice(forms)()}
        if rng.random() < 0.6:
            row["system"] = rng.choice([None, "", text(4)])
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def tokenizers():
    """The tiny tokenizer with each chat template: Gemma 4 31B (empty thought channel in the generation prompt),
    Gemma 4 E2B/E4B (none) and Gemma 3 (system prompt folded into the user turn, <end_of_turn>)."""
    import copy

    from gemma_tpu_helpers.course.config import tiny
    from gemma_tpu_helpers.fixes.model import chat_format

    base = tiny.build_tokenizer(tiny.tiny_text_config()["vocab_size"], "31b")
    e, gemma3 = copy.deepcopy(base), copy.deepcopy(base)
    e.chat_template = chat_format.GEMMA4_E_CHAT_TEMPLATE
    gemma3.add_special_tokens({"additional_special_tokens": list(chat_format.GEMMA3_TURN_TOKENS)})
    gemma3.chat_template, gemma3.eot_token = chat_format.GEMMA3_CHAT_TEMPLATE, chat_format.GEMMA3_TURN_TOKENS[1]
    return {"31b": base, "e": e, "gemma3": gemma3}


def _settings():
    """tokenize_rows keyword arguments: the profiles' DataSpecs, every target and system source, the no-spec form."""
    import dataclasses

    from gemma_tpu_helpers.course.config import profiles

    specs = list(dict.fromkeys(p.data for p in profiles.PROFILES.values()))
    base = specs[0]
    specs += [dataclasses.replace(base, target=target, system=system, system_prompt=prompt)
              for target, system, prompt in (("full", "fixed", "Be terse. <turn|> {{ x }}"), ("verilog", "row", None),
                                             ("answer", "row", "  fallback  "), ("full", "none", "unused"))]
    return [{"spec": s} for s in specs] + [{"strip_think": False, "system_prompt": None},
                                          {"strip_think": True, "system_prompt": "<|turn>system\n\u2581 🙂"}]


def _reference(tokenizer, row, setting):
    """tokenize_example on the row's messages, or the DataError it raises."""
    spec = setting.get("spec")
    messages = (chat_tokens.spec_messages(row, spec) if spec is not None
                else chat_tokens.to_messages(row, setting["strip_think"], setting["system_prompt"]))
    try:
        return messages, chat_tokens.tokenize_example(tokenizer, messages)
    except data.DataError as e:
        return messages, str(e)


@pytest.mark.parametrize("variant", ["31b", "e", "gemma3"])
def test_tokenize_rows_is_bit_for_bit_tokenize_example_on_tricky_rows(variant, tokenizers, monkeypatch):
    """The fast path (batched, through the Rust tokenizer's encode_batch_fast) gives exactly the per-row reference's
    ids, masks and dtypes on varied rows and settings, across batch boundaries; a row the reference rejects is
    rejected with the same DataError. The reference itself is checked against plain tokenizer calls."""
    tok = tokenizers[variant]
    monkeypatch.setattr(chat_tokens, "TOKENIZE_BATCH", 7)
    rows = _tricky_rows(60, seed=len(variant)) + [dict(r) for r in data.load_rows(**SHIPPED).select(range(0, 270, 30))]
    eot_id = chat_tokens.end_of_turn_id(tok)
    checked, rejected = 0, 0
    for setting in _settings():
        ok, bad = [], []
        for row in rows:
            messages, want = _reference(tok, row, setting)
            (bad if isinstance(want, str) else ok).append((row, messages, want))
        got = chat_tokens.tokenize_rows([row for row, _, _ in ok], tok, progress=False, **setting)
        assert len(got) == len(ok)
        for (ids, mask), (row, messages, (want_ids, want_mask)) in zip(got, ok):
            assert ids.dtype == want_ids.dtype == np.int32 and mask.dtype == want_mask.dtype == np.int8
            assert ids.tolist() == want_ids.tolist() and mask.tolist() == want_mask.tolist(), (setting, row)
            prompt, answer, _ = chat_tokens.split_answer(tok, messages)
            p_ids, a_ids = (tok(t, add_special_tokens=False)["input_ids"] for t in (prompt, answer))
            assert want_ids.tolist() == p_ids + a_ids + [eot_id]  # the templates write <bos> themselves
            assert want_mask.tolist() == [0] * len(p_ids) + [1] * (len(a_ids) + 1)
        for row, _, message in bad:
            with pytest.raises(data.DataError) as e:
                chat_tokens.tokenize_rows([row], tok, progress=False, **setting)
            assert str(e.value) == message
        checked, rejected = checked + len(ok), rejected + len(bad)
    assert checked > 2 * rejected > 0  # mostly examples; some rows rejected (nothing to train on, a second <bos>)


@pytest.mark.parametrize("state", ["truncation", "split_special_tokens"])
def test_tokenize_rows_ignores_state_a_plain_call_resets(state, tokenizers):
    """Truncation set on the Rust tokenizer, or special-token splitting asked for, is what a plain tokenizer call
    resets or applies; the fast path gives what the plain call gives in both cases, from its first batch on."""
    import copy

    tok = copy.deepcopy(tokenizers["31b"])
    if state == "truncation":
        tok.backend_tokenizer.enable_truncation(8)
    else:
        tok.split_special_tokens = True
    rows = [dict(r) for r in data.load_rows(**SHIPPED).select(range(6))]
    got = chat_tokens.tokenize_rows(rows, tok, progress=False)
    want = [chat_tokens.tokenize_example(tok, chat_tokens.to_messages(r)) for r in rows]
    assert all(len(ids) > 8 for ids, _ in want)
    for (ids, mask), (ids2, mask2) in zip(got, want):
        assert ids.tolist() == ids2.tolist() and mask.tolist() == mask2.tolist()
