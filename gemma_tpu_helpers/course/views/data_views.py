"""The data fixes as notebooks 00 and 05 and the CLI show them: the chat formats side by side (the paper's Gemma 3
trap among them), what a row trains on, its lengths and the token use of packing."""

from __future__ import annotations

import re

import numpy as np

from ...fixes.model.chat_format import GEMMA3_CHAT_TEMPLATE, GEMMA4_31B_CHAT_TEMPLATE, GEMMA4_E_CHAT_TEMPLATE
from ...fixes.train import chat_tokens, data, packing


def render_formats(tokenizer, messages: list[dict]):
    """The same chat as each template renders it for generation: Gemma 4 31B-it, Gemma 4 E2B/E4B, and Gemma 3."""
    import pandas as pd

    rows = {name: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=t)
            for name, t in (("Gemma 4 26B/31B", GEMMA4_31B_CHAT_TEMPLATE), ("Gemma 4 E2B/E4B", GEMMA4_E_CHAT_TEMPLATE),
                            ("Gemma 3", GEMMA3_CHAT_TEMPLATE))}
    return pd.DataFrame({"generation prompt": rows}).rename_axis("format")


def compare_chat_formats(tokenizer, messages: list[dict]):
    """The same chat through Gemma 4's template and through Gemma 3's (the paper's port trap): how the tokenizer
    splits each turn marker, and whether a loss mask can be built."""
    import pandas as pd

    rows = []
    for name, template, marker in (("Gemma 4 (this tokenizer's)", None, "<|turn>"),
                                   ("Gemma 3 (the paper's training format)", GEMMA3_CHAT_TEMPLATE, "<start_of_turn>")):
        pieces = tokenizer.convert_ids_to_tokens(tokenizer(marker, add_special_tokens=False)["input_ids"])
        try:
            ids, mask = chat_tokens.tokenize_example(tokenizer, messages, template)
            result = f"{int(mask.sum())} of {len(ids)} tokens trained"
        except data.DataError as e:
            result = f"DataError: {e}"
        rows.append({"format": name, "turn marker": marker, "tokens of the marker": len(pieces),
                     "as": " ".join(pieces), "loss mask": result})
    return pd.DataFrame(rows)


def show_target(row: dict, spec) -> str:
    """A row's response and what a DataSpec trains on from it, one above the other (the tags that are left, if any)."""
    target = chat_tokens.training_target(row["response"], spec.target)
    left = sorted(set(re.findall(r"</?(?:think|answer)>", target)))
    return (f"--- response ({len(row['response'])} chars)\n{row['response']}\n\n"
            f"--- trained on (target={spec.target!r}, {len(target)} chars; tags left: {left or 'none'})\n{target}")


def show_row(spec, tokenizer, index: int) -> dict:
    """Row ``index`` of the data ``spec`` names (in source order) as ``chat_tokens.show_example`` shows it: what is
    trained (``data-stats --show-example``)."""
    rows = data.load_profile_rows(spec)
    if not 0 <= index < len(rows):
        raise data.DataError(f"--show-example {index}: the data has rows 0 to {len(rows) - 1}.")
    return chat_tokens.show_example(tokenizer, chat_tokens.spec_messages(rows[index], spec))


def length_histogram(lengths, max_seq_len: int):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.hist(lengths, bins=40, color="tab:blue")
    ax.axvline(max_seq_len, color="tab:red", linestyle="--", label=f"max_seq_len = {max_seq_len}")
    ax.set_xlabel("tokens per example")
    ax.set_ylabel("examples")
    ax.set_title(f"example lengths (mean {np.mean(lengths):.0f}, max {np.max(lengths)})")
    ax.legend()
    fig.tight_layout()
    return fig


def token_use_table(prepared, max_seq_len: int, codev_max_seq_len: int = 3072):
    """Packed vs pad-to-max token use: on this profile's data, and on a CodeV-R1-like length distribution."""
    import pandas as pd

    ours = packing.token_use_for_lengths(prepared.lengths, max_seq_len)
    codev = packing.token_use_for_lengths(packing.codev_like_lengths(), codev_max_seq_len)
    return pd.DataFrame([
        {"data": "this profile's data", "max_seq_len": max_seq_len, "packed token use": ours["packed"],
         "pad-to-max token use": ours["pad_to_max"], "rows packed": ours["packed_rows"],
         "rows padded": ours["padded_rows"]},
        {"data": "CodeV-R1-like (mean 922, p99 2553)", "max_seq_len": codev_max_seq_len,
         "packed token use": codev["packed"], "pad-to-max token use": codev["pad_to_max"],
         "rows packed": codev["packed_rows"], "rows padded": codev["padded_rows"]},
    ])
