"""Training: loss goes down, NaN stops cleanly, bad configs are refused. Kill and resume: test_resume.py."""

import dataclasses
import json
import shutil

import numpy as np
import pytest

from gemma_tpu_helpers.course.training import train
from gemma_tpu_helpers.fixes.train import sft
from support import SMOKE_RUN_EVERY, SMOKE_RUN_STEPS, smoke_run_profile

STEPS, EVERY = SMOKE_RUN_STEPS, SMOKE_RUN_EVERY  # conftest's smoke_run: the uninterrupted reference run


def test_trains_lora_only_and_loss_goes_down(smoke_run):
    run_dir, result = smoke_run
    m = result.metrics.dropna(subset=["loss"]).set_index("step")
    assert list(m.index) == list(range(1, STEPS + 1))
    assert (m["grad_norm"] > 0).all() and (m["tokens"] > 0).all()
    assert m["lr"].iloc[0] == 0.0 and m["lr"].max() == pytest.approx(2e-3)  # warmup from 0 to the smoke peak
    # the evaluation (the same rows each time, before training and every eval_every steps) goes down; a step's
    # training loss is another batch's, and four steps of them need not fall one after another
    evals = result.metrics.dropna(subset=["eval_loss"]).set_index("step")["eval_loss"]
    assert len(evals) >= 2 and evals.index[0] == 0 and evals.iloc[-1] < evals.iloc[0], evals
    meta = json.loads((run_dir / "checkpoints" / train.METADATA).read_text())
    assert meta["rank"] == 8 and meta["targets"][0] == "q_proj"
    assert train.latest_step(run_dir / "checkpoints") == STEPS
    saved = sorted(p.name for p in (run_dir / "checkpoints" / str(STEPS)).iterdir())
    assert "model_params" in saved and "optimizer_state" in saved


def test_the_same_command_on_a_finished_run_loads_nothing(smoke_run, tiny_dir, tmp_path, monkeypatch):
    """Run again (a notebook cell, a tmux command), a finished run returns its metrics at once: no model is loaded,
    nothing is restored or written. A run whose last checkpoint is gone is not finished."""
    from gemma_tpu_helpers.fixes.model import gemma4

    run_dir = tmp_path / "again"
    shutil.copytree(smoke_run[0], run_dir)
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}

    def no_load(*args, **kwargs):
        raise AssertionError("a finished run loaded the model")

    monkeypatch.setattr(gemma4, "load_model", no_load)
    again = train.train(smoke_run_profile(), run_dir=run_dir, base_dir=tiny_dir, max_steps=STEPS,
                        checkpoint_every=EVERY, progress=False)
    assert (again.start_step, again.total_steps) == (STEPS, STEPS)
    assert again.metrics.equals(smoke_run[1].metrics)
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == files
    assert train.finished_steps(run_dir) == STEPS
    shutil.rmtree(run_dir / "checkpoints" / str(STEPS))
    assert train.finished_steps(run_dir) is None
    with pytest.raises(AssertionError, match="loaded the model"):  # not finished: it loads the model to train
        train.train(smoke_run_profile(), run_dir=run_dir, base_dir=tiny_dir, max_steps=STEPS, progress=False)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(smoke_run, tiny_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    run_dir = tmp_path / "nan_run"
    shutil.copytree(smoke_run[0], run_dir)
    base = tmp_path / "nan_base"
    shutil.copytree(tiny_dir, base)
    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    key = "model.language_model.layers.0.mlp.down_proj.weight"
    tensors = load_file(base / index[key])
    tensors[key] = np.full_like(tensors[key], np.nan)
    save_file(tensors, base / index[key], metadata={"format": "pt"})
    ckpt = run_dir / "checkpoints" / str(STEPS)
    before = {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    with pytest.raises(train.NonFiniteLossError, match=f"step {STEPS + 1}"):
        train.train(smoke_run_profile(), run_dir=run_dir, base_dir=base, max_steps=STEPS + 2, checkpoint_every=EVERY,
                    progress=False)
    assert train.latest_step(run_dir / "checkpoints") == STEPS
    after = {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    assert after == before


def test_refuses_to_resume_another_lora_config(smoke_run, tiny_dir, smoke, tmp_path):
    run_dir = tmp_path / "other"
    shutil.copytree(smoke_run[0], run_dir)
    other = dataclasses.replace(smoke, lora=dataclasses.replace(smoke.lora, rank=16))
    with pytest.raises(train.TrainingError, match="rank: checkpoint has 8, this run 16"):
        train.train(other, run_dir=run_dir, base_dir=tiny_dir, max_steps=STEPS, progress=False)


def test_batch_must_divide_fsdp(tiny_dir, smoke, tmp_path):
    bad = dataclasses.replace(smoke, train=dataclasses.replace(smoke.train, micro_batch=6))
    with pytest.raises(train.TrainingError, match="micro_batch 6 does not divide the fsdp axis"):
        train.train(bad, run_dir=tmp_path, base_dir=tiny_dir, progress=False)
    assert not (tmp_path / "checkpoints").exists()


def test_token_nll_is_optax_integer_label_cross_entropy():
    import jax
    import optax

    logits = jax.random.normal(jax.random.key(0), (2, 7, 1024)) * 30.0  # softcap-sized logits
    labels = jax.random.randint(jax.random.key(1), (2, 7), 0, 1024)
    ours = jax.jit(sft.token_nll)(logits, labels)
    ref = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-4)
    assert not np.allclose(np.asarray(ours), np.asarray(jax.jit(sft.token_nll)(logits, (labels + 1) % 1024)))
