"""Fetching from the Hugging Face Hub: the base checkpoint (``base_model.ensure_base``) and the tokenizer alone.

Before any weights move, :func:`download` checks offline mode, the network, the repo id, a gated repo's token and
licence, and the free disk; each failure is a :class:`HubError` with a one-line fix (the CLI exits with code 2).
Files go into the target directory itself, not the Hub cache under ``HF_HOME``: the serving container mounts that
directory, and the cache's symlinks would point outside it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ...fixes.core.errors import GemmaTpuError
from . import paths, profiles

# What the training, merge and serving steps read from a base checkpoint.
WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
# What a tokenizer needs (config.json: AutoTokenizer may read the model type from it). No weights.
TOKENIZER_PATTERNS = ["tokenizer*", "*.jinja", "special_tokens_map.json", "config.json"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # one of them makes a usable tokenizer directory


class HubError(GemmaTpuError, RuntimeError):
    """A Hub download that cannot work as set up; the message says what to do."""


def has_token() -> bool:
    """A Hugging Face token is configured ($HF_TOKEN, or the file `hf auth login` writes under HF_HOME)."""
    from huggingface_hub import get_token

    return bool(get_token())


def repo_url(repo_id: str) -> str:
    from huggingface_hub import constants

    return f"{constants.ENDPOINT}/{repo_id}"


def no_token_message(repo_id: str) -> str:
    where = ("add it to Colab's Secrets as HF_TOKEN (the key icon on the left; allow this notebook access) and rerun "
             "the install cell" if paths.on_colab() else "`export HF_TOKEN=hf_...` (or run `hf auth login`) and retry")
    return (f"{repo_id} is gated and no Hugging Face token is set: accept its licence at {repo_url(repo_id)} "
            f"(logged in), create a read token at https://huggingface.co/settings/tokens, then {where}.")


def _ways_out(target: Path) -> str:
    return f"or copy the files into {target} by other means (a step that takes --base DIR can read them elsewhere)"


def explain(exc: BaseException, repo_id: str, target: str | os.PathLike) -> str | None:
    """The one-line message for an exception of ``huggingface_hub`` (or of httpx below it), None if it is not one.

    The order matters: GatedRepoError is a RepositoryNotFoundError, and that is an HfHubHTTPError.
    """
    import httpx
    from huggingface_hub import errors

    target = Path(target)
    url = repo_url(repo_id)
    token = has_token()
    if isinstance(exc, errors.GatedRepoError):
        if not token:
            return no_token_message(repo_id)
        return (f"your Hugging Face token has no access to the gated {repo_id}: accept its licence at {url} with "
                f"the account that owns the token (check it with `hf auth whoami`), then retry.")
    if isinstance(exc, errors.RepositoryNotFoundError):
        private = "" if token else " If it is private, set HF_TOKEN to a token that can read it."
        return (f"{repo_id} does not exist on the Hugging Face Hub ({url} answers "
                f"{exc.response.status_code}): check the id (the profile's model.source in "
                f"gemma_tpu_helpers/course/config/profiles.py).{private}")
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"{repo_id} has no such revision on the Hub: check the revision name."
    if isinstance(exc, errors.OfflineModeIsEnabled) or (isinstance(exc, errors.LocalEntryNotFoundError)
                                                         and _offline()):
        return (f"HF_HUB_OFFLINE is set and {target} holds no downloaded copy of {repo_id}: unset "
                f"HF_HUB_OFFLINE to download it, {_ways_out(target)}.")
    if isinstance(exc, errors.HfHubHTTPError):
        status = exc.response.status_code
        if status == 401:
            return (f"the Hugging Face Hub rejected your token (401) for {repo_id}: create a new read token at "
                    f"https://huggingface.co/settings/tokens and `export HF_TOKEN=hf_...` (or unset a stale one).")
        return (f"the Hugging Face Hub answered {status} for {repo_id}"
                f"{': ' + exc.server_message if exc.server_message else ''}; retry later (status: "
                f"https://status.huggingface.co).")
    if isinstance(exc, (httpx.TransportError, errors.LocalEntryNotFoundError)):
        # LocalEntryNotFoundError here: snapshot_download found no network and no cached copy.
        cause = exc.__cause__ if isinstance(exc, errors.LocalEntryNotFoundError) and exc.__cause__ else exc
        reason = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else 'no answer'}"
        return (f"cannot reach the Hugging Face Hub to download {repo_id} ({reason}): check the network "
                f"(and HTTPS_PROXY / HF_ENDPOINT if you use them), {_ways_out(target)}.")
    return None


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def free_bytes(path: str | os.PathLike) -> tuple[Path, int]:
    """(mount point, free bytes) of the filesystem that will hold ``path`` (it need not exist yet)."""
    p = Path(os.path.realpath(Path(path).absolute()))
    while not p.exists():
        p = p.parent
    free = shutil.disk_usage(p).free
    while not os.path.ismount(p):
        p = p.parent
    return p, free


def gb(n: int | float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 10**8 else f"{n / 1e6:.0f} MB"


def disk_message(what: str, target: Path, need: int, free: int, on: Path) -> str:
    """Not enough space for ``what`` (``need`` bytes) in ``target``, whose filesystem ``on`` has ``free`` bytes."""
    shm = ""
    if (Path("/dev/shm").is_dir() and shutil.disk_usage("/dev/shm").free >= need
            and not str(target).startswith("/dev/shm")):
        shm = (f" /dev/shm has {gb(shutil.disk_usage('/dev/shm').free)} free (RAM: fast, lost at reboot; the paper "
               f"set TMPDIR=/dev/shm for this, but TMPDIR does not move this download): --base /dev/shm/base.")
    return (f"{what} needs {gb(need)} in {target}, but its filesystem ({on}) has {gb(free)} free: free space there, or "
            f"download to a bigger disk with --base DIR (the run directory moves with --run-dir or GEMMA_TPU_RUNS; "
            f"HF_HOME moves the Hub's own cache).{shm}")


def check_disk(what: str, target: str | os.PathLike, need: int) -> None:
    """Raise HubError unless the filesystem that will hold ``target`` has ``need`` bytes free."""
    on, free = free_bytes(target)
    if free < need:
        raise HubError(disk_message(what, Path(target), need, free, on))


def known_size(repo_id: str) -> int | None:
    """The documented download size of a known repo (for pre-flight when the Hub cannot be asked)."""
    return profiles.DOWNLOAD_BYTES_FALLBACK.get(repo_id)


def complete(target: str | os.PathLike) -> bool:
    """``target`` holds a whole checkpoint: config.json and every shard its index names (or one model.safetensors)."""
    target = Path(target)
    if not (target / "config.json").is_file():
        return False
    index = target / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        return all((target / s).is_file() for s in shards)
    return (target / "model.safetensors").is_file()


def remote_files(repo_id: str, patterns: list[str], target: Path):
    """(commit sha, {file: size}) of the repo's files that match ``patterns``; HubError for every failure."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import filter_repo_objects

    if _offline():
        raise HubError(explain(_offline_error(), repo_id, target))
    api = HfApi()
    try:
        info = api.model_info(repo_id, files_metadata=True, timeout=profiles.HUB_TIMEOUT_S)
        if info.gated and not has_token():
            raise HubError(no_token_message(repo_id))
        if info.gated:
            api.auth_check(repo_id)  # raises GatedRepoError when the licence was not accepted
    except HubError:
        raise
    except Exception as e:
        msg = explain(e, repo_id, target)
        if msg is None:
            raise
        raise HubError(msg) from None
    names = list(filter_repo_objects([s.rfilename for s in info.siblings or []], allow_patterns=patterns))
    sizes = {s.rfilename: s.size for s in info.siblings or [] if s.rfilename in names}
    return info.sha, sizes


def _offline_error():
    from huggingface_hub import errors

    return errors.OfflineModeIsEnabled("HF_HUB_OFFLINE is set")


def missing_bytes(sizes: dict[str, int | None], target: Path, repo_id: str) -> int:
    """Bytes still to download: the files not already in ``target`` at their full size."""
    todo = {n: s for n, s in sizes.items() if not ((target / n).is_file() and (target / n).stat().st_size == s)}
    if any(s is None for s in todo.values()):  # the Hub gave no sizes: the documented figure, if any
        return known_size(repo_id) or 0
    return sum(todo.values())


def download(repo_id: str, target: str | os.PathLike, patterns: list[str], what: str | None = None) -> Path:
    """Download ``repo_id``'s files matching ``patterns`` into ``target`` after the checks above; resumes."""
    from huggingface_hub import snapshot_download

    target = Path(target)
    sha, sizes = remote_files(repo_id, patterns, target)
    check_disk(what or repo_id, target, missing_bytes(sizes, target, repo_id))
    try:
        snapshot_download(repo_id, revision=sha, local_dir=target, allow_patterns=patterns)
    except OSError as e:
        import errno

        msg = explain(e, repo_id, target)
        if msg:
            raise HubError(msg) from None
        if e.errno == errno.ENOSPC:
            on, free = free_bytes(target)
            raise HubError(disk_message(what or repo_id, target, missing_bytes(sizes, target, repo_id), free, on)
                           ) from None
        raise
    except Exception as e:
        msg = explain(e, repo_id, target)
        if msg is None:
            raise
        raise HubError(msg) from None
    return target


def ensure_checkpoint(repo_id: str, target: str | os.PathLike) -> Path:
    """The whole checkpoint of ``repo_id`` in ``target``, downloaded (or its download resumed) when incomplete."""
    target = Path(target)
    if not complete(target):
        download(repo_id, target, WEIGHT_PATTERNS, what=f"the {repo_id} checkpoint")
    return target


def has_tokenizer(d: str | os.PathLike) -> bool:
    return any((Path(d) / f).is_file() for f in TOKENIZER_FILES)
