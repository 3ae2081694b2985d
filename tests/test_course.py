import json
import subprocess
import sys

import nbformat
from conftest import run_cli
from nbformat.v4 import new_code_cell, new_notebook

from gemma_tpu_helpers.course import logbook


def test_record_and_report(tmp_path):
    logbook.record(tmp_path, "00_setup", parity_rel="2.1e-05")
    logbook.record(tmp_path, "06_training", final_loss=1.5, step=8)  # a figure may be called "step"
    logbook.record(tmp_path, "00_setup", parity_rel="3.0e-05")  # a rerun replaces the step's figures
    text = logbook.write_report(tmp_path).read_text()
    assert "| parity_rel | 3.0e-05 |" in text and "2.1e-05" not in text
    assert text.index("## 00_setup") < text.index("## 06_training") and "| step | 8 |" in text


_RECORD = """
import sys
from gemma_tpu_helpers.course import logbook
for i in range(40):
    logbook.record(sys.argv[1], f"{sys.argv[2]}_{i:02d}", i=i)
"""


def test_notebooks_recording_at_once_lose_no_step(tmp_path):
    """Two kernels (or CI's two notebook runs) recording into one run directory: every step survives."""
    procs = [subprocess.Popen([sys.executable, "-c", _RECORD, str(tmp_path), name]) for name in ("a", "b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    data = json.loads((tmp_path / "figures.json").read_text())
    assert sorted(data) == sorted(f"{n}_{i:02d}" for n in "ab" for i in range(40))


def test_course_map_marks_available_notebooks():
    table = logbook.course_map()
    assert list(table["notebook"])[:2] == ["00_setup", "01_mesh_setup"]
    assert table.set_index("notebook").loc["00_setup", "available"]


def test_run_notebooks_keeps_going_in_order_and_stops_on_error(tmp_path):
    paths = []
    for name, src in [("00_ok", "x = 1 + 1"), ("01_fail", "raise RuntimeError('boom')"), ("02_never", "y = 2")]:
        nb = new_notebook(cells=[new_code_cell(src)])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        p = tmp_path / f"{name}.ipynb"
        nbformat.write(nb, p)
        paths.append(p)
    run_dir = tmp_path / "runs" / "smoke"
    results = logbook.run_notebooks("smoke", run_dir, notebooks=paths, timeout=120)
    assert [r["notebook"] for r in results] == ["00_ok", "01_fail"]
    assert results[0]["error"] is None and "boom" in (results[1]["error"] + json.dumps(
        nbformat.read(run_dir / "executed" / "01_fail.ipynb", 4).cells[0].outputs))
    assert (run_dir / "executed" / "00_ok.ipynb").is_file()


def test_cli_help_lists_steps():
    r = run_cli("--help")
    assert r.returncode == 0
    for step in ("setup", "tiny-model", "parity", "mesh", "demo", "report"):
        assert step in r.stdout


def test_cli_setup_prints_the_memory_estimate():
    r = run_cli("setup", "--profile", "v5p-8", env={"JAX_PLATFORMS": "cpu"})
    assert r.returncode == 2 and "pre-flight failed (tpu" in r.stderr, r.stderr[-2000:]  # the report, then: no TPU here
    from gemma_tpu_helpers.fixes import gemma4

    assert f"{gemma4.param_count(gemma4.GEMMA4_31B_TEXT_CONFIG):,}" in r.stdout and "00_setup" in r.stdout
