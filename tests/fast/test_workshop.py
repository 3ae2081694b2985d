"""On the day: `setup --check` says in one screen whether a machine is ready."""

import shutil

import pytest

from gemma_tpu_helpers.course.front import workshop
from support import run_cli


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
