"""The serving venv (.venv-serve) holds vLLM's CPU build, apart from the training stack it cannot share."""

import json
import os
import subprocess
from importlib import metadata

import support

SERVE_PY = support.serve_python()

PROBE = """
import json, importlib.metadata as m, importlib.util as u
import vllm
print(json.dumps({"vllm": vllm.__version__, "transformers": m.version("transformers"),
                  "safetensors": m.version("safetensors"), "torchvision": u.find_spec("torchvision") is not None}))
"""


@support.needs_serve_venv
def test_serve_venv_has_vllm_032_and_its_own_pins():
    out = subprocess.run([str(SERVE_PY), "-c", PROBE], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert out.returncode == 0, out.stderr[-2000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["vllm"].startswith("0.32.0")
    assert info["transformers"].startswith("5.19") and info["safetensors"].startswith("0.8")
    assert not info["torchvision"], "PyPI's torchvision breaks beside the CPU torch; `make serve-venv` removes it"
    # ...which is why training cannot share it: tunix needs safetensors < 0.8.
    assert metadata.version("safetensors") < "0.8" and metadata.version("transformers").startswith("5.12")
