"""The course on a Colab TPU runtime: the notebooks' first cells call :func:`setup`.

On Colab (``google.colab`` importable) it reads the Hugging Face token from Colab's Secrets (``HF_TOKEN``, the key
icon on the left; else the ``HF_TOKEN`` variable), mounts Google Drive with the user's consent (Colab asks), and
puts the run directories on Drive, so that notebook 07 in a fresh runtime finds what 06 trained. Anywhere else it
does nothing. :func:`restart_needed` tells the install cell whether a package this kernel already imported changed
on disk (Colab preloads its own jax and numpy), so it can say once that the runtime must be restarted.

Colab's own modules are imported inside the functions: they exist only there (a test puts a stand-in on the path).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib import metadata
from pathlib import Path

DRIVE_MOUNT = "/content/drive"
DRIVE_RUNS = "MyDrive/gemma-tpu/runs"  # under the mount point
RUNS_ENV = "GEMMA_TPU_RUNS"  # the runs root profiles.Profile.run_dir reads
SECRET = "HF_TOKEN"  # Colab's Secrets name, the one huggingface_hub reads too
# What a restart would change: packages the install cell pins that a Colab kernel may have imported already.
RESTART_PACKAGES = ("jax", "jaxlib", "numpy", "flax", "transformers", "tokenizers", "safetensors", "ml_dtypes")


def on_colab() -> bool:
    try:
        return importlib.util.find_spec("google.colab") is not None
    except ModuleNotFoundError:  # no google namespace at all
        return False


def secrets_token() -> str | None:
    """The ``HF_TOKEN`` secret, when this notebook may read it; None when it is not set or access was refused."""
    from google.colab import userdata

    try:
        return userdata.get(SECRET) or None
    except (userdata.SecretNotFoundError, userdata.NotebookAccessError):
        return None


def restart_needed(before: dict[str, str]) -> list[str]:
    """The packages of ``before`` (name -> version imported in this kernel before the install) whose installed
    version is now another: the kernel keeps the old module until the runtime restarts."""
    changed = []
    for name, old in before.items():
        try:
            new = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if new != old:
            changed.append(f"{name} {old} -> {new}")
    return changed


def imported_versions() -> dict[str, str]:
    """Versions of the :data:`RESTART_PACKAGES` this kernel has imported (read before the install cell installs)."""
    out = {}
    for name in RESTART_PACKAGES:
        if name in sys.modules:
            try:
                out[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                pass
    return out


def setup(profile, mount: bool = True) -> dict:
    """On Colab: the token from Secrets into ``HF_TOKEN`` (processes the notebooks start inherit it), and with
    ``mount`` the runs root on Drive (``$GEMMA_TPU_RUNS`` unless already set). Returns what it did, for the cell to
    print; off Colab an empty dict."""
    if not on_colab():
        return {}
    done = {}
    token = secrets_token()
    if token:
        os.environ["HF_TOKEN"] = token
        done["token"] = "from Colab's Secrets (HF_TOKEN)"
    elif os.environ.get("HF_TOKEN"):
        done["token"] = "from $HF_TOKEN"
    else:
        done["token"] = ("none: add HF_TOKEN under Secrets (the key icon) and allow this notebook to read it, "
                         "if the profile's model is gated")
    if mount and not os.environ.get(RUNS_ENV):
        from google.colab import drive

        drive.mount(DRIVE_MOUNT)
        runs = Path(DRIVE_MOUNT) / DRIVE_RUNS
        runs.mkdir(parents=True, exist_ok=True)
        os.environ[RUNS_ENV] = str(runs)
    done["runs"] = os.environ.get(RUNS_ENV) or "runs (this runtime's disk: gone when it is recycled)"
    done["profile"] = profile.name
    return done
