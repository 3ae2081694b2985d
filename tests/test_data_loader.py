import json

import pytest

from gemma_tpu_helpers import data


def test_shipped_rows():
    ds = data.load_rows("shipped")
    assert len(ds) >= 200
    assert "```verilog" in ds[0]["response"] and ds[0]["prompt"].strip()


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
