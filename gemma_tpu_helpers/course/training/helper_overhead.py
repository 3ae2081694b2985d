"""What do the helpers cost? The train step through :func:`train.train` against a bare tunix loop (notebook 06).

The bare loop is the least a tunix user writes for the same run (tunix's loader and ``PeftTrainer``, raw qwix LoRA,
the same loss, optimizer and batches) and nothing else: no checks, metrics file, evaluation or checkpoints. The
losses agree; the step-time ratio is what the helpers add.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ...fixes.model import gemma4, hf_checkpoint
from ...fixes.model import mesh as mesh_lib
from ...fixes.train import data, lora, packing, sft
from ..config.profiles import Profile
from . import train


def bare_tunix_run(profile: Profile, base_dir, prepared, steps: int) -> dict:
    """``steps`` optimizer steps of the profile's LoRA with bare tunix + qwix; per-step losses and wall times.

    Times are taken at each step's end, after its loss is ready (as :func:`train.train` does).
    """
    import jax
    import qwix
    from flax import nnx
    from tunix.models.gemma4 import params_safetensors
    from tunix.sft import hooks, peft_trainer

    t = profile.train
    mesh = profile.make_mesh()
    cfg = gemma4.to_tunix_config(hf_checkpoint.read_text_config(base_dir), dtype=profile.model.dtype)
    model = params_safetensors.create_model_from_safe_tensors(str(base_dir), cfg, mesh=mesh)
    provider = qwix.LoraProvider(module_path=lora.regex_for(profile.lora.targets), rank=profile.lora.rank,
                                 alpha=float(profile.lora.alpha), dropout=float(profile.lora.dropout))
    model = qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(t.seed), **model.get_model_input())
    total = min(train.total_steps(profile, len(prepared.train)), steps)  # the schedule train.train(max_steps=steps) has
    config = peft_trainer.TrainingConfig(eval_every_n_steps=10**9, max_steps=steps,
                                         gradient_accumulation_steps=t.grad_accum)
    losses, ends = [], []

    class Clock(hooks.TrainingHooks):
        def on_train_start(self, trainer):
            ends.append(time.perf_counter())

        def on_train_step_end(self, trainer, train_step, train_loss):
            losses.append(float(jax.block_until_ready(train_loss)))
            ends.append(time.perf_counter())

        on_train_end = on_train_step_start = on_eval_step_start = on_eval_step_end = \
            lambda self, *a, **k: None

    with mesh_lib.trainer_context(mesh):
        trainer = peft_trainer.PeftTrainer(model, sft.build_optimizer(t, total), config)
        trainer.with_training_hooks(Clock())
        trainer.with_loss_fn(sft.loss_fn).with_gen_model_input_fn(sft.model_inputs)
        trainer.train(packing.batches(prepared.train, t.micro_batch, t.seed, epochs=t.epochs))
    return {"loss": losses, "step_s": list(np.diff(ends))}


def compare(profile: Profile, base_dir, run_dir, steps: int = 4, prepared=None):
    """Run ``steps`` steps through :func:`train.train` (into a fresh ``run_dir``) and through the bare loop.

    Returns a per-step table (loss and step time of each) whose ``attrs`` hold the median step times over the
    steps :func:`train.clean_step` times (the same steps for both loops) and their ratio, ``helpers / bare``.
    """
    import pandas as pd
    from transformers import AutoTokenizer

    if steps < 2:
        raise ValueError(f"steps must be at least 2 (the first step compiles); got {steps}.")
    run_dir = Path(run_dir)
    if (run_dir / "checkpoints").exists():
        raise FileExistsError(f"{run_dir} already holds a run; the comparison needs a fresh one (it would resume).")
    if prepared is None:
        prepared = data.prepare(profile.data, AutoTokenizer.from_pretrained(base_dir), profile.train.max_seq_len,
                                profile.train.seed, progress=False)
    ours = train.train(profile, run_dir=run_dir, base_dir=base_dir, max_steps=steps, prepared=prepared,
                       progress=False).metrics.dropna(subset=["loss"])
    bare = bare_tunix_run(profile, base_dir, prepared, steps)
    table = pd.DataFrame({"step": np.arange(1, steps + 1), "helpers loss": ours["loss"].to_numpy(),
                          "bare tunix loss": bare["loss"], "helpers step s": ours["step_s"].to_numpy(),
                          "bare tunix step s": bare["step_s"]})
    clean = table["helpers step s"].notna()  # train.clean_step: no compile, evaluation or save in the time
    if not clean.any():
        raise ValueError(f"{steps} steps leave no step without a compile, evaluation or checkpoint save to time; "
                         f"run more steps.")
    helpers_s = float(table["helpers step s"][clean].median())
    bare_s = float(table["bare tunix step s"][clean].median())
    table.attrs.update(helpers_step_s=helpers_s, bare_step_s=bare_s, ratio=helpers_s / bare_s,
                       max_loss_diff=float((table["helpers loss"] - table["bare tunix loss"]).abs().max()))
    return table
