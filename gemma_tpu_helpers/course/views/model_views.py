"""The model fixes as notebooks 00-04 and the CLI show them: their results as tables and plots, each porting trap run
the wrong way beside the fix, and the sharding plan of a LoRA model from shapes alone.

The fixes return plain data (or, for a report, their own table); the tables made for reading are made here, so a
copied fix carries no notebook machinery.
"""

from __future__ import annotations

import math
from pathlib import Path

from ...fixes.model import gemma4, layout, sharding
from ...fixes.model import mesh as mesh_lib
from ...fixes.model.forward_inputs import causal_inputs
from ...fixes.model.hf_checkpoint import PATTERN
from ...fixes.model.parity import DEFAULT_REL_BOUND
from ...fixes.model.partition_specs import dtype_bits
from ...fixes.train import lora, remat

# ------------------------------------------------------------------------------------------- 00: the port itself

# The real checkpoint's files (google/gemma-4-31B-it) and what the tiny replica has of each.
CHECKPOINT_FILES: tuple[tuple[str, str, str], ...] = (
    ("config.json", "Gemma4ForConditionalGeneration: text_config (60 layers, 5:1 sliding/full, k=v full layers, "
     "proportional partial rope), vision_config (27 layers, hidden 1152), audio_config null, multimodal token ids",
     "same fields, smaller numbers (6 layers, 2-layer vision tower); token ids moved to the top of its vocab"),
    ("model-*-of-*.safetensors", "bf16 weights: model.language_model.*, model.vision_tower.*, model.embed_vision.*",
     "the same key names and tensor roles in several shards (fp32 in smoke)"),
    ("model.safetensors.index.json", "weight_map key -> shard, metadata.total_size",
     "written by the same save_pretrained"),
    ("tokenizer.json", "GemmaTokenizer BPE with byte fallback, 262144 tokens, special tokens at fixed low ids",
     "the same pipeline and special ids, 1024 tokens trained on the shipped Verilog"),
    ("tokenizer_config.json", "GemmaTokenizer, add_bos_token false, padding left, named tokens "
     "(eot_token <turn|> ...), no chat_template key", "the same fields"),
    ("chat_template.jinja", "Gemma 4 turns, native system turn, <bos> from the template, empty thought channel in "
     "the 31B's generation prompt, tools", "ours, from the documented behaviour (no tools)"),
    ("generation_config.json", "eos [1, 106, 50], sampling defaults (temperature 1.0, top_p 0.95, top_k 64)",
     "the same"),
    ("processor_config.json", "Gemma4Processor with its image processor", "the same class and main fields"),
)


def checkpoint_files_table(model_dir):
    """The real checkpoint's files beside ``model_dir``'s: for each, what it holds and whether ``model_dir`` has it."""
    import pandas as pd

    model_dir = Path(model_dir)
    return pd.DataFrame([{"file": name, "in the real 31B-it": real, "this checkpoint has it": any(model_dir.glob(name)),
                          "the tiny replica": tiny} for name, real, tiny in CHECKPOINT_FILES])


def plot_layers(rows, bound: float = DEFAULT_REL_BOUND):
    """``parity.compare_layers``' relative hidden-state error after each layer (log scale), with the logits bound."""
    import matplotlib.pyplot as plt

    rel = [max(r["rel"], 1e-12) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.bar(range(len(rows)), rel, color="tab:blue")
    ax.axhline(bound, color="tab:red", linestyle="--", label=f"logits bound {bound:g}")
    ax.set_xticks(range(len(rows)), [r["after"] for r in rows], rotation=45, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("max |Δh| / max |h|")
    ax.set_title("tunix vs transformers, hidden state after each layer (fp32)")
    ax.legend()
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------------ 01: the mesh

def mesh_grid(mesh):
    """The device grid as a table: rows along the first axis, columns along the second, cells are device ids."""
    import pandas as pd

    grid = mesh.devices.reshape(mesh.devices.shape[0], -1)
    cols = [f"{mesh.axis_names[-1]}={j}" for j in range(grid.shape[1])]
    idx = [f"{mesh.axis_names[0]}={i}" for i in range(grid.shape[0])]
    return pd.DataFrame([[d.id for d in row] for row in grid], index=idx, columns=cols)


def example_sharding(mesh, spec=("fsdp", "tp"), shape=None):
    """A small array laid out over ``mesh`` with ``spec``; prints which device holds which block."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    shape = shape or tuple(4 * mesh.shape[a] if a else 4 for a in spec)
    x = jax.device_put(jnp.arange(int(jnp.prod(jnp.array(shape))), dtype=jnp.float32).reshape(shape),
                       NamedSharding(mesh, PartitionSpec(*spec)))
    jax.debug.visualize_array_sharding(x)
    return x


def tp_table(text_config: dict, tp_sizes=(1, 2, 4, 8)):
    """Which tensor-parallel sizes a model config allows, and why the others fail."""
    import pandas as pd

    rows = []
    for tp in tp_sizes:
        problems = gemma4.head_divisibility_problems(text_config, {"tp": tp})
        rows.append({"tp": tp, "valid": not problems, "why not": "; ".join(problems)})
    return pd.DataFrame(rows)


def trainer_batch_sharding(model, mesh, context: str = "trainer", seq_len: int = 16):
    """Run one tunix ``PeftTrainer`` step and return the sharding its batch had *inside* the jitted step.

    ``context``: "trainer" (``mesh.trainer_context``) or "set_mesh" (``jax.set_mesh`` alone, the trap). The model
    takes one tiny SGD step: pass a copy if you need it untouched.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from tunix.sft import peft_trainer

    seen = {}

    def loss_fn(model, input_tokens, input_mask, positions, attention_mask):
        jax.debug.inspect_array_sharding(input_tokens, callback=lambda s: seen.setdefault("sharding", s))
        logits, _ = model(input_tokens, positions, None, attention_mask)
        return jnp.mean(logits[..., 0] * input_mask)

    def model_input(x):
        tokens, positions, mask = causal_inputs(x.input_tokens)
        return dict(input_tokens=tokens, input_mask=x.input_mask, positions=positions, attention_mask=mask)

    batch_size = mesh.shape.get("fsdp", 1) * 2
    batch = peft_trainer.TrainingInput(input_tokens=np.full((batch_size, seq_len), 8, np.int32),
                                       input_mask=np.ones((batch_size, seq_len), np.float32))
    ctx = mesh_lib.trainer_context(mesh) if context == "trainer" else jax.set_mesh(mesh)
    with ctx:
        config = peft_trainer.TrainingConfig(eval_every_n_steps=1000, max_steps=1, pbar_description=None)
        trainer = peft_trainer.PeftTrainer(model, optax.sgd(1e-9), config)
        trainer.with_loss_fn(loss_fn).with_gen_model_input_fn(model_input).train([batch])
    return seen["sharding"]


def compare_trainer_contexts(model_dir, mesh):
    """The batch's sharding inside a tunix train step under ``jax.set_mesh`` alone vs ``mesh.trainer_context``."""
    import pandas as pd

    rows = []
    for context, how in (("set_mesh", "with jax.set_mesh(mesh):"), ("trainer", "with mesh_lib.trainer_context(mesh):")):
        sharding_ = trainer_batch_sharding(gemma4.load_model(model_dir, mesh), mesh, context=context)
        rows.append({"context": how, "batch spec inside the step": str(sharding_.spec),
                     "sharded over fsdp": "fsdp" in str(sharding_.spec)})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------------ 02: LoRA names

# The regex in the paper's public code (h2loop/gemma-tpu): tunix names, but no k_einsum.
PAPER_REGEX = ".*q_einsum|.*kv_einsum|.*attn_vec_einsum|.*gate_proj|.*down_proj|.*up_proj"
# What people write first: the HF names, straight into qwix.
HF_NAMES_REGEX = ".*q_proj|.*v_proj"


def target_table(text_config: dict, rank: int | None = None):
    """HF/PEFT target names -> tunix Gemma 4 modules, per layer kind, with shapes (from ``layout``'s rows)."""
    import pandas as pd

    groups: dict[tuple[str, bool], list] = {}
    for layer in layout.layers(text_config):
        groups.setdefault((layer.kind, layer.kv_shared), []).append(layer)
    order = [g for g in (("local", False), ("global", False), ("local", True), ("global", True)) if g in groups]
    r = rank if rank is not None else "r"
    rows = []
    for t in lora.HF_TARGETS:
        for kind, shared in order:
            layer = groups[(kind, shared)][0]
            row = layout.row_for(t, layer)
            if row is None:
                note = ("KV-shared layer: reads an earlier layer's K/V, no k/v projection runs here" if shared
                        else "no v_proj on global k=v layers (V is K): nothing to adapt, k_proj covers it")
            rows.append({"HF target": t, "layer kind": kind + (" (KV-shared)" if shared else ""),
                         "layers": len(groups[(kind, shared)]), "tunix module": row.module if row else "(none)",
                         "tunix weight": str(row.weight(layer)) if row else "-",
                         "HF weight [out, in]": str(row.hf_shape(layer)) if row else "-",
                         "LoRA A": str(row.a(layer, r)) if row else "-", "LoRA B": str(row.b(layer, r)) if row else "-",
                         "note": row.note if row else note})
    return pd.DataFrame(rows)


def lora_summary(report):
    """Per HF target of a ``lora.coverage`` report: modules that exist, how many got LoRA, and which layers were
    missed."""
    import pandas as pd

    rows = []
    for t, g in report.groupby("target", sort=False):
        exists = g[g["module"] != "(none)"]
        missed = exists[~exists["has LoRA"]]
        absent = g[g["module"] == "(none)"]
        why = {"KV-shared" if n.startswith("KV-shared") else "k=v" for n in absent["note"]}
        rows.append({"target": t, "modules": len(exists), "with LoRA": int(exists["has LoRA"].sum()),
                     "missed": (f"all {len(missed)} layers ({missed['module'].iloc[0]})"
                                if t in lora.MOE_WEIGHTS and len(missed) == len(exists) else
                                ", ".join(f"layer {r.layer} ({r.module})" for r in missed.itertuples()) or "-"),
                     "no module": f"{len(absent)} ({', '.join(sorted(why))})" if len(absent) else "-",
                     "LoRA params": int(g["LoRA params"].sum())})
    out = pd.DataFrame(rows)
    out.attrs.update(report.attrs)
    return out


def compare_regexes(model, regexes: dict[str, str], rank: int = 8, alpha: float = 16.0):
    """One row per named regex: attention/MLP modules with LoRA out of those that exist, LoRA params, misses."""
    import pandas as pd

    rows = []
    for name, rx in regexes.items():
        rep = lora.coverage_of_regex(model, rx, rank=rank, alpha=alpha)
        mods = rep[rep["module"] != "(none)"].drop_duplicates(["layer", "module"])
        missed = mods[~mods["has LoRA"]]
        by_module = missed.groupby("module")["layer"].apply(lambda s: ",".join(map(str, s)))
        rows.append({"regex": name, "pattern": rx, "modules with LoRA": int(mods["has LoRA"].sum()),
                     "modules": len(mods), "LoRA params": rep.attrs["lora_params"],
                     "qwix unused rules": len(rep.attrs["unused_rules"]),
                     "missed (module: layers)": "; ".join(f"{m}: {ls}" for m, ls in by_module.items()) or "-"})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------- 03: sharding

def one_period_config(text_config: dict) -> tuple[dict, int]:
    """The config cut to one sliding/global period (6 layers), and how many periods the full model has."""
    period = len(PATTERN)
    n = text_config["num_hidden_layers"]
    if n % period or list(text_config["layer_types"][:period]) * (n // period) != list(text_config["layer_types"]):
        raise ValueError(f"The layer pattern does not repeat every {period} layers; plan the full model instead.")
    cut = dict(text_config, num_hidden_layers=period, layer_types=list(text_config["layer_types"][:period]))
    return cut, n // period


def plan_lora_sharding(text_config: dict, mesh_shape: tuple[int, ...] = (1, 4), axes=("fsdp", "tp"),
                       rank: int = 64, alpha: float = 64.0, targets=None, dtype: str = "bfloat16",
                       expert_rank: int | None = None):
    """Per-device bytes of a LoRA model on a mesh, from abstract shapes only: ``(summary, audit, changes)``.

    One sliding/global period is built and scaled by the number of periods (a 60-layer abstract LoRA takes
    minutes). The summary has base and LoRA bytes as annotated, with every LoRA param replicated, and fixed.
    """
    import jax
    import pandas as pd

    cut, periods = one_period_config(text_config)
    base = sharding.model_from_config(cut, dtype=dtype, abstract=True)
    targets = targets or lora.HF_TARGETS
    model, _ = lora.apply_lora(base, targets=targets, rank=rank, alpha=alpha, abstract=True, expert_rank=expert_rank)
    mesh = jax.sharding.AbstractMesh(tuple(mesh_shape), tuple(axes))
    audited = sharding.audit(model, mesh)
    changes = pd.DataFrame(sharding.fix_shardings(model, mesh, apply=False))
    fixed = sharding.audit(model, mesh)
    before, after = pd.DataFrame(audited), pd.DataFrame(fixed)
    weight = before["path"].str.startswith("layers/").map({True: periods, False: 1})

    def total(df, kind, column="bytes_per_device"):
        return int((df[column] * weight)[df["kind"] == kind].sum())

    lora_full = int(((before["shape"].map(math.prod) * before["dtype"].map(lambda d: dtype_bits(d) // 8)) * weight)[
        before["kind"] == "LoRAParam"].sum())
    rows = [
        {"what": "base params", "as annotated": total(before, "Param"),
         "paper: LoRA replicated": total(before, "Param"), "after fix": total(after, "Param")},
        {"what": "LoRA params", "as annotated": total(before, "LoRAParam"), "paper: LoRA replicated": lora_full,
         "after fix": total(after, "LoRAParam")},
    ]
    summary = pd.DataFrame(rows).set_index("what")
    summary.loc["total"] = summary.sum()
    summary.attrs.update(mesh=dict(zip(axes, mesh_shape)), flags=len(sharding.flagged(audited)), periods=periods,
                         flags_after=len(sharding.flagged(fixed)))
    return summary, before, changes


def totals(audit, column: str = "bytes_per_device") -> dict[str, int]:
    """Bytes per device of ``sharding.audit``'s rows summed by kind (Param = frozen base, LoRAParam = trainable),
    and overall."""
    out: dict[str, int] = {}
    for r in audit:
        out[r.kind] = out.get(r.kind, 0) + getattr(r, column)
    return {**out, "total": sum(out.values())}


def bytes_table(before, after, column: str = "bytes_per_device_placed"):
    """Per-device bytes by kind of two audits (before and after a fix), in MiB."""
    import pandas as pd

    df = pd.DataFrame({"before": totals(before, column), "after": totals(after, column)}) / 2**20
    return df.rename(index={"Param": "base params (MiB/device)", "LoRAParam": "LoRA params (MiB/device)",
                            "total": "total (MiB/device)"}).round(3)


def forward_check(model, mesh, seq_len: int = 8):
    """Jit one forward pass of ``model`` on ``mesh`` (batch = the fsdp size); return the logits' shape and spec."""
    import jax.numpy as jnp
    from flax import nnx

    b = max(1, dict(mesh.shape).get("fsdp", 1))
    tokens, pos, mask = causal_inputs(jnp.ones((b, seq_len), jnp.int32))
    with mesh:
        logits = nnx.jit(lambda m: m(tokens, pos, None, mask)[0])(model)
    finite = bool(jnp.isfinite(logits).all())
    spec = tuple(logits.sharding.spec)
    return {"logits shape": tuple(logits.shape), "logits spec": str(spec), "finite": finite}


# ------------------------------------------------------------------------------------------------- 04: remat

def remat_trap(text_config: dict, rank: int = 8, alpha: float = 16.0, policy: str = "block"):
    """LoRA params that qwix creates with remat switched on before vs after LoRA, and what the guard
    (``remat.lora_then_remat``) says. Shapes only, so it is quick for the 31B too."""
    import pandas as pd
    import qwix
    from flax import nnx
    from tunix.models.gemma4 import model as gm

    policy = remat.check_policy(policy)
    if policy == "none":
        raise remat.UnknownPolicyError("The trap is about switching remat on: use 'block' or 'decoder', not 'none'.")
    def build(remat_first: bool):
        cfg = gemma4.to_tunix_config(text_config, remat=policy if remat_first else "none")
        model = gm.Gemma4(cfg, rngs=nnx.Rngs(0))
        provider = lora.make_provider(lora.HF_TARGETS, rank=rank, alpha=alpha)
        model = qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(0), **model.get_model_input())  # no guard
        if not remat_first:
            remat.set_remat(model, policy)
        return model

    wrong = nnx.eval_shape(lambda: build(True))
    right = nnx.eval_shape(lambda: build(False))
    try:
        remat.lora_then_remat(wrong, rank, alpha, policy)
        guard = "accepted (unexpected)"
    except remat.RematOrderError as e:
        guard = f"refused: {str(e).split('. ')[0]}."
    return pd.DataFrame([
        {"order": f"remat={policy.upper()}, then qwix LoRA", "LoRA params": remat.count_lora_params(wrong),
         "remat_config": remat.remat_config_of(wrong).upper(), "remat.lora_then_remat": guard},
        {"order": f"qwix LoRA, then remat={policy.upper()}", "LoRA params": remat.count_lora_params(right),
         "remat_config": remat.remat_config_of(right).upper(), "remat.lora_then_remat": "this is what it does"},
    ])
