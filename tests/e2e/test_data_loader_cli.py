"""Data from a copy of the CodeV-R1 repository, as a user types it: data-stats from another directory with a
relative --source (two CLI runs, about 50 s). The loader's rules: tests/fast/test_data_loader.py."""

import json

import pytest

from gemma_tpu_helpers.course.config import paths, profiles
from gemma_tpu_helpers.fixes.train import data
from support import SHIPPED


def test_a_copy_of_the_repository_keeps_the_profiles_config(tmp_path, tiny_dir):
    """A pod or a VM without the Hub trains from a copy of CodeV-R1's repository (README with its sft and rl
    configs): `--source DIR` keeps the profile's config "sft", which the copy needs as the original does (before, it
    dropped it and datasets said "Config name is missing"); a single file has no configs; --config overrides."""
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "copies" / "CodeV-R1-dataset"
    shutil.copytree(paths.SHIPPED_REPLICA, copy)
    real = profiles.get_profile("v5p-8").data
    spec = data.with_source(real, str(copy))
    assert (spec.source, spec.config, spec.max_rows) == (str(copy), "sft", real.max_rows)
    assert data.load_profile_rows(spec)["prompt"] == data.load_rows(**SHIPPED)["prompt"]
    assert data.with_source(real, str(copy), "rl").config == "rl"
    with pytest.raises(data.DataError, match=r"Config name is missing.*config=\.\.\.") as e:  # a caller's terms
        data.load_profile_rows(data.with_source(real, str(copy), data.NO_CONFIG))
    assert "--config" not in str(e.value) and e.value.params == ("config", "split")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "p", "response": "```verilog\nmodule m; endmodule\n```"}) + "\n")
    assert data.with_source(real, str(rows)).config is None  # a file has no configs

    # as a user types it, from another directory, a relative path; the tokenizer from the replica of the 31B's files
    work = tmp_path / "work"
    work.mkdir()
    cmd = [sys.executable, "-m", "gemma_tpu_helpers", "data-stats", "--profile", "v5p-8", "--base", str(tiny_dir)]
    r = subprocess.run(cmd + ["--source", "../copies/CodeV-R1-dataset"], cwd=work, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "packed token use" in r.stdout, r.stderr[-3000:]
    r = subprocess.run(cmd + ["--source", "../copies/CodeV-R1-dataset", "--config", "none"], cwd=work,
                       capture_output=True, text=True, timeout=600)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "config is --config NAME" in err[0], r.stderr[-3000:]
