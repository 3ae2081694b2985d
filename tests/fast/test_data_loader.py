import dataclasses
import json
import re

import pytest

from gemma_tpu_helpers.course.config import paths, profiles
from gemma_tpu_helpers.course.views import data_views
from gemma_tpu_helpers.fixes.train import chat_tokens, data
from support import SHIPPED


def test_shipped_rows():
    ds = data.load_rows(**SHIPPED)
    assert len(ds) >= 200
    assert {"system", "prompt", "response"} <= set(ds.column_names)  # the real SFT columns
    assert "```verilog" in ds[0]["response"] and ds[0]["prompt"].strip()


# ------------------------------------------------------------------------------------ the CodeV-R1 layout replica


def test_replica_loads_through_the_real_call():
    """The shipped replica takes exactly the arguments of the real repository: path, config "sft", split "train"."""
    import datasets

    real = profiles.get_profile("v5p-8").data
    assert (real.source, real.config, real.split, real.columns) == ("zhuyaoyu/CodeV-R1-dataset", "sft", "train", ())
    ds = data.load_rows(str(paths.SHIPPED_REPLICA), config=real.config, split=real.split,
                        columns=dict(real.columns) or None)
    assert ds["prompt"] == data.load_rows(**SHIPPED)["prompt"] and len(ds) == 270
    # the call load_rows makes is datasets' own, with the same positional config
    assert data.load_dataset_args("zhuyaoyu/CodeV-R1-dataset", "sft") == (("zhuyaoyu/CodeV-R1-dataset", "sft"), {})
    assert len(datasets.load_dataset(str(paths.SHIPPED_REPLICA), "sft", split="train")) == 270
    # the paper's form of the call, data_files= with no config, reads the same rows
    same = datasets.load_dataset(str(paths.SHIPPED_REPLICA), data_files="codev_r1_sft.jsonl", split="train")
    assert same["response"] == ds["response"]


def test_missing_config_is_a_data_error_that_lists_the_configs():
    with pytest.raises(data.DataError, match=r"(?s)Config name is missing.*\['sft', 'rl'\].*DataSpec.config") as e:
        data.load_rows(str(paths.SHIPPED_REPLICA), split="train")
    assert type(e.value.__cause__) is ValueError  # datasets' own error, kept as the cause
    with pytest.raises(data.DataError, match=r"'nope' not found. Available: \['sft', 'rl'\]"):
        data.load_rows(str(paths.SHIPPED_REPLICA), config="nope")


def test_missing_split_is_a_data_error_that_lists_the_splits():
    with pytest.raises(data.DataError, match=r"(?s)config 'sft', split 'test'.*Should be one of \['train'\]"):
        data.load_rows(**SHIPPED, split="test")


def test_the_old_columns_are_a_data_error_that_lists_the_real_ones():
    """The profile used to rename question/answer, which the real rows do not have."""
    with pytest.raises(data.DataError, match=r"no column\(s\) \['question', 'answer'\].*'system', 'prompt', "
                                             r"'response'"):
        data.load_rows(**SHIPPED, columns={"question": "prompt", "answer": "response"})


def test_rl_config_of_the_replica():
    """The rl config's files sit beside the SFT rows, in the verl schema. datasets 5.2 reads every config of this
    mixed jsonl/parquet repository with one builder (json), so `load_dataset(repo, "rl")` fails here; read the RL
    parquet with the parquet builder. When this test fails, datasets reads the rl config itself: use that."""
    import datasets

    with pytest.raises(data.DataError, match=r"Could not read the files of .*config 'rl'"):
        data.load_rows(str(paths.SHIPPED_REPLICA), config="rl", split="validation")
    rl = datasets.load_dataset("parquet", split="train",
                               data_files=str(paths.SHIPPED_REPLICA / "codev_r1_rl_train.parquet"))
    assert {"data_source", "prompt", "ability", "reward_model", "extra_info"} == set(rl.column_names)
    row = rl[0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert row["reward_model"]["ground_truth"].lstrip().startswith("module ")
    sft_code = {chat_tokens.training_target(r, "verilog") for r in data.load_rows(**SHIPPED)["response"]}
    ground_truths = {f"```verilog\n{x['ground_truth']}\n```" for x in rl["reward_model"]}
    assert len(ground_truths) == len(rl) and not ground_truths & sft_code, "RL rows repeat no SFT module"


def test_row_limit_keeps_the_first_rows():
    assert data.load_rows(**SHIPPED, max_rows=10)["id"] == data.load_rows(**SHIPPED)["id"][:10]
    assert len(data.load_rows(**SHIPPED, max_rows=10**6)) == 270
    with pytest.raises(data.DataError, match="max_rows must be a positive"):
        data.load_rows(**SHIPPED, max_rows=0)
    assert profiles.get_profile("v5p-8").data.max_rows == 10_000  # the paper's first 10,000 rows
    assert len(data.load_profile_rows(dataclasses.replace(profiles.get_profile("smoke").data, max_rows=7))) == 7


# ------------------------------------------------------------------------------------ responses in the real format

FENCE = "```verilog\nmodule inv(input a, output y);\n  assign y = ~a;\nendmodule\n```"
SUB = "```verilog\nmodule buf1(input a, output y);\n  assign y = a;\nendmodule\n```"
REAL = f"<think>\nInvert the input.\n</think>\n<answer>\nHere is the module.\n\n{FENCE}\n\nIt is one gate.\n</answer>"


@pytest.mark.parametrize("response, answer, verilog", [
    # the real form: reasoning, then prose around the fence inside <answer>
    (REAL, f"Here is the module.\n\n{FENCE}\n\nIt is one gate.", FENCE),
    # no <answer> tags: everything after the reasoning
    (f"<think>x</think>\nHere it is.\n{FENCE}", f"Here it is.\n{FENCE}", FENCE),
    # two fences: both kept, in order
    (f"<think>x</think><answer>\nA helper first.\n{SUB}\nThen the top.\n{FENCE}\n</answer>",
     f"A helper first.\n{SUB}\nThen the top.\n{FENCE}", f"{SUB}\n\n{FENCE}"),
    # an <answer> never closed (cut off): up to the end
    (f"<think>x</think>\n<answer>\n{FENCE}", FENCE, FENCE),
    # no reasoning, no tags: unchanged
    (f"Plain.\n{FENCE}", f"Plain.\n{FENCE}", FENCE),
    # an answer with no fence: the answer itself
    ("<think>x</think><answer>No code here.</answer>", "No code here.", "No code here."),
    # reasoning cut off before </think>: nothing to train on
    ("<think>never closed", "", ""),
])
def test_training_targets_of_real_format_rows(response, answer, verilog):
    assert chat_tokens.training_target(response, "answer") == answer
    assert chat_tokens.training_target(response, "verilog") == verilog
    assert chat_tokens.training_target(response, "full") == response
    for text in (answer, verilog):
        assert not any(tag in text for tag in ("<think>", "</think>", "<answer>", "</answer>"))


def test_every_shipped_row_becomes_a_target_without_tags():
    rows = data.load_rows(**SHIPPED)
    for target in ("answer", "verilog"):
        for r in rows:
            text = chat_tokens.training_target(r["response"], target)
            assert "```verilog\n" in text and not re.search(r"</?(think|answer)>", text), (target, r["id"])
    assert sum("<answer>" in r for r in rows["response"]) == 243  # nine rows in ten in the real form
    with pytest.raises(data.DataError, match="target must be one of"):
        chat_tokens.training_target(REAL, "answers")


@pytest.mark.parametrize("system, expected", [("none", None), ("fixed", "Be terse."), ("row", "from the row")])
def test_system_turn_is_a_setting(system, expected):
    row = {"system": "from the row", "prompt": "Write inv.", "response": REAL}
    messages = chat_tokens.to_messages(row, system_prompt="Be terse.", system=system, target="verilog")
    assert [m["role"] for m in messages] == ([] if expected is None else ["system"]) + ["user", "assistant"]
    assert expected is None or messages[0]["content"] == expected
    assert messages[-1]["content"] == FENCE
    with pytest.raises(data.DataError, match="system must be one of"):
        chat_tokens.to_messages(row, system="rows")


def test_profiles_choose_no_system_turn_and_the_real_target():
    for name in ("v5p-8", "v5p-16", "v6e-8"):
        spec = profiles.get_profile(name).data
        assert (spec.system, spec.target, spec.system_prompt) == ("none", "verilog", None), name
    smoke = profiles.get_profile("smoke").data
    assert ((smoke.source, smoke.config, smoke.system) == (str(paths.SHIPPED_REPLICA), "sft", "none")
            and smoke.strip_think)
    row = data.load_rows(**SHIPPED)[0]
    assert [m["role"] for m in chat_tokens.spec_messages(row, smoke)] == ["user", "assistant"]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"prompt": f"Write module m{i}.", "response": f"```verilog\nmodule m{i}; endmodule\n```"} for i in range(5)]


def test_local_file_and_dataset_directory_take_the_same_path(tmp_path):
    f = _write_jsonl(tmp_path / "rows.jsonl", ROWS)
    assert data.load_rows(str(f))["prompt"] == [r["prompt"] for r in ROWS]
    # A dataset directory (the layout of a Hub dataset repo) is loaded by the same call as a Hub id.
    repo = tmp_path / "CodeV-R1-like"
    (repo / "data").mkdir(parents=True)
    _write_jsonl(repo / "data" / "train.jsonl", ROWS)
    ds = data.load_rows(str(repo), split="train")
    assert len(ds) == 5 and ds[2]["response"] == ROWS[2]["response"]


def test_column_mapping(tmp_path):
    f = _write_jsonl(tmp_path / "alt.jsonl", [{"instruction": r["prompt"], "output": r["response"]} for r in ROWS])
    with pytest.raises(data.DataError, match=r"lacks column\(s\) \['prompt', 'response'\].*instruction"):
        data.load_rows(str(f))
    ds = data.load_rows(str(f), columns={"instruction": "prompt", "output": "response"})
    assert ds[0]["prompt"] == ROWS[0]["prompt"]


def test_bad_sources(tmp_path):
    with pytest.raises(data.DataError, match="unsupported file type"):
        (tmp_path / "rows.txt").write_text("x")
        data.load_rows(str(tmp_path / "rows.txt"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(Exception):
        data.load_rows(str(empty))


def test_notebook_views_of_the_load_call_and_the_target():
    real, smoke = profiles.get_profile("v5p-8").data, profiles.get_profile("smoke").data
    assert data.load_call(real) == ("datasets.load_dataset('zhuyaoyu/CodeV-R1-dataset', 'sft', split='train'), "
                                    "then the first 10,000 rows")
    assert data.load_call(smoke) == f"datasets.load_dataset({str(paths.SHIPPED_REPLICA)!r}, 'sft', split='train')"
    row = data.load_rows(**SHIPPED)[0]
    view = data_views.show_target(row, real)
    assert view.startswith("--- response") and "<answer>" in view.split("--- trained on")[0]
    trained = view.split("--- trained on", 1)[1]
    assert "tags left: none" in trained and "<answer>" not in trained and "<think>" not in trained
    assert "tags left: ['</answer>', '</think>', '<answer>', '<think>']" in data_views.show_target(
        row, dataclasses.replace(real, target="full"))


