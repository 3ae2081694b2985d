"""The install path for the runtimes people get: Colab (Python 3.12) and a stock TPU VM (Python 3.10).

What is checked: `uv pip compile` resolves requirements-tpu.txt against the package index for each target Python on
x86_64 glibc 2.35 (Ubuntu 22.04, the TPU VM and Colab base), with the exact pins we ship; 3.10 is refused because
google-tunix 0.1.7 needs >= 3.11, which is why tools/tpu_venv.sh builds the venv on a uv-managed Python. What is not
checked here: that the wheels install and import on a TPU (no TPU), and uv's download of a managed CPython (this
machine cannot reach GitHub; the script is run with the local 3.11 instead). These tests need the package index
(PyPI), which CI reaches; each compile takes 10-20 s.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gemma_tpu_helpers.course.config import profiles
from support import REPO

UV = Path(sys.executable).parent / "uv"
PLATFORM = "x86_64-manylinux_2_35"


def compile_(requirements, python_version):
    return subprocess.run(
        [str(UV), "pip", "compile", "--no-header", "--quiet", "--python-version", python_version,
         "--python-platform", PLATFORM, str(REPO / requirements)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )


@pytest.mark.parametrize("python_version", ["3.11", "3.12"])
def test_tpu_pins_resolve(python_version):
    out = compile_("requirements-tpu.txt", python_version)
    assert out.returncode == 0, out.stderr
    pins = {line.split("==")[0]: line.split("==")[1].split()[0]
            for line in out.stdout.splitlines() if "==" in line and not line.startswith(" ")}
    assert pins["jax"] == "0.10.2" and pins["jaxlib"] == "0.10.2", pins
    assert pins["google-tunix"] == "0.1.7" and pins["qwix"] == "0.1.8", pins
    assert "libtpu" in pins, "jax[tpu] should bring libtpu"


def test_colab_pins_resolve_for_colabs_python():
    """What every notebook's install cell installs on a Colab TPU runtime (Python 3.12)."""
    out = compile_("requirements-colab.txt", "3.12")
    assert out.returncode == 0, out.stderr
    pins = {line.split("==")[0]: line.split("==")[1].split()[0]
            for line in out.stdout.splitlines() if "==" in line and not line.startswith(" ")}
    assert pins["jax"] == "0.10.2" and pins["google-tunix"] == "0.1.7" and "libtpu" in pins, pins
    assert "jupyterlab" not in pins and "pytest" not in pins, "the development tools stay out of Colab's install"


def test_python_310_is_refused_for_tunix():
    """If this ever resolves, a stock TPU VM's own python3 would do and tools/tpu_venv.sh could go."""
    out = compile_("requirements-tpu.txt", "3.10")
    assert out.returncode != 0
    assert "google-tunix" in out.stderr and "3.11" in out.stderr, out.stderr


def test_tpu_venv_script_builds_a_venv(tmp_path):
    """tools/tpu_venv.sh end to end with a one-package requirements file (the full stack is GBs)."""
    req = tmp_path / "r.txt"
    req.write_text("six==1.17.0\n")
    env = dict(os.environ, PATH=f"{UV.parent}:{os.environ['PATH']}",
               GEMMA_TPU_PYTHON=f"{sys.version_info.major}.{sys.version_info.minor}")
    out = subprocess.run([str(REPO / "tools/tpu_venv.sh"), str(tmp_path / "venv"), str(req)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok:" in out.stdout
    check = subprocess.run([str(tmp_path / "venv/bin/python"), "-c", "import six, gemma_tpu_helpers"],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


@pytest.mark.skipif(not UV.is_file(), reason="uv is not installed in this venv")
def test_vllm_tpu_resolves_for_colabs_python_beside_no_tunix():
    """The wheel the pip route installs (PyPI has cp312 wheels of vllm-tpu 0.32.0) resolves for Python 3.12 on
    x86_64 glibc 2.35 (Colab), and pins a jax tunix's stack does not: why it gets the serving venv. Needs PyPI."""
    prof = profiles.get_profile("colab-v5e-1")
    out = subprocess.run([str(UV), "pip", "compile", "--no-header", "--quiet", "--python-version", "3.12",
                          "--python-platform", "x86_64-manylinux_2_35", "-"],
                         input=f"vllm-tpu=={prof.serve.pip_version}\n", capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    pins = {line.split("==")[0]: line.split("==")[1].split()[0] for line in out.stdout.splitlines() if "==" in line}
    assert pins["vllm-tpu"] == pins["tpu-inference"] == prof.serve.pip_version
    assert pins["jax"] != "0.10.2" and "libtpu" in pins, pins  # tunix's jax is 0.10.2 (requirements-tpu.txt)
    assert pins["transformers"].startswith("5.19"), pins  # the CPU build's transformers: the same vLLM
