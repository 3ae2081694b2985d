"""On the day: `setup --check` says in one screen whether a machine is ready, and the Colab link of a notebook."""

import shutil

import pytest

from gemma_tpu_helpers.course import workshop
from support import run_cli

NB = "02_lora_naming"
URL = "https://colab.research.google.com/github/acme/gemma-tpu/blob/{}/notebooks/02_lora_naming.ipynb"


@pytest.mark.parametrize("repo", ["https://github.com/acme/gemma-tpu", "https://github.com/acme/gemma-tpu.git",
                                  "git@github.com:acme/gemma-tpu.git", "https://github.com/acme/gemma-tpu/"])
def test_colab_url_from_the_repo_url(repo, monkeypatch):
    monkeypatch.delenv(workshop.BRANCH_ENV, raising=False)
    assert workshop.colab_url(NB, repo=repo) == URL.format("main")
    monkeypatch.setenv(workshop.BRANCH_ENV, "workshop-day")
    assert workshop.colab_url(NB + ".ipynb", repo=repo) == URL.format("workshop-day")


def test_colab_link_is_silent_without_a_repo_and_clear_for_a_non_github_one(monkeypatch, capsys):
    monkeypatch.delenv(workshop.REPO_ENV, raising=False)
    assert workshop.colab_link(NB) is None and capsys.readouterr().out == ""
    monkeypatch.setenv(workshop.REPO_ENV, "https://gitlab.com/acme/gemma-tpu.git")
    assert workshop.colab_link(NB) is None and "GitHub only" in capsys.readouterr().out
    monkeypatch.setenv(workshop.REPO_ENV, "https://github.com/acme/gemma-tpu")
    assert workshop.colab_link(NB) == URL.format("main") and "Open in Colab: https://colab" in capsys.readouterr().out


def test_setup_check_lists_every_item_with_a_fix(tmp_path):
    r = run_cli("setup", "--check", "--profile", "smoke", "--runs", tmp_path / "runs")
    names = ["training venv", "serving venv", "iverilog", "devices", "CPU cores", "free RAM", "free disk",
             "tiny model", "pre-built run", "chromium", "vLLM server"]
    lines = r.stdout.splitlines()
    for name in names:
        assert any(name in line for line in lines), (name, r.stdout)
    # an empty runs dir: the tiny model is missing, which is a FAIL with the command that builds it
    assert r.returncode == 1 and "FAIL  tiny model" in r.stdout and "tiny-model" in r.stdout
    assert "setup --check --serve" in r.stdout and r.stdout.rstrip().endswith("item(s) to fix")
    assert len(lines) <= 30, "one screen"


def test_format_items_marks_ready_only_without_failures():
    ok = [workshop.Item("a", workshop.OK, "fine"), workshop.Item("b", workshop.WARN, "slow", "close things")]
    assert workshop.format_items(ok).endswith("ready") and "-> close things" in workshop.format_items(ok)
    bad = ok + [workshop.Item("c", workshop.FAIL, "missing", "install it")]
    assert workshop.format_items(bad).endswith("not ready: 1 item(s) to fix")


@pytest.mark.slow
def test_setup_check_serve_starts_vllm(tiny_dir, tmp_path):
    shutil.copytree(tiny_dir, tmp_path / "runs" / "smoke" / "base")
    items = {i.name: i for i in workshop.readiness("smoke", serve=True, runs=str(tmp_path / "runs"))}
    assert items["tiny model"].status == workshop.OK
    assert items["vLLM server"].status == workshop.OK, items["vLLM server"]
