"""The host a user brings: `make` finds a Python of 3.11 or later (a stock TPU VM's python3 is 3.10) or stops in one
line that names the ways out, and a test run ends with a line that says what it skipped and why. Both run for real:
make on a PATH of stand-in interpreters, pytest in a child process with this suite's plugin."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from support import REPO

pytestmark = pytest.mark.skipif(not shutil.which("make"), reason="make is not installed")


def fake_python(bin_dir, name: str, version: str) -> None:
    """An interpreter on PATH that reports ``version`` (what tools/find_python.sh asks it) and does nothing else."""
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(0o755)


def make_venv(tmp_path, pythons: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """`make -n -B venv` (what would build .venv, nothing run) on a PATH whose only interpreters are ``pythons``
    (name -> version), besides make and the shell."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("make", "sh", "bash", "env"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    for name, version in pythons.items():
        fake_python(bin_dir, name, version)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    return subprocess.run(["make", "-n", "-B", "--no-print-directory", "venv", f"VENV={tmp_path / 'venv'}", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_make_stops_in_one_line_when_python3_is_too_old(tmp_path):
    r = make_venv(tmp_path, {"python3": "3.10.12"})
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert "Python 3.11 or later" in line and "python3 is 3.10.12" in line
    assert "make PYTHON=" in line and "make tpu-venv" in line


def test_make_takes_a_newer_python_when_python3_is_too_old(tmp_path):
    r = make_venv(tmp_path, {"python3": "3.10.12", "python3.12": "3.12.3"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"python3.12 -m venv {tmp_path / 'venv'}"


def test_make_refuses_a_python_given_that_is_too_old(tmp_path):
    r = make_venv(tmp_path, {"python3": "3.12.3", "python3.10": "3.10.12"}, "PYTHON=python3.10")
    assert r.returncode == 2 and "PYTHON=python3.10 is Python 3.10.12" in r.stderr
    assert len(r.stderr.splitlines()) == 1


def test_a_run_ends_with_what_it_skipped_and_why(tmp_path):
    """This suite's plugin (tests/scheduling.py) in a pytest run on three skips and a pass: the last line counts the
    skips per reason, most first."""
    (tmp_path / "test_demo.py").write_text(textwrap.dedent("""
        import pytest
        venv = pytest.mark.skipif(True, reason="no serving venv: run `make serve-venv`")
        @venv
        def test_a(): pass
        @venv
        def test_b(): pass
        def test_c(): pytest.skip("install Icarus Verilog 12: make iverilog")
        def test_d(): pass
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "scheduling", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), str(tmp_path / "test_demo.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == ("skipped 3 tests: 2 x no serving venv: run `make serve-venv`; "
                                         "1 x install Icarus Verilog 12: make iverilog")
