"""Pre-flight for TPU profiles: what the machine must offer before a step starts, checked without importing JAX.

``setup --profile v5p-8`` prints every check (:func:`checks`: TPU type and chip count, other processes holding it,
free disk and RAM, the pinned versions); the steps that need the TPU start with :func:`require`, which raises
:class:`PreflightError` with one line per failure. JAX is never asked to find the TPU, so libtpu prints no warnings.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from ...fixes.core import http_client, process_groups
from ...fixes.core.errors import GemmaTpuError
from ..config import hub, paths, profiles

# PCI device ids of TPU chips (vendor Google 0x1ae0), as jax._src.hardware_utils lists them (a test keeps them equal).
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_IDS = {"0x0027": "v3", "0x0056": "plc", "0x005e": "v4", "0x0062": "v5p", "0x0063": "v5e", "0x006f": "v6e",
               "0x0076": "tpu7x"}
METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/accelerator-type"


class PreflightError(GemmaTpuError, RuntimeError):
    """The machine cannot run this profile's step; the message says what to do, one line per problem."""


@dataclasses.dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail" | "skip"
    detail: str

    def line(self) -> str:
        return f"  {self.status.upper():5s} {self.name:9s} {self.detail}"


def tpu_chips(sysfs: str = "/sys/bus/pci/devices") -> tuple[int, str | None]:
    """(number of TPU chips on this host, their generation), from the PCI ids, as JAX reads them."""
    n, kind = 0, None
    for vendor in glob.glob(f"{sysfs}/*/vendor"):
        if Path(vendor).read_text().strip() != GOOGLE_PCI_VENDOR:
            continue
        device = Path(vendor).with_name("device").read_text().strip()
        if device in TPU_PCI_IDS:
            n, kind = n + 1, TPU_PCI_IDS[device]
    return n, kind


def accelerator_type() -> str | None:
    """The slice type (e.g. ``v5p-8``): $TPU_ACCELERATOR_TYPE, else the TPU VM's metadata server. None if unknown."""
    if paths.setting(paths.ACCELERATOR_ENV):
        return paths.setting(paths.ACCELERATOR_ENV)
    try:
        return http_client.get_text(METADATA_URL, {"Metadata-Flavor": "Google"},
                              timeout=profiles.PREFLIGHT_PROBE_TIMEOUT_S).strip() or None
    except http_client.RequestError:
        return None


def no_tpu_message(profile) -> str:
    hw = profile.hardware
    return (f"profile {profile.name!r} needs a TPU {hw.chip} host with {hw.num_devices // hw.hosts} chips, but this "
            f"machine has no TPU (no {' or '.join(process_groups.TPU_DEVICE_GLOBS)}): run the course here with "
            f"--profile smoke, or compile {profile.name}'s train step without a TPU: "
            f"python -m gemma_tpu_helpers plan --aot --profile {profile.name}")


def check_tpu(profile, sysfs: str = "/sys/bus/pci/devices") -> Check:
    hw = profile.hardware
    if not profiles.tpu_visible():
        return Check("tpu", "fail", no_tpu_message(profile))
    want = hw.num_devices // hw.hosts
    n, kind = tpu_chips(sysfs)
    accel = accelerator_type()
    seen = f"{n} TPU {kind or '?'} chips" + (f" (slice {accel})" if accel else "")
    if kind and kind != hw.chip:
        return Check("tpu", "fail", f"{seen}, but profile {profile.name!r} is for TPU {hw.chip}: pick the profile of "
                                    f"this machine (GEMMA_TPU_PROFILE; one of {', '.join(profiles.PROFILES)}) or "
                                    f"create a {hw.chip} TPU VM.")
    if n and n != want:
        return Check("tpu", "fail", f"{seen}, but profile {profile.name!r} needs {want} per host: create a "
                                    f"{profile.name} TPU VM, or pick the profile that matches this one.")
    if accel and accel in profiles.PROFILES and accel != profile.name:
        return Check("tpu", "warn", f"{seen}: this slice is {accel}, the profile is {profile.name}.")
    return Check("tpu", "ok", f"{seen}, as profile {profile.name} expects")


def check_hbm(profile) -> Check:
    """Other processes holding the TPU: their HBM is not free, and libtpu lets one process in at a time."""
    if not profiles.tpu_visible():
        return Check("hbm", "skip", "no TPU")
    devices = profiles.tpu_device_files()
    holders = profiles.tpu_holders()
    if holders:
        who = "; ".join(f"pid {pid} ({cmd})" for pid, cmd in sorted(holders.items()))
        return Check("hbm", "fail", f"the TPU is in use by {who}: its HBM is not free and libtpu admits one process. "
                                    f"Stop it (kill {' '.join(map(str, sorted(holders)))}; a notebook kernel: "
                                    f"restart or shut it down) and retry. Deleting {process_groups.LIBTPU_LOCKFILE} "
                                    f"does not free the HBM.")
    info = ""
    if shutil.which("tpu-info"):
        try:
            out = subprocess.run(["tpu-info"], capture_output=True, text=True,
                                 timeout=profiles.PREFLIGHT_PROBE_TIMEOUT_S).stdout
            info = " | tpu-info: " + " ".join(out.split())[:200]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return Check("hbm", "ok",
                 f"no other process holds the TPU ({', '.join(devices)}, {process_groups.LIBTPU_LOCKFILE}){info}")


def checkpoint_bytes(profile) -> int | None:
    return profiles.DOWNLOAD_BYTES_FALLBACK.get(profile.model.source)


def check_disk(profile, run_dir: Path, base: Path | None = None) -> Check:
    """Free disk for the base checkpoint (unless downloaded) and the merged copy (unless merged) in the run dir."""
    size = checkpoint_bytes(profile)
    if size is None:
        return Check("disk", "skip", f"no known size for {profile.model.source}")
    base = Path(base) if base else run_dir / "base"
    parts = []  # (what, where, bytes) still to be written
    if not hub.complete(base):
        parts.append((f"base checkpoint {hub.gb(size)}", base, size))
    if not hub.complete(run_dir / "merged"):
        parts.append((f"merged copy {hub.gb(size)}", run_dir / "merged", size))
    if not parts:
        return Check("disk", "ok", f"{base} and {run_dir / 'merged'} are complete")
    by_fs: dict[Path, list] = {}
    for what, where, n in parts:
        on, _ = hub.free_bytes(where)
        by_fs.setdefault(Path(os.path.realpath(on)), []).append((what, where, n))
    details, failed = [], None
    for on, items in by_fs.items():
        need = sum(n for *_, n in items)
        _, free = hub.free_bytes(on)
        what = " + ".join(w for w, *_ in items)
        details.append(f"{on}: {hub.gb(free)} free, needs {hub.gb(need)} ({what})")
        if free < need and failed is None:
            failed = hub.disk_message(what, Path(os.path.commonpath([w for _, w, _ in items])), need, free, on)
    if failed:
        return Check("disk", "fail", failed)
    return Check("disk", "ok", "; ".join(details))


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else the OS's available pages; None where neither can be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_ram(profile) -> Check:
    """Free host RAM for the checkpoint: tunix's loader maps every shard on the host before placing it on the chips."""
    size, avail = checkpoint_bytes(profile), mem_available()
    if size is None or avail is None:
        return Check("ram", "skip", "unknown checkpoint size or free memory")
    if avail < size:
        return Check("ram", "warn", f"{hub.gb(avail)} available, the checkpoint is {hub.gb(size)} (loading maps "
                                    f"all of it on the host): stop other jobs (notebook kernels, old runs) first.")
    return Check("ram", "ok", f"{hub.gb(avail)} available for a {hub.gb(size)} checkpoint")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def pinned_jax(requirements: Path = paths.REPO / "requirements-tpu.txt") -> str | None:
    """The jax version requirements-tpu.txt pins (``jax[tpu]==X``), None outside a checkout."""
    if not requirements.is_file():
        return None
    m = re.search(r"^jax\[tpu\]==(\S+)", requirements.read_text(), re.M)
    return m[1] if m else None


def jax_wants_libtpu() -> str | None:
    """The libtpu specifier the installed jax asks for with its [tpu] extra (e.g. ``==0.0.42.*``)."""
    from packaging.requirements import Requirement

    for req in map(Requirement, metadata.requires("jax") or []):
        if req.name == "libtpu" and req.marker and req.marker.evaluate({"extra": "tpu"}):
            return str(req.specifier)
    return None


def check_versions(profile) -> Check:
    py = sys.version_info[:2]
    jax, jaxlib, libtpu = _version("jax"), _version("jaxlib"), _version("libtpu")
    detail = f"python {py[0]}.{py[1]}, jax {jax}, jaxlib {jaxlib}, libtpu {libtpu}"
    fix = "reinstall the TPU stack: .venv/bin/pip install -r requirements-tpu.txt"
    if py < profiles.PYTHON_MIN:
        return Check("versions", "fail", f"{detail}: the pinned stack needs Python "
                                         f">= {'.'.join(map(str, profiles.PYTHON_MIN))}; tools/tpu_venv.sh "
                                         f"builds .venv on a uv-managed Python 3.12 (a stock TPU VM ships 3.10).")
    if jax is None or jaxlib != jax:
        return Check("versions", "fail", f"{detail}: jax and jaxlib must be installed at one version; {fix}")
    pin = pinned_jax()
    if pin and jax != pin:
        return Check("versions", "fail", f"{detail}: requirements-tpu.txt pins jax {pin}; {fix}")
    if profiles.tpu_visible():  # off a TPU, libtpu is the AOT compiler requirements.txt pins, not the runtime
        from packaging.specifiers import SpecifierSet

        want = jax_wants_libtpu()
        if libtpu is None:
            return Check("versions", "fail", f"{detail}: libtpu is missing; {fix}")
        if want and not SpecifierSet(want).contains(libtpu):
            return Check("versions", "fail", f"{detail}: jax {jax} wants libtpu{want}; {fix}")
    pinned = "; jax as requirements-tpu.txt pins" if pin else ""
    return Check("versions", "ok",
                 detail + pinned + ("" if profiles.tpu_visible() else "; libtpu not checked off a TPU"))


def checks(profile, run_dir: str | os.PathLike | None = None, base: str | os.PathLike | None = None) -> list[Check]:
    """Every pre-flight check for a TPU profile (``setup`` prints them); none for a CPU profile."""
    if profile.hardware.platform != "tpu":
        return []
    run_dir = profile.local_dir(run_dir)
    return [check_versions(profile), check_tpu(profile), check_hbm(profile), check_disk(profile, run_dir, base),
            check_ram(profile)]


def format_checks(found: list[Check]) -> str:
    return "\n".join(c.line() for c in found)


def require(profile) -> None:
    """What a TPU step needs before it imports JAX: the TPU itself, free of other processes. Raises PreflightError."""
    if profile.hardware.platform != "tpu":
        return
    failed = [c.detail for c in (check_tpu(profile), check_hbm(profile)) if c.status == "fail"]
    if failed:
        raise PreflightError("\n".join(failed))
