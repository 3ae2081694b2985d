"""The one train step: the program the AOT plan compiles is, to the byte, the one tunix's trainer runs in
``train.train``; and a change to any part of the step (optimizer, accumulation, remat, LoRA dropout) changes it."""

import dataclasses

import numpy as np
import pytest

from gemma_tpu_helpers.course.training import train
from gemma_tpu_helpers.fixes.model import gemma4
from gemma_tpu_helpers.fixes.train import remat, sft, step


@pytest.fixture(scope="module")
def trainer_program(smoke, tiny_dir, mesh):
    """The step tunix's PeftTrainer jits in train.train (same model preparation, trainer and config), lowered for
    a smoke-shaped micro-batch, and the trainer itself."""
    from tunix.sft import peft_trainer

    from gemma_tpu_helpers.fixes.model import mesh as mesh_lib

    t = smoke.train
    model = train.apply_profile_lora(gemma4.load_model(tiny_dir, mesh, dtype=smoke.model.dtype), smoke, t.seed)
    config = peft_trainer.TrainingConfig(eval_every_n_steps=10, max_steps=10, gradient_accumulation_steps=t.grad_accum)
    with mesh_lib.trainer_context(mesh):
        trainer = sft.make_trainer(model, t, 10, config)
        # what PeftTrainer.train(...) calls for every micro-batch (it caches the graph: cache_nnx_graph=True)
        train_fn, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)
        lowered = train_fn.jitted.lower(trainer.model, trainer.optimizer,
                                        step.abstract_batch(mesh, t.micro_batch, t.max_seq_len))
    return trainer, lowered


def plan_program(smoke, tiny_dir, mesh, **changes):
    """What plan.compile_train_step lowers, on the smoke mesh and the tiny config, with profile ``changes``."""
    lora_spec = dataclasses.replace(smoke.lora, **changes.pop("lora", {}))
    remat_policy = changes.pop("remat", smoke.train.remat)
    train_spec = dataclasses.replace(smoke.train, **changes)
    args = step.abstract_arguments(gemma4.read_text_config(tiny_dir), mesh, lora_spec, train_spec,
                                   train_spec.micro_batch, train_spec.max_seq_len, dtype=smoke.model.dtype,
                                   remat=remat_policy, total_steps=10)
    return step.lower(*args, mesh)


def test_the_trainer_runs_step_train_step(trainer_program):
    trainer, _ = trainer_program
    assert trainer.create_train_step_fn() is sft.train_step
    train_fn, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)
    assert train_fn.donates_model and train_fn.func.__wrapped__ is train_fn.jitted  # cached graph over sft.jitted()
    assert trainer.loss_fn is sft.loss_fn and trainer.gen_model_input_fn is sft.model_inputs  # eval: same loss


def test_the_plan_compiles_the_program_training_runs(trainer_program, smoke, tiny_dir, mesh):
    """The abstract plan arguments (no weights) lower to the same StableHLO as the trainer's jitted step on the
    loaded checkpoint: same optimizer chain and accumulation, same inputs and mask, same shardings."""
    _, trained = trainer_program
    planned = plan_program(smoke, tiny_dir, mesh)
    assert step.fingerprint(planned) == step.fingerprint(trained)


@pytest.mark.parametrize("change", [dict(grad_accum=1), dict(max_grad_norm=0.5), dict(remat="block"),
                                    dict(lora=dict(dropout=0.1))])
def test_any_change_to_the_step_changes_the_program(trainer_program, smoke, tiny_dir, mesh, change):
    _, trained = trainer_program
    assert step.fingerprint(plan_program(smoke, tiny_dir, mesh, **change)) != step.fingerprint(trained)


def test_the_trainer_step_aliases_the_base_weights(trainer_program):
    """nnx.jit returns the whole model state; with only the optimizer donated (tunix's default) XLA would copy every
    frozen weight into a new buffer each step. Ours donates the model: every state byte is aliased."""
    import math

    import jax
    from flax import nnx

    trainer, lowered = trainer_program
    figures = remat.memory_figures(lowered.compile())
    state = [x for x in jax.tree.leaves((nnx.state(trainer.model), nnx.state(trainer.optimizer)))]
    state_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in state)
    assert figures["alias_bytes"] >= state_bytes > 0
    # what is not aliased: the loss, the grad norm and a few scalars (3 KB here; tunix's donation left 3.4 MB)
    assert figures["output_bytes"] - figures["alias_bytes"] < 0.01 * state_bytes


def test_one_process_saves_each_replicated_array_once(tmp_path, mesh, monkeypatch):
    """Orbax's default cuts each replicated array into one slice per device, an eager op each (4,608 of them per
    save on the smoke mesh); after save_replicas_once (make_trainer calls it) a one-process save takes no slice, and
    the checkpoint restores the same arrays."""
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec

    registered = ocp.type_handlers.get_type_handler(jax.Array)
    tree = {f"p{i}": jax.device_put(np.arange(64 * 8, dtype=np.float32).reshape(64, 8) + i,
                                    NamedSharding(mesh, PartitionSpec())) for i in range(4)}
    slices, real = [], jax.lax.slice_in_dim
    monkeypatch.setattr(jax.lax, "slice_in_dim", lambda *a, **k: slices.append(a[0].shape) or real(*a, **k))

    def save_and_restore(directory):
        slices.clear()
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
        with ocp.CheckpointManager(directory, options=options) as manager:
            manager.save(1, args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(tree)))
            saved_with = len(slices)
            back = manager.restore(1, args=ocp.args.Composite(model_params=ocp.args.PyTreeRestore()))["model_params"]
        assert {k: np.asarray(v).tolist() for k, v in back.items()} == \
            {k: np.asarray(v).tolist() for k, v in tree.items()}
        return saved_with

    try:  # Orbax's default handler (an earlier test in this process may have run make_trainer)
        ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
            use_replica_parallel=True, array_metadata_store=registered._array_metadata_store), override=True)
        assert save_and_restore(tmp_path / "default") >= len(tree) * len(mesh.devices.flat)
        sft.save_replicas_once()
        assert save_and_restore(tmp_path / "once") == 0
    finally:
        ocp.type_handlers.register_type_handler(jax.Array, registered, override=True)


@pytest.mark.parametrize("start, last, save_every, eval_every, timed", [
    (0, 5, 1000, None, [2, 3, 4]),  # not the first (it compiles) nor the last (the final save)
    (0, 5, 1000, 2, [3]),  # nor a step with an evaluation
    (2, 5, 1000, None, [4]),  # resumed after step 2: step 3 compiles
    (0, 10, 4, None, [2, 3, 5, 6, 7, 9]),  # nor a step with a checkpoint save
])
def test_clean_step_times_the_steps_with_nothing_else_in_them(start, last, save_every, eval_every, timed):
    steps = range(start + 1, last + 1)
    assert [s for s in steps if train.clean_step(s, start, last, save_every, eval_every)] == timed
