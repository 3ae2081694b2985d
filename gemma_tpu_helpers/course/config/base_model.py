"""The base checkpoint a profile trains on: the tiny replica (built here) or the Hugging Face Hub's (downloaded or
resumed). Also the profile's text config without reading a file, a small checkpoint for host-side checks, and a
tokenizer directory without the weights. It joins ``gemma4``, ``tiny`` and ``hub``, which know nothing of each other.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...fixes.core.file_io import absolute_path
from ...fixes.model import gemma4, hf_checkpoint
from . import hub, tiny

HUB_IDS = {"google/gemma-4-31B-it": "31b", "google/gemma-4-26B-A4B-it": "26b-a4b", "google/gemma-4-E2B-it": "e2b",
           "google/gemma-4-E4B-it": "e4b"}


def profile_text_config(profile) -> dict:
    """A profile's text config without reading any file: its tiny replica's, or the real model's it names."""
    if profile.model.source == "tiny":
        return tiny.tiny_text_config(profile.model.tiny_layers, profile.model.tiny_variant)
    if profile.model.source not in HUB_IDS:
        raise hf_checkpoint.CheckpointError(f"No built-in config for {profile.model.source!r}; known: "
                                            f"{sorted(HUB_IDS)}.")
    return gemma4.TEXT_CONFIGS[HUB_IDS[profile.model.source]]


def ensure_base(profile, run_dir: str | Path | None = None, base: str | Path | None = None) -> Path:
    """The profile's base checkpoint in ``base`` (default ``runs/<profile>/base``): the tiny model is built on first
    use; the real one is downloaded from the Hugging Face Hub, or its download resumed, when incomplete.

    Every download failure (offline, no token, licence not accepted, wrong id, too little disk) raises
    ``hub.HubError`` with a one-line fix, before any weights move (see ``hub.download``)."""
    base = absolute_path(base, "base directory") if base else None
    if base and hub.complete(base):  # a checkpoint the caller chose (--base DIR) is used as it is
        return _checked(base)
    base = base or profile.local_dir(run_dir) / "base"  # local, also for a gs:// run directory
    if profile.model.source == "tiny":
        base = tiny.ensure_tiny_model(base, seed=profile.model.tiny_seed, layers=profile.model.tiny_layers,
                                      variant=profile.model.tiny_variant)
    else:
        hub.ensure_checkpoint(profile.model.source, base)
    return _checked(base)


_CHECKED: set = set()  # (a base, its files' names, sizes and mtimes) checked in this process


def _checked(base: Path) -> Path:
    """``gemma4.check_checkpoint(base)``: the course's one check of a base's files, once per process while they stay
    as they were (the loader in fixes/gemma4 checks again: a copied fix has no course around it)."""
    key = (str(base), tuple((p.name, s.st_size, s.st_mtime_ns) for p in sorted(base.iterdir())
                            if p.is_file() for s in [p.stat()]))
    if key not in _CHECKED:
        gemma4.check_checkpoint(base)
        _CHECKED.add(key)
    return base


def ensure_check_model(profile, run_dir: str | Path | None = None) -> Path:
    """A checkpoint small enough for host-side checks (parity, probes): the base in smoke, else the tiny model.

    transformers cannot hold the 31B in fp32 on a host, so TPU profiles run these checks on the tiny replica of
    their model (the 31B's; E2B's / E4B's on the Colab profiles), whose head counts keep the real model's ratios
    (it loads on the same meshes).
    """
    if profile.model.source == "tiny":
        return ensure_base(profile, run_dir)
    return tiny.ensure_tiny_model(profile.local_dir(run_dir) / "tiny",
                                  variant=HUB_IDS.get(profile.model.source, "31b"))


def ensure_tokenizer(profile, run_dir: str | os.PathLike | None = None, base: str | os.PathLike | None = None) -> Path:
    """A directory ``AutoTokenizer.from_pretrained`` can load for the profile, without downloading weights.

    ``base`` (a checkpoint dir) when given; the smoke profile's tiny base (built on first use); the real base when it
    is already downloaded; else ``runs/<profile>/tokenizer`` with the tokenizer files alone (a few MB).
    """
    if base is not None:
        if not hub.has_tokenizer(base):
            raise hub.HubError(f"{base} holds no tokenizer ({' or '.join(hub.TOKENIZER_FILES)}): pass a checkpoint "
                               f"directory with --base, or leave it out to fetch the profile's tokenizer.")
        return Path(base)
    run_dir = profile.local_dir(run_dir)
    if profile.model.source == "tiny":
        return ensure_base(profile, run_dir)
    if hub.has_tokenizer(run_dir / "base"):
        return run_dir / "base"
    out = run_dir / "tokenizer"
    if not hub.has_tokenizer(out):
        hub.download(profile.model.source, out, hub.TOKENIZER_PATTERNS, what=f"the {profile.model.source} tokenizer")
    return out
