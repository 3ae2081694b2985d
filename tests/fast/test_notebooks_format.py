"""Every notebook follows the conventions in notebooks/README.md, and is stored without outputs."""

import json

import pytest

from support import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


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
    install = "".join(code[1]["source"])
    assert "find_spec" in install, "the second code cell is the guarded Colab install"
    # the slim Colab install, the restart check once, then the token from Secrets and the runs on Drive (colab.py)
    for part in ('REPO_URL = "', "requirements-colab.txt", "colab.stop_for_restart(preloaded)", "colab.setup(profile)"):
        assert part in install, part
    for heading in ("What you will learn", "The paper's problem", "Time.", "On Colab", "Use it in your project",
                    "Troubleshooting"):
        assert heading in md, heading


def test_make_test_runs_every_notebook_once_and_the_pipeline_in_order():
    """`make test` runs the notebooks as two nbmake runs side by side: a new notebook must land in one of them (and
    only one), and 06-09, which build on each other, must stay in order in the same run."""
    import re
    import shutil
    import subprocess

    if not shutil.which("make"):
        pytest.skip("make is not installed")
    repo = NOTEBOOKS[0].parent.parent
    out = subprocess.run(["make", "-n", "--no-print-directory", "test-notebooks-pipeline", "test-notebooks-rest"],
                         cwd=repo, capture_output=True, text=True, check=True).stdout
    runs = [re.findall(r"notebooks/(\d\d_\w+)\.ipynb", line) for line in out.splitlines() if "--nbmake" in line]
    assert len(runs) == 2
    assert sorted(sum(runs, [])) == [p.stem for p in NOTEBOOKS]
    assert runs[0] == sorted(runs[0]) and [n[:2] for n in runs[0]] == ["06", "07", "08", "09"]


# #62's budgets: a lesson is its code, the words say why once. Markdown only (code cells and outputs do not count);
# words as str.split counts them. The README is a front page; the reference lives in docs/.
NOTEBOOK_WORDS, COURSE_WORDS, README_WORDS = 1_000, 9_000, 3_000


def markdown_words(path) -> int:
    cells = json.loads(path.read_text())["cells"]
    return sum(len("".join(c["source"]).split()) for c in cells if c["cell_type"] == "markdown")


def test_the_lessons_keep_their_word_budgets():
    words = {p.name: markdown_words(p) for p in NOTEBOOKS}
    over = {name: n for name, n in words.items() if n > NOTEBOOK_WORDS}
    assert not over, f"over {NOTEBOOK_WORDS:,} words of markdown: {over}; move history to docs/design-notes.md"
    total = sum(words.values())
    assert total <= COURSE_WORDS, f"the notebooks hold {total:,} words of markdown (budget {COURSE_WORDS:,})"
    readme = len((REPO / "README.md").read_text().split())
    assert readme <= README_WORDS, f"README.md holds {readme:,} words (budget {README_WORDS:,}): move a part to docs/"
