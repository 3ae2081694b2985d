"""The notebooks' first cells on "Colab": their Colab branch taken for real, with a stand-in ``google.colab``
(tests/data/colab_standin: Secrets returning a token, ``drive.mount`` onto a temporary folder) in a fresh Python
where ``gemma_tpu_helpers`` is not importable.

The install cell clones the course (REPO_URL pointed at a local git copy of this checkout) and pip-installs it
editable; its requirements file is swapped for a one-line one (requirements-colab.txt itself is 2 GB of wheels;
tests/e2e/test_requirements.py resolves it for Colab's Python). Then: the token is read from Secrets, the run
directories are on the "Drive", and notebook 07, run as a fresh kernel, finds the run 06's kernel left there.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support import REPO

STANDIN = REPO / "tests" / "data" / "colab_standin"
TOKEN = "hf_from_colab_secrets"

# One kernel: the notebook's first two code cells run in order in one namespace, as Colab runs them, with the install
# cell's REPO_URL and requirements file pointed at the test's; then what the cells left is printed as JSON.
KERNEL = textwrap.dedent(r'''
    import json, os, sys
    nb_path, repo, requirements = sys.argv[1:4]
    cells = ["".join(c["source"]) for c in json.load(open(nb_path))["cells"] if c["cell_type"] == "code"][:2]
    install = cells[1]
    assert "REPO_URL = " in install and "gemma-tpu/requirements-colab.txt" in install, "not the install cell"
    cells[1] = "\n".join(f'REPO_URL = "{repo}"' if line.startswith("REPO_URL = ") else line
                         for line in install.splitlines()).replace("gemma-tpu/requirements-colab.txt", requirements)
    namespace = {"__name__": "__main__"}
    for i, source in enumerate(cells):
        exec(compile(source, f"<cell {i}>", "exec"), namespace)
    import gemma_tpu_helpers
    from gemma_tpu_helpers.course.training import train
    profile = namespace["profile"]
    print("RESULT " + json.dumps({
        "profile": profile.name, "package": gemma_tpu_helpers.__file__, "hf_token": os.environ.get("HF_TOKEN"),
        "runs": os.environ.get("GEMMA_TPU_RUNS"), "run_dir": str(profile.run_dir().resolve()),
        "latest_step": train.latest_step(profile.run_dir() / "checkpoints")}))
''')


def git_copy(dst: Path) -> Path:
    """This checkout's tracked and not-ignored files, as they are now, committed in a new repository: what a user's
    `git clone` of the published course would fetch."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        if (REPO / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dst / f)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "course"]):
        subprocess.run(git + args, cwd=dst, check=True, capture_output=True)
    return dst


@pytest.fixture(scope="module")
def colab(tmp_path_factory):
    """A fresh "runtime": a venv that sees the training stack's packages (as Colab's Python sees its own) but not the
    helpers, the stand-in google.colab on its path, a Drive folder, and the course as a git repository."""
    root = tmp_path_factory.mktemp("colab")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # the stack's packages by path: the .pth files of that folder (the helpers' editable install) are not read
    (site / "stack.pth").write_text(next(p for p in sys.path if p.endswith("site-packages")) + "\n")
    repo = git_copy(root / "course")
    requirements = root / "requirements-small.txt"
    requirements.write_text("numpy\n")  # present already: pip runs, resolves and installs nothing
    drive = root / "my-drive"
    drive.mkdir()
    content = root / "content"
    content.mkdir()
    env = {**os.environ, "PYTHONPATH": str(STANDIN), "COLAB_STANDIN_DRIVE": str(drive),
           "COLAB_STANDIN_SECRETS": json.dumps({"HF_TOKEN": TOKEN}), "GEMMA_TPU_PROFILE": "smoke",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    for var in ("GEMMA_TPU_RUNS", "HF_TOKEN", "VIRTUAL_ENV"):
        env.pop(var, None)
    return {"python": str(venv / "bin" / "python"), "repo": f"file://{repo}", "requirements": str(requirements),
            "drive": drive, "content": content, "env": env}


def run_first_cells(colab, notebook: str) -> dict:
    r = subprocess.run([colab["python"], "-c", KERNEL, str(REPO / "notebooks" / notebook), colab["repo"],
                        colab["requirements"]], cwd=colab["content"], env=colab["env"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    return {**json.loads(line[len("RESULT "):]), "stdout": r.stdout}


def test_the_first_cells_install_read_secrets_and_put_the_runs_on_drive_and_07_finds_06s_run(colab, smoke_run):
    first = run_first_cells(colab, "06_training.ipynb")
    clone = colab["content"] / "gemma-tpu"
    assert (clone / ".git").is_dir() and first["package"].startswith(str(clone)), first  # cloned and installed
    assert first["profile"] == "smoke" and first["hf_token"] == TOKEN  # from Colab's Secrets
    runs = colab["drive"] / "gemma-tpu" / "runs"
    assert Path(first["runs"]).resolve() == runs and first["run_dir"] == str(runs / "smoke")
    assert "needs about" in first["stdout"] and first["latest_step"] is None  # nothing trained yet
    # 06 trains (the suite's smoke run stands in for it) into its run directory on Drive; the runtime is recycled
    run_dir, result = smoke_run
    shutil.copytree(run_dir, runs / "smoke", dirs_exist_ok=True)
    again = run_first_cells(colab, "07_orbax_merge.ipynb")
    assert "Installed" not in again["stdout"] and again["package"] == first["package"]  # installed once
    assert again["run_dir"] == first["run_dir"] and again["latest_step"] == result.total_steps
    assert (colab["drive"] / "mounts.log").read_text().count("content/drive") == 2  # mounted by each kernel
