"""Is the TPU run the GPU recipe? A settings table, and a loss-curve parity run against HF PEFT (notebook 06).

:func:`settings_table` puts the two recipes side by side per optimizer update. :func:`peft_parity` trains the tiny
model both ways (HF PEFT on torch CPU, tunix + qwix on the device mesh) from the same LoRA init, rows and optimizer,
and compares the loss curves.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...fixes.export import peft_export
from ...fixes.model import gemma4, layout, parity
from ...fixes.train import chat_tokens, data, packing, remat, sft
from ..config import paths
from ..config.profiles import GPU_RECIPE, Profile

# tunix gives k and v one LoRA A on local layers (one kv_einsum); PEFT gives each its own. The parity run leaves
# them out so that both sides train the same function; the settings table lists the difference.
PARITY_TARGETS = ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def settings_table(profile: Profile, lengths, gpu: dict = GPU_RECIPE):
    """Per optimizer update: examples, real tokens and loss tokens for the GPU recipe (TRL + PEFT, padded, loss
    on the full sequence) and for ours (packed, assistant-only loss), with the shared hyperparameters.

    ``lengths`` are the token counts of the training examples (e.g. ``packing.codev_like_lengths()`` for CodeV-R1).
    """
    import pandas as pd

    lengths = np.asarray(lengths)
    t, lo = profile.train, profile.lora
    gpu_examples = gpu["per_device_batch"] * gpu["grad_accum"] * gpu["world_size"]
    gpu_kept = lengths[lengths <= gpu["max_seq_len"]]
    use = packing.token_use_for_lengths(lengths, t.max_seq_len)
    ours_kept = lengths[lengths <= t.max_seq_len]
    rows_per_update = t.micro_batch * t.grad_accum
    examples_per_row = len(ours_kept) / use["packed_rows"] if profile.data.pack else 1.0
    ours_examples = rows_per_update * examples_per_row
    ours_rows = use["packed_rows"] if profile.data.pack else use["padded_rows"]
    rows = [
        ("devices", f"{gpu['world_size']} x {gpu['platform'].split('x')[-1]}", f"{profile.hardware.num_devices} x "
         f"{profile.hardware.chip or 'CPU'} (mesh {dict(profile.hardware.mesh)})"),
        ("batch per step x grad accum", f"{gpu['per_device_batch']} per device x {gpu['grad_accum']}",
         f"{t.micro_batch} rows x {t.grad_accum}"),
        ("examples per update", f"{gpu_examples}", f"{ours_examples:.1f} ({examples_per_row:.2f} per packed row)"),
        ("real tokens per update (mean)", f"{gpu_examples * gpu_kept.mean():.0f}",
         f"{rows_per_update * t.max_seq_len * (use['packed'] if profile.data.pack else use['pad_to_max']):.0f}"),
        ("tokens computed per update", f"{gpu_examples * gpu['max_seq_len']} (padded)" if not gpu["packing"] else "",
         f"{rows_per_update * t.max_seq_len}"),
        ("loss on", gpu["loss_on"], "assistant tokens only"),
        ("optimizer steps per epoch", f"{len(gpu_kept) // gpu_examples}", f"{ours_rows // rows_per_update}"),
        ("max length", f"{gpu['max_seq_len']}", f"{t.max_seq_len} ({profile.data.overlong} longer)"),
        ("learning rate, schedule", f"{gpu['learning_rate']:g}, {gpu['schedule']}, {gpu['warmup_steps']} warmup",
         f"{t.learning_rate:g}, {t.schedule}, {t.warmup_steps} warmup"),
        ("weight decay", f"{gpu['weight_decay']:g}", f"{t.weight_decay:g}"),
        ("LoRA rank / alpha / dropout", f"{gpu['lora_rank']} / {gpu['lora_alpha']} / {gpu['lora_dropout']}",
         f"{lo.rank} / {lo.alpha:g} / {lo.dropout}"),
        ("LoRA targets", ", ".join(gpu["lora_targets"]), ", ".join(lo.targets)
         + " (k,v share one A on local layers)"),
        ("dtype", gpu["dtype"], profile.model.dtype),
    ]
    table = pd.DataFrame(rows, columns=["setting", f"GPU recipe ({gpu['platform']}, TRL + PEFT)",
                                        f"ours ({profile.name})"])
    table["same"] = table.iloc[:, 1] == table.iloc[:, 2]
    return table


def _batches(base_dir, n_steps: int, batch: int, seq_len: int):
    """Fixed rows for the parity run: whole shipped examples of at most ``seq_len`` tokens, one per row (reused
    in turn when there are fewer than ``n_steps * batch``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    rows = data.load_rows(str(paths.SHIPPED_REPLICA), config=paths.SHIPPED_CONFIG)
    examples = [e for e in chat_tokens.tokenize_rows(rows, tokenizer, progress=False)
                if len(e[0]) <= seq_len]
    if len(examples) < batch:
        raise ValueError(f"Only {len(examples)} shipped examples fit in {seq_len} tokens; raise seq_len.")
    examples = [examples[i % len(examples)] for i in range(n_steps * batch)]
    padded = packing.pad_to_max(examples, seq_len, "drop", tokenizer.pad_token_id or 0)
    return [{k: getattr(padded, k)[s * batch:(s + 1) * batch]
             for k in ("tokens", "loss_mask", "segment_ids", "positions")}
            for s in range(n_steps)]


def _to_peft(jax_lora: dict, rank: int) -> dict[str, np.ndarray]:
    """tunix/qwix LoRA arrays -> PEFT ``lora_A.default.weight`` / ``lora_B.default.weight``, by the layout table."""
    out = {}
    for (layer, module), ab in jax_lora.items():
        for row in layout.rows_of_module(module):  # kv_einsum feeds k_proj and v_proj
            la, lb = peft_export.peft_factors(row, ab["a"], ab["b"], rank)
            out[peft_export.peft_key(layer, row, "A", adapter="default")] = np.ascontiguousarray(la)
            out[peft_export.peft_key(layer, row, "B", adapter="default")] = np.ascontiguousarray(lb)
    return out


def _jax_lora_arrays(model) -> dict:
    from flax import nnx

    found: dict = {}
    for path, v in nnx.iter_graph(model):
        if isinstance(v, nnx.LoRAParam):
            layer, module, leaf = int(path[1]), str(path[-2]), str(path[-1])
            found.setdefault((layer, module), {})["a" if leaf.endswith("_a") else "b"] = np.asarray(v.value)
    return found


def _peft_losses(base_dir, init: dict, rank: int, alpha: float, spec, steps: int, batches) -> list[float]:
    """HF PEFT's losses on ``batches`` (torch CPU), from qwix's initial LoRA values ``init``: AdamW with the same
    schedule, clipping and masked loss as the tunix run."""
    import torch
    from peft import LoraConfig, get_peft_model

    hf = parity.load_hf(base_dir)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none",
                        target_modules=r".*language_model\.layers\.\d+\.(self_attn\.(q_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))")
    peft_model = get_peft_model(hf, config)
    state = _to_peft(init, rank)
    missing = set(state) - set(peft_model.state_dict())
    if missing:
        raise RuntimeError(f"PEFT model lacks {sorted(missing)[:3]}...")
    peft_model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=spec.weight_decay)
    schedule = sft.lr_schedule(spec, steps)
    torch_losses = []
    peft_model.train()
    for s, b in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = float(schedule(s))
        ids = torch.as_tensor(b["tokens"], dtype=torch.long)
        logits = peft_model(input_ids=ids, attention_mask=torch.as_tensor(b["segment_ids"] > 0)).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
        mask = torch.as_tensor(b["loss_mask"][:, 1:] > 0).float()
        loss = (nll * mask).sum() / mask.sum().clamp(min=1)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm)
        opt.step()
        torch_losses.append(float(loss.detach()))
    return torch_losses


def peft_parity(profile: Profile, base_dir, mesh, steps: int = 20, batch: int = 2, seq_len: int = 192,
                learning_rate: float = 1e-3, rank: int = 8, alpha: float = 16.0, seed: int = 0):
    """Train the tiny model ``steps`` steps with HF PEFT (torch CPU) and with tunix + qwix, from the same LoRA
    initial values on the same rows, dropout 0, AdamW + warmup-cosine + clipping; return the two loss curves.

    The B matrices start at zero on both sides, and A is copied from qwix's initial values into PEFT.
    """
    import dataclasses

    import jax
    import pandas as pd

    spec = dataclasses.replace(profile.train, learning_rate=learning_rate, warmup_steps=2, micro_batch=batch,
                               grad_accum=1)
    batches = _batches(base_dir, steps, batch, seq_len)

    # tunix + qwix: the train step, loss and optimizer training runs (sft.train_step), one update per batch
    model = gemma4.load_model(base_dir, mesh, dtype="float32")
    model = remat.lora_then_remat(model, rank, alpha, "none", seed=seed, targets=PARITY_TARGETS)
    init = _jax_lora_arrays(model)
    optimizer = sft.optimizer_for(model, spec, steps)
    train_step = sft.jitted()
    jax_losses = []
    with jax.set_mesh(mesh):
        for b in batches:
            jax_losses.append(float(train_step(model, optimizer, b)[0]))

    torch_losses = _peft_losses(base_dir, init, rank, alpha, spec, steps, batches)  # HF PEFT on torch CPU
    table = pd.DataFrame({"step": np.arange(1, steps + 1), "tunix + qwix": jax_losses, "HF PEFT (torch)": torch_losses})
    table["|diff|"] = (table["tunix + qwix"] - table["HF PEFT (torch)"]).abs()
    return table


def cached_peft_parity(run_dir, profile: Profile, base_dir, mesh, **kwargs):
    """:func:`peft_parity`, cached as JSON in ``run_dir/equivalence/`` (keyed by the profile's training settings, the
    base, the mesh and the arguments): notebook 06 shows a parity run once per run directory."""
    import dataclasses

    key = {"profile": [profile.name, dataclasses.asdict(profile.train)], "base_dir": str(base_dir),
           "mesh": str(dict(zip(mesh.axis_names, mesh.devices.shape))), **dict(sorted(kwargs.items()))}
    return paths.cached_table(Path(run_dir) / "equivalence", "peft_parity", key,
                              lambda: peft_parity(profile, base_dir, mesh, **kwargs))


def plot_parity(table):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(table["step"], table["tunix + qwix"], "o-", label="tunix + qwix (JAX, 8-device mesh)")
    ax.plot(table["step"], table["HF PEFT (torch)"], "x--", label="HF PEFT (torch CPU)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(f"same rows, same init, same optimizer: max |diff| {table['|diff|'].max():.1e}")
    ax.legend()
    fig.tight_layout()
    return fig
