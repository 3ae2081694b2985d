"""The course on a Colab TPU runtime: the notebooks' first cells call :func:`setup`.

On Colab (``google.colab`` importable) it reads the Hugging Face token from Colab's Secrets (``HF_TOKEN``, the key
icon on the left; else the ``HF_TOKEN`` variable), mounts Google Drive with the user's consent (Colab asks), and
puts the run directories on Drive, so that notebook 07 in a fresh runtime finds what 06 trained. Anywhere else it
does nothing. :func:`restart_needed` tells the install cell whether a package this kernel already imported changed
on disk (Colab preloads its own jax and numpy), so it can say once that the runtime must be restarted.

Every notebook opens with an "Open in Colab" badge, and its install cell clones ``REPO_URL``: both are written from
the one URL in ``pyproject.toml``'s ``[project.urls]`` by :func:`write_badges` (``python -m gemma_tpu_helpers
badges``), and a test fails when a notebook disagrees with it.

Colab's own modules are imported inside the functions: they exist only there (a test puts a stand-in on the path).
"""

from __future__ import annotations

import json
import re
import tomllib
from importlib import metadata
from pathlib import Path

from ...fixes.core.file_io import write_atomic
from ...fixes.model import model_size
from ..budget.param_memory import DTYPE_BYTES
from ..config import base_model, paths

DRIVE_MOUNT = "drive"  # under the working directory: /content/drive on Colab, where a notebook starts in /content
DRIVE_RUNS = "MyDrive/gemma-tpu/runs"  # under the mount point
RUNS_ENV = paths.RUNS_ENV  # the runs root profiles.Profile.run_dir reads
SECRET = paths.TOKEN_ENV  # Colab's Secrets name, the one huggingface_hub reads too


def secrets_token() -> str | None:
    """The ``HF_TOKEN`` secret, when this notebook may read it; None when it is not set or access was refused."""
    from google.colab import userdata

    try:
        return userdata.get(SECRET) or None
    except (userdata.SecretNotFoundError, userdata.NotebookAccessError):
        return None


def restart_needed(preloaded: dict[str, str]) -> list[str]:
    """The modules of ``preloaded`` (name -> the version this kernel imported before the install) whose installed
    version is now another: the kernel keeps the old one until the runtime restarts."""
    changed = []
    for name, old in preloaded.items():
        try:
            new = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if new != old:
            changed.append(f"{name} {old} -> {new}")
    return changed


def stop_for_restart(preloaded: dict[str, str]) -> None:
    """After the install cell's pip: stop "Run all" with one message when a module this kernel imported changed on
    disk (Colab preloads its own jax and numpy). After the restart the helpers import, so the install (and this
    message) does not come again."""
    changed = restart_needed(preloaded)
    if changed:
        raise SystemExit(f"Installed; this kernel still holds the old {', '.join(changed)}. Restart the runtime "
                         f"(Runtime > Restart session), then run the notebook again from the top: the install is "
                         f"done and will not repeat.")


def drive_gb(profile) -> float:
    """What a profile's run directory holds at most, in GB: the base checkpoint and its merged copy (the text
    weights in the profile's dtype; the towers and the LoRA checkpoints are small beside them)."""
    weight_bytes = DTYPE_BYTES[profile.model.dtype]
    return 2 * model_size.param_count(base_model.profile_text_config(profile)) * weight_bytes / 1e9


def setup(profile, mount: bool = True) -> dict:
    """On Colab: the token from Secrets into ``HF_TOKEN`` (the processes the notebooks start inherit it), and with
    ``mount`` the runs root on Drive (``$GEMMA_TPU_RUNS``, unless already set), where a fresh runtime finds the run
    again. Prints what it did and returns it; off Colab it does nothing and returns an empty dict."""
    if not paths.on_colab():
        return {}
    token = secrets_token()
    if token:
        paths.set_settings({SECRET: token})
        done = {"token": "from Colab's Secrets"}
    elif paths.setting(SECRET):
        done = {"token": "from $HF_TOKEN"}
    else:
        done = {"token": "none (a gated model needs HF_TOKEN under Secrets, the key icon, with access for this "
                         "notebook)"}
    if mount and not paths.setting(RUNS_ENV):
        from google.colab import drive

        mountpoint = Path.cwd() / DRIVE_MOUNT
        drive.mount(str(mountpoint))  # Colab asks the user first
        runs = mountpoint / DRIVE_RUNS
        runs.mkdir(parents=True, exist_ok=True)
        paths.set_settings({RUNS_ENV: str(runs)})
    done["runs"] = paths.setting(RUNS_ENV) or "runs/ on this runtime's disk (gone when the runtime is recycled)"
    done["drive_gb"] = round(drive_gb(profile), 1)
    print(f"Colab: Hugging Face token {done['token']}; run directories in {done['runs']} (profile {profile.name} "
          f"needs about {done['drive_gb']:g} GB there)")
    return done


# ------------------------------------------------------------------------------------ the badge and the install URL

BADGE = "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"
BADGE_ID = "colab-badge"
REPO_LINE = re.compile(r'^REPO_URL = "[^"]*"', re.M)  # the install cell's line, as the notebooks write it
_GITHUB = re.compile(r"^https://github\.com/([^/]+)/([^/]+?)(?:\.git)?/?$")


def repo_url(pyproject: Path = paths.REPO / "pyproject.toml") -> str:
    """The course's repository: ``[project.urls] Repository`` in ``pyproject.toml``."""
    return tomllib.loads(Path(pyproject).read_text())["project"]["urls"]["Repository"]


def colab_url(notebook: str, repo: str, branch: str = "main") -> str:
    """The notebook's Colab URL for a GitHub ``repo`` (Colab opens notebooks from GitHub only: another host is a
    ValueError)."""
    m = _GITHUB.match(repo.strip())
    if not m:
        raise ValueError(f"{repo!r} is not a GitHub URL (https://github.com/OWNER/NAME): Colab opens notebooks from "
                         f"GitHub only. Change [project.urls] Repository in pyproject.toml.")
    name = notebook if notebook.endswith(".ipynb") else f"{notebook}.ipynb"
    return f"https://colab.research.google.com/github/{m.group(1)}/{m.group(2)}/blob/{branch}/notebooks/{name}"


def with_badge(nb: dict, name: str, repo: str, branch: str = "main") -> dict:
    """``nb`` (a notebook's JSON) with its first cell the badge for ``repo`` and its install cell cloning ``repo``."""
    badge = BADGE.format(url=colab_url(name, repo, branch))
    cells = nb["cells"]
    first = cells[0] if cells else None
    if first is not None and first.get("id") == BADGE_ID:
        first["source"] = [badge]
    else:
        cells.insert(0, {"cell_type": "markdown", "id": BADGE_ID, "metadata": {}, "source": [badge]})
    install = [c for c in cells if c["cell_type"] == "code" and REPO_LINE.search("".join(c["source"]))]
    if len(install) != 1:
        raise ValueError(f"{name}: expected one install cell with a `REPO_URL = \"...\"` line, found {len(install)}")
    text = REPO_LINE.sub(f'REPO_URL = "{repo}"', "".join(install[0]["source"]), count=1)
    install[0]["source"] = text.splitlines(keepends=True)
    return nb


def write_badges(notebooks_dir: Path = paths.REPO / "notebooks", repo: str | None = None, branch: str = "main",
                 check: bool = False) -> list[str]:
    """Write every notebook's badge and install URL from ``repo`` (default: :func:`repo_url`); returns the notebooks
    that were (with ``check``: that would be) changed. ``check`` writes nothing."""
    repo = repo or repo_url()
    changed = []
    for path in sorted(Path(notebooks_dir).glob("[0-9][0-9]_*.ipynb")):
        before = path.read_text()
        after = json.dumps(with_badge(json.loads(before), path.stem, repo, branch), indent=1, ensure_ascii=False) + "\n"
        if after != before:
            changed.append(path.name)
            if not check:
                write_atomic(path, after)
    return changed
