"""Every notebook follows the conventions in notebooks/README.md, and is stored without outputs."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS and NOTEBOOKS[0].name == "00_setup.ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_conventions(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    md = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert not [c for c in code if c.get("outputs") or c.get("execution_count")], "run nbstripout on it"
    first = code[0]
    assert "parameters" in first["metadata"].get("tags", []), "the first code cell must be tagged `parameters`"
    src = "".join(first["source"])
    assert "GEMMA_TPU_PROFILE" in src and "configure_jax" in src and "import jax" not in src
    assert "find_spec" in "".join(code[1]["source"]), "the second code cell is the guarded Colab install"
    for heading in ("What you will learn", "The paper's problem", "Time.", "On Colab", "Use it in your project",
                    "Troubleshooting"):
        assert heading in md, heading
