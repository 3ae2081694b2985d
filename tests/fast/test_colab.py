"""The course on Colab (course/front/colab.py): the badge and install URL of every notebook come from pyproject.toml's
one URL; Secrets, Drive and the restart message with a stand-in ``google.colab`` (tests/data/colab_standin, the real
package's names and errors). tests/e2e/test_colab_first_cells.py runs the notebooks' first cells with it."""

import copy
import json
import sys
from importlib import metadata

import pytest

from gemma_tpu_helpers.course.config import paths, profiles
from gemma_tpu_helpers.course.front import colab
from support import REPO

STANDIN = REPO / "tests" / "data" / "colab_standin"
NB = "01_mesh_setup"


def test_every_notebook_has_the_badge_and_install_url_of_pyproject():
    """Fails when a notebook's badge or REPO_URL disagrees with [project.urls] Repository: run
    `python -m gemma_tpu_helpers badges`."""
    assert colab.write_badges(check=True) == []
    nbs = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    for path in nbs:
        cells = json.loads(path.read_text())["cells"]
        url = colab.colab_url(path.stem, colab.repo_url())
        assert cells[0]["id"] == colab.BADGE_ID and url in cells[0]["source"][0], path.name


def test_a_changed_url_is_seen_and_written(tmp_path):
    src = REPO / "notebooks" / f"{NB}.ipynb"
    (tmp_path / src.name).write_text(src.read_text())
    assert colab.write_badges(tmp_path, "https://github.com/acme/course", check=True) == [src.name]
    assert (tmp_path / src.name).read_text() == src.read_text()  # check writes nothing
    assert colab.write_badges(tmp_path, "https://github.com/acme/course") == [src.name]
    nb = json.loads((tmp_path / src.name).read_text())
    assert "github/acme/course/blob/main/notebooks/01_mesh_setup.ipynb" in nb["cells"][0]["source"][0]
    install = "".join(next(c for c in nb["cells"] if colab.REPO_LINE.search("".join(c["source"])))["source"])
    assert 'REPO_URL = "https://github.com/acme/course"' in install
    assert colab.write_badges(tmp_path, "https://github.com/acme/course") == []  # idempotent


def test_a_notebook_without_a_badge_gets_one_and_only_github_opens_in_colab():
    nb = json.loads((REPO / "notebooks" / f"{NB}.ipynb").read_text())
    bare = copy.deepcopy(nb)
    bare["cells"] = [c for c in bare["cells"] if c.get("id") != colab.BADGE_ID]
    n = len(bare["cells"])
    out = colab.with_badge(bare, NB, "https://github.com/acme/course.git", branch="workshop")
    assert len(out["cells"]) == n + 1 and "blob/workshop/notebooks/01_mesh_setup.ipynb" in out["cells"][0]["source"][0]
    with pytest.raises(ValueError, match="GitHub only"):
        colab.colab_url(NB, "https://gitlab.com/acme/course")


def test_restart_is_needed_only_for_a_module_that_changed_on_disk():
    numpy = metadata.version("numpy")
    assert colab.restart_needed({"numpy": numpy}) == []
    assert colab.restart_needed({"numpy": "1.0.0"}) == [f"numpy 1.0.0 -> {numpy}"]
    with pytest.raises(SystemExit, match=r"numpy 1.0.0 -> .*Restart the runtime"):
        colab.stop_for_restart({"numpy": "1.0.0"})
    colab.stop_for_restart({"numpy": numpy})  # nothing to say


def test_off_colab_setup_does_nothing(monkeypatch):
    monkeypatch.delenv("GEMMA_TPU_RUNS", raising=False)
    assert not paths.on_colab() and colab.setup(profiles.get_profile("smoke")) == {}


@pytest.fixture
def on_colab(tmp_path, monkeypatch):
    """The stand-in google.colab importable, a Drive folder, the working directory a fresh /content."""
    drive = tmp_path / "my-drive"
    drive.mkdir()
    content = tmp_path / "content"
    content.mkdir()
    monkeypatch.syspath_prepend(str(STANDIN))
    for name in [m for m in sys.modules if m == "google.colab" or m.startswith("google.colab.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setenv("COLAB_STANDIN_DRIVE", str(drive))
    monkeypatch.chdir(content)
    monkeypatch.delenv("GEMMA_TPU_RUNS", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield drive
    for name in [m for m in sys.modules if m == "google.colab" or m.startswith("google.colab.")]:
        del sys.modules[name]  # libraries that find google.colab imported think they run on Colab (tqdm, vLLM)


def test_on_colab_the_token_comes_from_secrets_and_the_runs_go_to_drive(on_colab, monkeypatch, capsys):
    import os

    monkeypatch.setenv("COLAB_STANDIN_SECRETS", json.dumps({"HF_TOKEN": "hf_secret"}))
    done = colab.setup(profiles.get_profile("colab-v5e-1"))
    assert paths.on_colab() and done["token"] == "from Colab's Secrets" and os.environ["HF_TOKEN"] == "hf_secret"
    assert os.environ["GEMMA_TPU_RUNS"] == done["runs"] == str(on_colab.parent / "content/drive/MyDrive/gemma-tpu/runs")
    assert (on_colab / "gemma-tpu" / "runs").is_dir()  # on "Drive"
    assert profiles.get_profile("colab-v5e-1").run_dir().resolve() == on_colab / "gemma-tpu/runs/colab-v5e-1"
    # E2B: its bf16 text weights twice (the base and the merged copy)
    assert done["drive_gb"] == round(colab.drive_gb(profiles.get_profile("colab-v5e-1")), 1) > 15
    assert "needs about" in capsys.readouterr().out


def test_a_refused_or_missing_secret_leaves_the_token_alone(on_colab, monkeypatch):
    import os

    monkeypatch.setenv("COLAB_STANDIN_SECRETS", json.dumps({"HF_TOKEN": "hf_secret"}))
    monkeypatch.setenv("COLAB_STANDIN_DENIED", "HF_TOKEN")
    assert colab.setup(profiles.get_profile("smoke"), mount=False)["token"].startswith("none")
    assert "HF_TOKEN" not in os.environ
    monkeypatch.setenv("COLAB_STANDIN_DENIED", "")
    monkeypatch.setenv("COLAB_STANDIN_SECRETS", "{}")
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    assert colab.setup(profiles.get_profile("smoke"), mount=False)["token"] == "from $HF_TOKEN"


def test_badges_command_checks_as_typed_and_refuses_another_host_in_one_line(tmp_path):
    from support import run_cli

    r = run_cli("badges", "--check", cwd=tmp_path)
    assert r.returncode == 0 and "would change 0 notebook(s)" in r.stdout, r.stdout + r.stderr
    r = run_cli("badges", "--check", "--repo", "https://github.com/acme/course", cwd=tmp_path)
    assert r.returncode == 1 and "would change 11 notebook(s)" in r.stdout
    r = run_cli("badges", "--repo", "https://gitlab.com/acme/course", cwd=tmp_path)
    assert r.returncode == 2 and "GitHub only" in r.stderr and "Traceback" not in r.stderr
    assert colab.write_badges(check=True) == []  # neither run wrote


def test_a_gated_model_without_a_token_says_where_the_token_goes_on_colab(on_colab):
    from gemma_tpu_helpers.course.config import hub

    msg = hub.no_token_message("google/gemma-4-31B-it")
    assert "Colab's Secrets as HF_TOKEN" in msg and "export" not in msg


def test_off_colab_the_token_is_exported():
    from gemma_tpu_helpers.course.config import hub

    assert "`export HF_TOKEN=hf_...`" in hub.no_token_message("google/gemma-4-31B-it")


def test_the_colab_pins_are_the_training_stacks_own():
    """requirements-colab.txt repeats some pins of requirements-common/-tpu.txt (a slimmer file, not -r): each must
    be the same version, so Colab trains on the stack the tests ran."""
    def pins(name):
        lines = (REPO / name).read_text().splitlines()
        return dict(line.split("#")[0].strip().split("==") for line in lines if "==" in line.split("#")[0])

    stack = {**pins("requirements-common.txt"), **pins("requirements-tpu.txt")}
    colab = pins("requirements-colab.txt")
    assert len(colab) >= 10 and {k: (v, stack.get(k)) for k, v in colab.items() if stack.get(k) != v} == {}
