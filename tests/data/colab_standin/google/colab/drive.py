"""google.colab.drive: mount(mountpoint) makes ``mountpoint/MyDrive`` the folder COLAB_STANDIN_DRIVE names, as Colab
makes it the user's Drive (after asking for consent). Each call is recorded in COLAB_STANDIN_DRIVE/mounts.log."""

import os
from pathlib import Path


def mount(mountpoint: str, force_remount: bool = False, timeout_ms: int = 120000, readonly: bool = False) -> None:
    drive = Path(os.environ["COLAB_STANDIN_DRIVE"])
    target = Path(mountpoint) / "MyDrive"
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        target.symlink_to(drive, target_is_directory=True)
    with open(drive / "mounts.log", "a") as f:
        f.write(f"{mountpoint}\n")
