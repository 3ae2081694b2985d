"""The LoRA side of a tunix run's Orbax checkpoints: its steps, its LoRA config, its LoRA arrays.

tunix's ``PeftTrainer`` saves ``<checkpoints>/<step>/model_params`` (the ``nnx.LoRAParam`` state); training writes
``<checkpoints>/lora_config.json``, the only record of rank and alpha. :func:`restore_lora` reads the arrays on the
host, with no model, accelerator or mesh; :func:`write_lora_checkpoint` writes the same layout.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ..core.errors import GemmaTpuError
from ..core.file_io import absolute_path, is_remote, to_path

METADATA = "lora_config.json"  # what training writes beside the steps
PARAMS_ITEM = "model_params"


class LoraCheckpointError(GemmaTpuError, ValueError):
    """A checkpoint directory, step or LoRA config that cannot be read (the message says which and why)."""


COMMIT_SUCCESS = "commit_success.txt"  # on gs://, Orbax writes <step>/ in place and this file last


def list_steps(checkpoint_dir: str | Path) -> list[int]:
    """The finished steps: ``<step>/`` folders (Orbax renames a finished step into place), and on ``gs://``, where
    nothing renames, those that hold Orbax's ``commit_success.txt``."""
    d = to_path(checkpoint_dir)
    if not d.is_dir():
        return []
    steps = [p for p in d.iterdir() if p.name.isdigit() and p.is_dir()]
    if is_remote(d):
        steps = [p for p in steps if (p / COMMIT_SUCCESS).exists()]
    return sorted(int(p.name) for p in steps)


def resolve_step(checkpoint_dir: str | Path, step: int | None = None) -> tuple[int, Path]:
    """``(step, <checkpoint_dir>/<step>/model_params)``, absolute (Orbax needs it: a relative path fails inside it);
    the latest step by default. Raises LoraCheckpointError."""
    d = absolute_path(checkpoint_dir, "checkpoint directory", remote=True)
    if d.exists() and not d.is_dir():
        raise LoraCheckpointError(f"{d} is a file; pass the run's `checkpoints` directory (it holds one folder per "
                                  f"saved step and lora_config.json).")
    if not d.is_dir():
        raise LoraCheckpointError(f"Checkpoint directory {d} does not exist (train first: the trainer writes it).")
    steps = list_steps(d)
    if not steps:
        raise LoraCheckpointError(f"{d} holds no Orbax step directories (<step>/{PARAMS_ITEM}); train first, or "
                         f"pass the `checkpoints` folder of a run.")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise LoraCheckpointError(f"{d} has no step {step}; its steps are {steps}.")
    item = d / str(step) / PARAMS_ITEM
    if not item.is_dir():
        raise LoraCheckpointError(f"{d / str(step)} has no {PARAMS_ITEM}/ (an unfinished or foreign checkpoint); "
                         f"steps present: {steps}.")
    return step, item


def read_lora_config(checkpoint_dir: str | Path) -> dict:
    """``lora_config.json`` written by training: targets, rank, alpha, ... (the only source of rank and alpha)."""
    if not to_path(checkpoint_dir).is_dir():
        resolve_step(checkpoint_dir)  # raises the "does not exist" / "is a file" error
    path = to_path(checkpoint_dir) / METADATA
    if not path.is_file():
        raise LoraCheckpointError(f"{path} is missing: the checkpoint does not say which LoRA it holds "
                         f"(rank, alpha, targets). Checkpoints written by the training step's "
                         f"save_lora_config have it.")
    try:
        meta = json.loads(path.read_text())
        missing = [k for k in ("targets", "rank", "alpha") if k not in meta]
    except (ValueError, TypeError):
        raise LoraCheckpointError(f"{path} is not a JSON object (truncated or damaged); copy the checkpoint again, "
                                  f"or rewrite it by rerunning `train` on the same run directory.") from None
    if missing:
        raise LoraCheckpointError(f"{path} lacks {missing}.")
    return meta


def _flatten(tree, prefix=()) -> dict[str, object]:
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flatten(v, (*prefix, str(k))))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_flatten(v, (*prefix, str(i))))
    else:
        out["/".join(prefix)] = tree
    return out


def _strip_value(path: str) -> str:
    return path[: -len("/value")] if path.endswith("/value") else path


def restore_lora(checkpoint_dir: str | Path, step: int | None = None) -> tuple[int, dict[str, np.ndarray]]:
    """``(step, {"layers/0/attn/q_einsum/w_lora_a": array, ...})``: the LoRA params (not the optimizer state) as
    host numpy arrays, also from a multi-host checkpoint (Orbax reassembles each global array). Raises
    LoraCheckpointError for a missing, incomplete or damaged step."""
    import orbax.checkpoint as ocp

    step, item = resolve_step(checkpoint_dir, step)
    steps = list_steps(item.parent.parent)
    ckptr = ocp.PyTreeCheckpointer()
    try:
        meta = ckptr.metadata(item)
    except Exception as e:  # noqa: BLE001 - Orbax raises many kinds for a missing or garbled metadata file
        raise LoraCheckpointError(f"Cannot read step {step} of {item.parent.parent}: {item} has no readable Orbax "
                                  f"metadata ({_first_line(e)}). That step is incomplete or damaged (saving was "
                                  f"cut off, or a copy is partial): pick another step (steps: {steps}) or copy the "
                                  f"checkpoint again.") from e
    try:
        tree_meta = getattr(meta, "item_metadata", None) or getattr(meta, "tree", None) or meta
        restore_args = _map_leaves(tree_meta, lambda _: ocp.RestoreArgs(restore_type=np.ndarray))
        tree = ckptr.restore(item, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    except Exception as e:  # noqa: BLE001 - truncated array data fails in many ways inside Orbax and TensorStore
        raise LoraCheckpointError(f"Cannot read the arrays of step {step} in {item} ({_first_line(e)}): its "
                                  f"metadata reads, but array data is missing or cut short, so the step is "
                                  f"incomplete or damaged. Pick another step (steps: {steps}) or copy the "
                                  f"checkpoint again.") from e
    flat = {_strip_value(k): np.asarray(v) for k, v in _flatten(_to_plain(tree)).items()}
    if not flat:
        raise LoraCheckpointError(f"{item} holds no arrays.")
    return step, flat


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def _to_plain(tree):
    """nnx.State / mappings / sequences -> plain nested dicts (orbax may hand back State-like mappings)."""
    if hasattr(tree, "to_pure_dict"):
        tree = tree.to_pure_dict()
    if isinstance(tree, dict) or (hasattr(tree, "items") and not isinstance(tree, np.ndarray)):
        return {k: _to_plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_to_plain(v) for v in tree]
    return tree


def _map_leaves(tree, fn):
    if isinstance(tree, dict) or (hasattr(tree, "items") and not hasattr(tree, "shape")):
        return {k: _map_leaves(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_leaves(v, fn) for v in tree)
    return fn(tree)


def lora_digest(arrays: dict[str, np.ndarray]) -> str:
    """A short digest of LoRA arrays (paths and bytes): which LoRA a merged directory or an adapter was made from."""
    h = hashlib.sha256()
    for k in sorted(arrays):
        h.update(k.encode())
        h.update(np.ascontiguousarray(arrays[k]).tobytes())
    return h.hexdigest()[:16]


def write_lora_checkpoint(checkpoint_dir: str | Path, arrays: dict[str, np.ndarray], meta: dict, step: int = 1) -> Path:
    """Save ``arrays`` (flat tunix paths) as ``<checkpoint_dir>/<step>/model_params`` + ``lora_config.json``, in the
    nested layout tunix's ``PeftTrainer`` saves (``layers -> 0 -> attn -> q_einsum -> w_lora_a``)."""
    import orbax.checkpoint as ocp

    checkpoint_dir = absolute_path(checkpoint_dir, "checkpoint directory")
    tree: dict = {}
    for path, arr in arrays.items():
        node = tree
        parts = path.split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = np.asarray(arr)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    (checkpoint_dir / METADATA).write_text(json.dumps(meta, indent=1))
    ckptr = ocp.PyTreeCheckpointer()
    ckptr.save(checkpoint_dir / str(step) / PARAMS_ITEM, tree, force=True)
    return checkpoint_dir
