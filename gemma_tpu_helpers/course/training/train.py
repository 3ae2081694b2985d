"""LoRA training with tunix's ``PeftTrainer``: packed rows, integer-label loss, checkpoints, resume (notebook 06).

Only the LoRA params train. Orbax checkpoints (``<run>/checkpoints/<step>/``) hold the LoRA params and the
optimizer state; ``<run>/checkpoints/lora_config.json`` records the LoRA configuration, which resume checks and the
merge step reads. Metrics go to ``<run>/train/metrics.jsonl`` (one line per optimizer step).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np

from ...fixes.core.errors import GemmaTpuError
from ...fixes.core.file_io import absolute_path, config_hash, is_remote, to_path, write_atomic
from ...fixes.model import gemma4, sharding
from ...fixes.model import mesh as mesh_lib
from ...fixes.model.hf_checkpoint import read_text_config
from ...fixes.train import data as data_lib
from ...fixes.train import lora, packing, remat, sft
from ...fixes.train.lora_checkpoint import list_steps
from ...fixes.train.multihost import is_main, main_first, process_rows
from ...fixes.train.preemption import PREEMPTED_EXIT, NoticeBeforeTraining, PreemptionWatch
from ..config import base_model
from ..config.profiles import Profile, Run, resolve_run

METADATA = "lora_config.json"
# Cloud Storage takes about one write per second to one object name (more fail with 429): on gs:// metrics.jsonl is
# uploaded at most this often, and once more when training stops however it stops
GCS_REWRITE_S = 2.0
DONE = "done.json"  # in <run>/train/: written when a run reaches its last step


class TrainingError(GemmaTpuError, RuntimeError):
    pass


class NonFiniteLossError(TrainingError):
    pass


class Preempted(TrainingError):
    """SIGTERM (a spot TPU's preemption notice) stopped training after a step that every process saved. The CLI
    prints the message after ``preempted:`` and exits with :data:`PREEMPTED_EXIT` (75); the same command resumes."""

    label, exit_code = "preempted", PREEMPTED_EXIT


class GlobalBatches:
    """This process's rows of each global batch (numpy, from :func:`packing.batches`) as global ``jax.Array`` s sharded
    over ``axis``, via ``jax.make_array_from_process_local_data``. Re-iterable; maps in the calling thread.

    tunix's own input sharding cannot do this: it checks divisibility on the *local* shape, and a process's share
    (say 2 rows) that the fsdp axis (4) does not divide falls back to "replicated" - each process would then train
    on its own rows as if they were the whole batch, silently. Global arrays pass through tunix untouched.
    """

    def __init__(self, ds, mesh, global_batch: int, axis: str = "fsdp"):
        from jax.sharding import NamedSharding, PartitionSpec

        self.ds, self.global_batch = ds, global_batch
        self.sharding = NamedSharding(mesh, PartitionSpec(axis))

    def to_global(self, batch: dict) -> dict:
        import jax

        return {k: jax.make_array_from_process_local_data(self.sharding, v, (self.global_batch, *v.shape[1:]))
                for k, v in batch.items()}

    def __iter__(self):
        return (self.to_global(b) for b in self.ds)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint metadata: what LoRA this checkpoint holds, and the settings that shaped its rows

def lora_metadata(profile: Profile, text_config: dict) -> dict:
    targets = list(lora.validate_targets(profile.lora.targets))
    experts = bool(lora.expert_targets(targets))
    return {"targets": targets, "rank": profile.lora.rank, "alpha": profile.lora.alpha,
            "expert_rank": (profile.lora.expert_rank or profile.lora.rank) if experts else None,
            "dropout": profile.lora.dropout, "qwix_regex": lora.regex_for(targets), "base_model": profile.model.source,
            "base_config_sha256": config_hash(text_config), "num_layers": text_config["num_hidden_layers"],
            **run_settings(profile)}


# a resume with another value of one of these would train the rest of the run on other rows (checked when the
# checkpoint's metadata has the key: runs written before it was recorded resume as they did)
RUN_SETTINGS = ("max_seq_len", "seed", "data")


def run_settings(profile: Profile) -> dict:
    """What decides a run's rows besides the LoRA: the sequence length, the data seed and the data settings (the
    source, its config, split, rows, what is trained on, packing...; not where a gs:// copy is cached)."""
    data = {k: v for k, v in dataclasses.asdict(profile.data).items() if k != "cache_dir"}
    return {"max_seq_len": profile.train.max_seq_len, "seed": profile.train.seed,
            "data": json.loads(json.dumps(data))}  # as JSON reads it back (tuples become lists)


def check_or_write_metadata(ckpt_dir: Path, meta: dict) -> None:
    """Refuse to resume from checkpoints of another LoRA configuration; write the metadata for a fresh run."""
    ckpt_dir = to_path(ckpt_dir)
    path = ckpt_dir / METADATA
    steps = list_steps(ckpt_dir)
    if path.is_file():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), v) for k, v in meta.items()
                if k != "dropout" and (k in old or k not in RUN_SETTINGS) and old.get(k) != v}
        if "data" in diff:  # name the data setting that changed, not the whole spec
            a, b = diff.pop("data")
            diff.update({f"data.{k}": (a.get(k), b.get(k)) for k in b if a.get(k) != b.get(k)})
        if diff and steps:
            details = "; ".join(f"{k}: checkpoint has {a!r}, this run {b!r}" for k, (a, b) in diff.items())
            raise TrainingError(f"{ckpt_dir} holds checkpoints of other settings ({details}): resuming would train "
                                f"the rest of the run on other rows or another LoRA. Use another --run-dir, or "
                                f"delete {ckpt_dir} to start over.")
    elif steps:
        raise TrainingError(f"{ckpt_dir} holds checkpoints without {METADATA}: not written by this course, "
                            f"refusing to resume from them. Use another --run-dir.")
    if is_main():
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(meta, indent=1))


# ---------------------------------------------------------------------------------------------------------------
# Training

@dataclasses.dataclass
class TrainResult:
    metrics: "object"  # pandas DataFrame, one row per optimizer step
    checkpoint_dir: Path
    start_step: int
    total_steps: int
    seconds: float
    stopped_at: int | None = None  # ``stop_after``: the step it stopped after, saved (the run is not finished)


class StopForPreemption(Exception):
    """Raised by the recorder's hook to leave tunix's loop at once; ``train`` saves the step and raises
    :class:`Preempted`."""


def clean_step(step: int, start_step: int, last_step: int, checkpoint_every: int, eval_every: int | None) -> bool:
    """Whether the time to optimizer step ``step`` is the step's own: not the first of a process (it compiles), not
    the last (the final save), and no checkpoint save or evaluation between it and the step before."""
    return (start_step + 1 < step < last_step and step % checkpoint_every != 0
            and (eval_every is None or step % eval_every != 0))


@dataclasses.dataclass
class MetricsRecorder:
    """tunix's training hooks for one run: writes one metrics line per optimizer step; stops on a non-finite loss,
    at ``stop_at``, and before the optimizer step that follows the one where ``watch`` sees the preemption.
    ``wall_s`` is the time between the ends of two steps (tunix reports a step once the next is dispatched, so in a
    steady run that is one step); ``step_s`` the same only where :func:`clean_step` holds, else None: evaluations and
    saves are not the step. ``write``: process 0 only (every process sees the same global loss)."""

    path: Path
    start_step: int
    tokens_per_step: object  # tokens in each optimizer step (a sequence)
    schedule: object
    prefix: str
    write: bool = True
    watch: PreemptionWatch | None = None
    accum: int = 1
    last_step: int | None = None
    checkpoint_every: int = 10**9
    eval_every: int | None = None
    stop_at: int | None = None

    def __post_init__(self):
        self.last = time.perf_counter()
        self.rows = []
        self.preempted_at: int | None = None
        self.stopped_at: int | None = None
        self.asked: dict[int, bool] = {}
        self.lines = self.path.read_text().splitlines(keepends=True) if self.write and self.path.is_file() else []
        self.written, self.uploaded = len(self.lines), -math.inf

    def record(self, row: dict) -> None:
        self.rows.append(row)
        if self.write:
            self.lines.append(json.dumps(row) + "\n")
            if not is_remote(self.path) or time.monotonic() - self.uploaded >= GCS_REWRITE_S:
                self.flush()

    def flush(self) -> None:
        """Write the lines not written yet (on gs://, those held back by :data:`GCS_REWRITE_S`)."""
        if self.write and len(self.lines) > self.written:
            if is_remote(self.path):  # nothing appends to an object: the whole file, once
                write_atomic(self.path, "".join(self.lines))
            else:
                with self.path.open("a") as f:
                    f.write("".join(self.lines[self.written:]))
            self.written, self.uploaded = len(self.lines), time.monotonic()

    def on_train_start(self, trainer):
        self.last = time.perf_counter()

    def on_train_end(self, trainer):
        pass

    def stop_after(self, done: int) -> None:
        """Stop after ``done`` steps if the watch says so. Asked once per step (every process must ask with the same
        step numbers), before an evaluation or the next step, whichever comes first. ``stop_at`` stops there too,
        with nothing to agree on: every process counts the same steps."""
        if self.stop_at is not None and done >= self.stop_at:
            self.stopped_at = done
            raise StopForPreemption
        if self.watch is None:
            return
        if done not in self.asked:
            self.asked[done] = self.watch.reached(done)
        if self.asked[done]:
            self.preempted_at = done
            raise StopForPreemption

    def on_train_step_start(self, trainer):
        """Before each micro-batch; at an optimizer step's first, ``trainer.train_steps`` steps are done and saved if
        due (tunix calls ``on_train_step_end`` a step late, so the check cannot go there)."""
        if trainer.iter_steps % self.accum == 0:
            self.stop_after(int(trainer.train_steps))

    def on_eval_step_start(self, trainer):
        """An evaluation on the stopping step would eat the grace period: the save comes first."""
        self.stop_after(int(trainer.train_steps))

    def on_train_step_end(self, trainer, train_step, train_loss):
        now = time.perf_counter()
        loss = float(np.asarray(train_loss))
        step = int(train_step)
        grad = trainer.metrics_logger.get_metric_history(self.prefix, "grad_norm", "train")[-1]
        tokens = int(self.tokens_per_step[step - 1]) if step - 1 < len(self.tokens_per_step) else 0
        wall = now - self.last
        clean = clean_step(step, self.start_step, self.last_step or 10**9, self.checkpoint_every, self.eval_every)
        self.last = now
        self.record({"step": step, "loss": loss, "lr": float(self.schedule(step - 1)), "grad_norm": float(grad),
                     "step_s": wall if clean else None, "wall_s": wall, "tokens": tokens,
                     "tokens_per_s": tokens / max(wall, 1e-9) if clean else None})
        if not math.isfinite(loss):
            raise NonFiniteLossError(
                f"Loss is {loss} at step {step}. Training stopped; the update was skipped, so the latest "
                f"checkpoint holds the last good LoRA params. Lower the learning rate or check the data.")

    def on_eval_step_end(self, trainer, eval_loss):
        loss = float(trainer.metrics_logger.get_metric_history(self.prefix, "loss", "eval")[-1])
        self.record({"step": int(trainer.train_steps), "eval_loss": loss})


def metrics_recorder(path: Path, start_step: int, tokens_per_step, schedule, prefix: str,
                     **settings) -> MetricsRecorder:
    """A :class:`MetricsRecorder` (``settings``: its other fields), registered as tunix's ``TrainingHooks``."""
    from tunix.sft import hooks

    hooks.TrainingHooks.register(MetricsRecorder)  # an ABC: a virtual subclass keeps tunix out of the course's import
    return MetricsRecorder(path, start_step, tokens_per_step, schedule, prefix, **settings)


def _trim_metrics(path: Path, start_step: int) -> None:
    """Keep the metrics of steps a resumed run will not redo."""
    if path.is_file():
        keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= start_step]
        write_atomic(path, "".join(line + "\n" for line in keep))


def read_metrics(run_dir: str | Path):
    """The training metrics as a DataFrame (last value per step wins)."""
    import pandas as pd

    path = to_path(run_dir) / "train" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []
    if not rows:
        return pd.DataFrame(columns=["step", "loss", "eval_loss"])
    df = pd.DataFrame(rows)
    return df.groupby("step", as_index=False).last()


def total_steps(profile: Profile, train_rows: int) -> int:
    t = profile.train
    per_epoch = train_rows // (t.micro_batch * t.grad_accum)
    steps = per_epoch * t.epochs
    return min(steps, t.max_steps) if t.max_steps else steps


def apply_profile_lora(model, profile: Profile, seed: int):
    """The profile's LoRA on ``model``, then its remat policy (``remat.lora_then_remat``: the only working order).

    Then every param is placed as annotated, in every process (qwix places QLoRA's nf4 weights its own way), so
    training runs the program ``plan`` compiles (sharded weights, LoRA and AdamW state, a reduce-scatter of the
    gradient), not a replicated copy per chip."""
    import jax
    from flax import nnx

    spec = profile.lora
    mesh = next(x.sharding.mesh for x in jax.tree.leaves(nnx.state(model)) if hasattr(x, "sharding"))
    lora_model = remat.lora_then_remat(model, spec.rank, spec.alpha, profile.train.remat, seed=seed,
                                       targets=spec.targets, dropout=spec.dropout, qlora=spec.qlora,
                                       expert_rank=spec.expert_rank)
    sharding.apply_annotations(lora_model, mesh)
    return lora_model


def train(profile: Profile, run_dir: str | Path | Run | None = None, base_dir: str | Path | None = None,
          max_steps: int | None = None, prepared=None, progress: bool = True,
          checkpoint_every: int | None = None, stop_after: int | None = None) -> TrainResult:
    """Train the profile's LoRA; resume from the latest checkpoint in ``run_dir/checkpoints`` if there is one.

    ``max_steps`` and ``checkpoint_every`` override the profile's values (for short runs and tests). ``stop_after``
    (a first run on a new machine): stop after that optimizer step of the full run, with its checkpoint saved; the
    learning-rate schedule stays the full run's, so calling again without it resumes as if nothing had stopped.

    On SIGTERM (a spot TPU's preemption notice) the step in progress ends, every process saves a checkpoint of the
    same step (``fixes/train/preemption.py``), and :class:`Preempted` is raised; calling this again resumes from there.

    Multi-host (after ``multihost.initialize``): every process calls this with the same arguments and ``run_dir``
    (a directory all hosts share, or ``gs://BUCKET/PATH``). The mesh spans all processes' devices;
    each process feeds its rows of each global batch; Orbax writes and restores the checkpoints from all processes;
    process 0 alone writes the metrics, ``done.json`` and the LoRA metadata. The returned metrics are process 0's
    file, read by every process.
    """
    watch = PreemptionWatch(at_once=True)  # while loading and restoring, a notice stops at once: nothing to save
    try:
        with watch:
            return _train(profile, run_dir, base_dir, max_steps, prepared, progress, checkpoint_every, watch,
                          stop_after)
    except NoticeBeforeTraining:
        raise Preempted(f"SIGTERM: stopped before the first step, while loading or restoring: nothing was trained "
                        f"since the last checkpoint. Run the same command again to resume (exit code "
                        f"{PREEMPTED_EXIT}).") from None


def _train(profile: Profile, run_dir, base_dir, max_steps, prepared, progress: bool, checkpoint_every,
           watch: PreemptionWatch, stop_after: int | None = None) -> TrainResult:
    import jax

    overrides = {k: v for k, v in (("max_steps", max_steps), ("checkpoint_every", checkpoint_every)) if v is not None}
    if overrides:
        profile = dataclasses.replace(profile, train=dataclasses.replace(profile.train, **overrides))
    t = profile.train
    run = resolve_run(profile, run_dir)
    base = _base(profile, run, base_dir)
    mesh = profile.make_mesh()
    fsdp = dict(mesh.shape).get("fsdp", 1)
    if t.micro_batch % fsdp:
        raise TrainingError(f"micro_batch {t.micro_batch} does not divide the fsdp axis ({fsdp}); the batch is "
                            f"split over fsdp. Use a multiple of {fsdp}.")
    ckpt_dir = run.checkpoints
    check_or_write_metadata(ckpt_dir, lora_metadata(profile, read_text_config(base)))  # ensure_base checked it
    if prepared is None:
        from transformers import AutoTokenizer

        prepared = data_lib.prepare(profile.data, AutoTokenizer.from_pretrained(base), t.max_seq_len, t.seed,
                                    progress=progress)
    steps = total_steps(profile, len(prepared.train))
    if steps <= 0:
        raise TrainingError(f"{len(prepared.train)} packed rows give no full optimizer step of "
                            f"{t.micro_batch} x {t.grad_accum} rows.")
    if finished_steps(run.dir) == steps:  # the same command again: nothing to train, so no model to load
        return TrainResult(read_metrics(run.dir), ckpt_dir, steps, steps, 0.0)
    saved = latest_step(ckpt_dir) or 0
    if stop_after is not None and saved >= stop_after:  # a first run's command again
        return TrainResult(read_metrics(run.dir), ckpt_dir, saved, steps, 0.0, stopped_at=saved)
    train_ds, eval_ds, tokens_per_step = _feeds(prepared, mesh, t)
    model = apply_profile_lora(gemma4.load_model(base, mesh, dtype=profile.model.dtype), profile, t.seed)  # then remat
    metrics_path = run.dir / "train" / "metrics.jsonl"
    if is_main() and not is_remote(metrics_path):
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with mesh_lib.trainer_context(mesh):
        trainer = sft.make_trainer(model, t, steps, _trainer_config(t, steps, ckpt_dir, progress and is_main()))
        start_step = trainer.train_steps  # sft.train_step runs here: what `plan` compiles
        if is_main():
            _trim_metrics(metrics_path, start_step)
        with watch.training():  # from here a notice ends the step in progress, and the step is saved
            # the step we start from, reported at once: JAX's sync drops a notice that comes before any report
            watch.reached(start_step)
            recorder = metrics_recorder(metrics_path, start_step, tokens_per_step, sft.lr_schedule(t, steps),
                                        trainer.metrics_prefix, write=is_main(), watch=watch, accum=t.grad_accum,
                                        last_step=steps, checkpoint_every=t.checkpoint_every,
                                        eval_every=t.eval_every if eval_ds is not None else None,
                                        stop_at=stop_after if stop_after is not None and stop_after < steps else None)
            _run_trainer(trainer, recorder, train_ds, eval_ds)
    jax.effects_barrier()
    return _finish(recorder, run.dir, ckpt_dir, start_step, steps, time.perf_counter() - started, watch)


def _base(profile: Profile, run: Run, base_dir) -> Path:
    """The base checkpoint (``--base DIR``: used as it is, or downloaded there), fetched and checked if needed: on a
    pod by process 0 while the others wait (one download)."""
    base_dir = absolute_path(base_dir, "base directory") if base_dir is not None else None
    return main_first(lambda: base_model.ensure_base(profile, run, base=base_dir), "fetch the base",
                      directory=Path(base_dir).parent if base_dir else run.local)


def _feeds(prepared, mesh, t):
    """The training and evaluation batches (this process's rows of each global batch) and the tokens in each
    optimizer step (of the whole global batch)."""
    rows = process_rows(mesh, t.micro_batch)
    train_ds = GlobalBatches(packing.batches(prepared.train, t.micro_batch, t.seed, epochs=t.epochs, rows=rows),
                             mesh, t.micro_batch)
    eval_ds = (GlobalBatches(packing.batches(prepared.eval, t.micro_batch, t.seed, shuffle=False, rows=rows),
                             mesh, t.micro_batch)
               if prepared.eval is not None and len(prepared.eval) >= t.micro_batch else None)
    micro_tokens = np.array([int((b["segment_ids"] > 0).sum())
                             for b in packing.batches(prepared.train, t.micro_batch, t.seed, t.epochs,
                                                       rows=slice(None))])
    tokens_per_step = micro_tokens[: len(micro_tokens) // t.grad_accum * t.grad_accum].reshape(-1, t.grad_accum).sum(1)
    return train_ds, eval_ds, tokens_per_step


def _trainer_config(t, steps: int, ckpt_dir: Path, progress: bool):
    """tunix's TrainingConfig for the run: Orbax checkpoints of the LoRA and optimizer under ``ckpt_dir``."""
    import orbax.checkpoint as ocp
    from tunix.sft import peft_trainer

    options = ocp.CheckpointManagerOptions(save_interval_steps=t.checkpoint_every, max_to_keep=t.keep_checkpoints,
                                           enable_async_checkpointing=False)
    return peft_trainer.TrainingConfig(
        eval_every_n_steps=t.eval_every, max_steps=steps, gradient_accumulation_steps=t.grad_accum,
        checkpoint_root_directory=str(ckpt_dir), checkpointing_options=options,
        pbar_description="training" if progress else None)


def _run_trainer(trainer, recorder: MetricsRecorder, train_ds, eval_ds) -> None:
    """tunix's loop with the recorder's hooks; a stop saves the step, a failure closes Orbax on what was saved."""
    trainer.with_training_hooks(recorder)
    try:
        trainer.train(train_ds, eval_ds)  # ends with trainer.close(): saves the last step if not saved yet
    except StopForPreemption:
        trainer.close()  # the last metrics line, the step's checkpoint if not saved yet, Orbax closed
    except BaseException:
        trainer.checkpoint_manager.close()  # flush what was saved; the failing step saved nothing new
        raise
    finally:
        recorder.flush()  # metrics lines held back on gs://


def _finish(recorder: MetricsRecorder, run_dir, ckpt_dir, start_step: int, steps: int, seconds: float,
            watch: PreemptionWatch) -> TrainResult:
    """After the loop: a preemption raises, a ``stop_after`` returns, a finished run writes ``done.json``."""
    if recorder.preempted_at is not None:
        _preempted(recorder.preempted_at, steps, ckpt_dir, watch.signal_at)
    if recorder.stopped_at is not None:
        _sync("train stopped")
        return TrainResult(read_metrics(run_dir), ckpt_dir, start_step, steps, seconds, stopped_at=recorder.stopped_at)
    if is_main():
        write_atomic(run_dir / "train" / DONE, json.dumps({"steps": steps, "seconds": round(seconds, 1),
                                                            **device_record()}))
    _sync("train done")  # the others read process 0's metrics file only once it is complete
    return TrainResult(read_metrics(run_dir), ckpt_dir, start_step, steps, seconds)


def device_record() -> dict:
    """What ran the training, for ``done.json`` (the run report reads it): the devices' platform, kind and count, the
    processes, and the peak memory in use on this process's chips since it started (the largest over its chips,
    from ``jax.Device.memory_stats()``, with that chip's limit; None where the runtime keeps no statistics: the
    CPU)."""
    import jax

    devices = jax.devices()
    stats = [s for s in (d.memory_stats() for d in jax.local_devices()) if s and "peak_bytes_in_use" in s]
    peak = max(stats, key=lambda s: s["peak_bytes_in_use"]) if stats else None
    return {"platform": devices[0].platform, "device_kind": devices[0].device_kind, "device_count": len(devices),
            "process_count": jax.process_count(),
            "peak_hbm_bytes": peak["peak_bytes_in_use"] if peak else None,
            "hbm_limit_bytes": peak.get("bytes_limit") if peak else None}


def _preempted(step: int, steps: int, ckpt_dir: Path, signal_at: float | None) -> None:
    _sync("train preempted")  # every process has saved: none exits while another still writes
    saved = latest_step(ckpt_dir)
    if saved != step:
        raise TrainingError(f"training stopped for a preemption at step {step}, but the latest checkpoint in "
                            f"{ckpt_dir} is {saved}: the save did not complete. Run the same command to resume "
                            f"from step {saved}.")
    after = f", {time.monotonic() - signal_at:.1f} s after the signal" if signal_at is not None else ""
    raise Preempted(f"SIGTERM: stopped after step {step} of {steps} and saved it in {ckpt_dir / str(step)}{after}. "
                    f"Run the same command again to resume from step {step} (exit code {PREEMPTED_EXIT}).")


def _sync(name: str) -> None:
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def latest_step(checkpoint_dir: str | Path) -> int | None:
    steps = list_steps(checkpoint_dir)
    return max(steps) if steps else None


def finished_steps(run_dir: str | Path) -> int | None:
    """The step count of a run that finished (its ``done.json``) and still has that step's checkpoint, else None."""
    run_dir = to_path(run_dir)
    done = run_dir / "train" / DONE
    if not done.is_file():
        return None
    steps = json.loads(done.read_text())["steps"]
    return steps if latest_step(run_dir / "checkpoints") == steps else None


def plot_loss(metrics, path: str | Path | None = None):
    """Loss (and eval loss) per optimizer step; saved to ``path`` when given."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    tr = metrics.dropna(subset=["loss"]) if "loss" in metrics else metrics.iloc[0:0]
    ax.plot(tr["step"], tr["loss"], label="train loss")
    if "eval_loss" in metrics:
        ev = metrics.dropna(subset=["eval_loss"])
        ax.plot(ev["step"], ev["eval_loss"], "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("NLL per assistant token")
    ax.legend()
    fig.tight_layout()
    if path and is_main():
        path = to_path(path)
        if not is_remote(path):
            path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:  # also on gs://
            fig.savefig(f, dpi=100, format=path.suffix.lstrip(".") or "png")
    return fig


def ensure_trained(profile: Profile, run_dir: str | Path | Run | None = None, progress: bool = True) -> Path:
    """The profile's LoRA checkpoints (``run_dir/checkpoints``), training first if the run has not finished.

    How later notebooks (merge, serve, evaluate) stay standalone: the first one to need a trained LoRA trains it.
    """
    run = resolve_run(profile, run_dir)
    if finished_steps(run.dir) is None:
        train(profile, run_dir=run, progress=progress)
    return run.checkpoints
