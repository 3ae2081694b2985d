import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

from gemma_tpu_helpers.course.front import logbook
from gemma_tpu_helpers.fixes.model import model_size
from support import run_cli


def test_record_and_report(tmp_path):
    logbook.record(tmp_path, "00_setup", parity_rel="2.1e-05")
    logbook.record(tmp_path, "06_training", final_loss=1.5, step=8)  # a figure may be called "step"
    logbook.record(tmp_path, "00_setup", parity_rel="3.0e-05")  # a rerun replaces the step's figures
    text = logbook.write_report(tmp_path).read_text()
    assert "| parity_rel | 3.0e-05 |" in text and "2.1e-05" not in text
    assert text.index("## 00_setup") < text.index("## 06_training") and "| step | 8 |" in text


_RECORD = """
import sys
from gemma_tpu_helpers.course.front import logbook
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


# ipykernel 7's warning when a kernel listens on TCP without CurveZMQ keys: once per notebook, on stderr
TCP_WARNING = "Kernel is running over TCP without encryption"
# the kernel checks its own transport: a notebook that starts over TCP fails, warning or not
IPC_CELL = ("from ipykernel.kernelapp import IPKernelApp\n"
            "assert IPKernelApp.instance().transport == 'ipc', IPKernelApp.instance().transport")


def _transport_notebook(path):
    nb = new_notebook(cells=[new_code_cell(IPC_CELL)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_make_demo_starts_kernels_over_ipc_without_the_tcp_warning(tmp_path, monkeypatch, capfd):
    """`make demo` (``logbook.run_notebooks``): the kernel, a child process writing to this process's stderr, runs
    over ipc and does not warn. Its sockets live in Jupyter's runtime dir and are gone after the run."""
    for name in ("GEMMA_TPU_PROFILE", "GEMMA_TPU_RUNS"):  # run_notebooks sets them
        monkeypatch.setenv(name, "")
    path = _transport_notebook(tmp_path / "00_ipc.ipynb")
    with tempfile.TemporaryDirectory(prefix="rt") as runtime:  # short: tmp_path is too long for a socket's path
        monkeypatch.setenv("JUPYTER_RUNTIME_DIR", runtime)
        results = logbook.run_notebooks("smoke", tmp_path / "runs" / "smoke", notebooks=[path], timeout=120)
        assert results[0]["error"] is None, results
        assert not [p for p in Path(runtime).iterdir() if "-ipc-" in p.name]
    err = capfd.readouterr().err
    assert TCP_WARNING not in err, err[-2000:]


def test_nbmake_starts_kernels_over_ipc_without_the_tcp_warning(tmp_path):
    """`make test`'s nbmake runs: notebooks/conftest.py, beside a notebook, gives nbmake's kernels the same start."""
    shutil.copy(logbook.NOTEBOOKS_DIR / "conftest.py", tmp_path / "conftest.py")
    _transport_notebook(tmp_path / "ipc.ipynb")
    r = subprocess.run([sys.executable, "-m", "pytest", "--nbmake", "-q", "-p", "no:cacheprovider", "ipc.ipynb"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert TCP_WARNING not in r.stdout + r.stderr


def test_kernel_config_falls_back_to_tcp_when_the_socket_path_is_too_long(tmp_path, monkeypatch):
    with tempfile.TemporaryDirectory(prefix="rt") as runtime:
        monkeypatch.setenv("JUPYTER_RUNTIME_DIR", runtime)
        km = logbook.kernel_config().KernelManager
        assert km.transport == "ipc" and km.ip.startswith(runtime + "/kernel-")
        assert logbook.kernel_config().KernelManager.ip != km.ip  # one socket path per kernel
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / ("x" * 100)))
    assert "transport" not in logbook.kernel_config().KernelManager


def test_cli_help_lists_steps():
    r = run_cli("--help")
    assert r.returncode == 0
    for step in ("setup", "tiny-model", "parity", "mesh", "demo", "report"):
        assert step in r.stdout


def test_cli_setup_prints_the_memory_estimate():
    r = run_cli("setup", "--profile", "v5p-8", env={"JAX_PLATFORMS": "cpu"})
    assert r.returncode == 2 and "pre-flight failed (tpu" in r.stderr, r.stderr[-2000:]  # the report, then: no TPU here
    from gemma_tpu_helpers.fixes.model import gemma4

    assert f"{model_size.param_count(gemma4.GEMMA4_31B_TEXT_CONFIG):,}" in r.stdout and "00_setup" in r.stdout
