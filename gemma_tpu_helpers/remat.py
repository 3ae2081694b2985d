"""Gradient checkpointing (rematerialisation) for the Gemma 4 LoRA train step, measured instead of guessed.

Two families of policies, one train step:

* **tunix's own switch**, ``model.config.remat_config`` = ``RematConfig.BLOCK`` (attention and MLP blocks are
  recomputed separately) or ``RematConfig.DECODER`` (each whole decoder layer is recomputed);
* **``jax.checkpoint`` policies**, applied by wrapping each decoder-layer call of *our own* forward loop in
  ``nnx.remat(policy=...)``: ``dots`` saves every matmul output, ``dots_no_batch`` saves only the weight matmuls
  (``dots_with_no_batch_dims_saveable``: the attention-score einsums, which have batch dims, are recomputed).

The Gemma 4 trap: setting ``remat_config`` *before* ``qwix.apply_lora_to_model`` yields a model with **no LoRA
params** (qwix creates them while tracing the model, and tunix's ``nnx.remat(..., graph_updates=False)`` drops
variables created inside it). :func:`lora_then_remat` applies LoRA first and refuses the wrong order.

The train step (:func:`make_train_step`) differentiates a next-token cross-entropy with integer labels (no
one-hot over the vocabulary) with respect to the ``nnx.LoRAParam`` leaves only, and applies AdamW to them.
The same step is compiled for the tiny model here and, ahead of time, for the real 31B in :mod:`plan`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from . import lora

# name -> (kind, description). kind "tunix": model.config.remat_config; kind "jax": nnx.remat(policy=...) per layer.
POLICIES: dict[str, tuple[str, str]] = {
    "none": ("tunix", "no rematerialisation: every activation is kept for the backward pass"),
    "block": ("tunix", "tunix RematConfig.BLOCK: attention and MLP blocks each recomputed in the backward pass"),
    "decoder": ("tunix", "tunix RematConfig.DECODER: each decoder layer recomputed; only its input is kept"),
    "dots": ("jax", "nnx.remat per layer with jax.checkpoint_policies.checkpoint_dots: keep every matmul output"),
    "dots_no_batch": ("jax", "nnx.remat per layer with dots_with_no_batch_dims_saveable: keep weight-matmul outputs, "
                             "recompute attention scores"),
}

# The qwix regex for every LoRA target, from the layout table (k_einsum: the k=v global layers; see notebook 02).
LORA_MODULE_PATH = lora.regex_for(lora.HF_TARGETS)


class UnknownPolicyError(ValueError):
    pass


class RematOrderError(ValueError):
    """LoRA applied to a model whose remat is already on: qwix would create no LoRA params."""


def check_policy(policy: str) -> str:
    name = str(policy).lower()
    if name not in POLICIES:
        raise UnknownPolicyError(f"Unknown remat policy {policy!r}. Valid policies: {', '.join(POLICIES)}.")
    return name


def jax_policy(policy: str) -> Callable | None:
    """The ``jax.checkpoint`` policy of a ``jax``-kind policy name (None for tunix's own switch)."""
    import jax

    policy = check_policy(policy)
    return {
        "dots": jax.checkpoint_policies.checkpoint_dots,
        "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    }.get(policy)


# ---------------------------------------------------------------------------------------------- LoRA and order


def count_lora_params(model) -> int:
    """Number of LoRA parameters (elements of every ``nnx.LoRAParam``) in a model (works on abstract models)."""
    import math

    import jax
    from flax import nnx

    leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.LoRAParam))
    return sum(math.prod(x.shape) for x in leaves)


def _configs(model) -> list:
    """Every distinct tunix ModelConfig object referenced by the model's modules."""
    seen, out = set(), []
    for _, module in model.iter_modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "remat_config") and id(cfg) not in seen:
            seen.add(id(cfg))
            out.append(cfg)
    return out


def remat_config_of(model) -> str:
    """The tunix remat setting of a model, lower case ("none", "block", "decoder")."""
    return model.config.remat_config.name.lower()


def _lora_provider(rank: int, alpha: float):
    return lora.make_provider(lora.HF_TARGETS, rank=rank, alpha=alpha)


def _apply_lora(model, rank: int, alpha: float, seed: int = 0, jit: bool = True):
    """qwix LoRA on the tunix Gemma 4 module names. One place, to be swapped for ``lora.apply_lora``.

    qwix runs the model once to create the LoRA params; under ``nnx.jit`` that is one compiled call instead of
    thousands of eager ops (3 s instead of 20 s for the tiny model on CPU). ``jit=False`` inside ``nnx.eval_shape``.
    """
    import qwix
    from flax import nnx

    def apply(m):
        return qwix.apply_lora_to_model(m, _lora_provider(rank, alpha), rngs=nnx.Rngs(seed), **m.get_model_input())

    return nnx.jit(apply)(model) if jit else apply(model)


def _set_tunix_remat(model, name: str) -> None:
    from tunix.models.gemma4 import model as gm

    value = getattr(gm.RematConfig, name.upper())
    for cfg in _configs(model):
        cfg.remat_config = value


def set_remat(model, policy: str, require_lora: bool = True) -> str:
    """Switch a model's remat policy in place (LoRA must already be applied); returns the policy name.

    ``jax``-kind policies leave tunix's switch off: :func:`make_train_step` wraps each layer instead.
    """
    policy = check_policy(policy)
    if require_lora and count_lora_params(model) == 0:
        raise RematOrderError(
            "This model has no LoRA params. Apply LoRA first (remat.lora_then_remat does both in the right "
            "order), then switch remat on."
        )
    _set_tunix_remat(model, policy if POLICIES[policy][0] == "tunix" else "none")
    return policy


def lora_then_remat(model, rank: int, alpha: float, policy: str = "none", seed: int = 0):
    """Apply LoRA, then the remat policy: the only order that works for Gemma 4. Returns the LoRA model.

    Raises :class:`RematOrderError` if the model already has remat on (qwix would then create no LoRA params),
    and if LoRA matched nothing.
    """
    policy = check_policy(policy)
    current = remat_config_of(model)
    if current != "none":
        raise RematOrderError(
            f"remat_config is already {current.upper()} on this model. With remat on, qwix.apply_lora_to_model "
            f"creates no LoRA params on Gemma 4 (the LoRA variables made inside tunix's nnx.remat are dropped). "
            f"Load the model with remat='none', apply LoRA, then set remat (remat.lora_then_remat(model, rank, "
            f"alpha, policy={current!r}) does it in this order)."
        )
    model = _apply_lora(model, rank, alpha, seed=seed)
    if count_lora_params(model) == 0:
        raise RematOrderError(f"LoRA created no params (module_path {LORA_MODULE_PATH!r} matched nothing).")
    set_remat(model, policy)
    return model


def demonstrate_trap(text_config: dict, rank: int = 8, alpha: float = 16.0, policy: str = "block"):
    """LoRA params that qwix creates with remat switched on before vs after LoRA, and what the guard says.

    Built abstractly (``nnx.eval_shape``: shapes only, no weights, no compile), so it is quick for the tiny model
    and the 31B alike; qwix traces the model the same way as on real weights.
    """
    import pandas as pd
    from flax import nnx
    from tunix.models.gemma4 import model as gm

    from .gemma4 import to_tunix_config

    policy = check_policy(policy)
    if POLICIES[policy][0] != "tunix" or policy == "none":
        raise UnknownPolicyError(f"The trap is about tunix's remat_config: use 'block' or 'decoder', not {policy!r}.")

    def build(remat_first: bool):
        cfg = to_tunix_config(text_config, remat=policy if remat_first else "none")
        model = gm.Gemma4(cfg, rngs=nnx.Rngs(0))
        return _apply_lora(model, rank, alpha, jit=False) if remat_first else lora_then_remat_abstract(model)

    def lora_then_remat_abstract(model):
        model = _apply_lora(model, rank, alpha, jit=False)
        set_remat(model, policy)
        return model

    wrong = nnx.eval_shape(lambda: build(True))
    right = nnx.eval_shape(lambda: build(False))
    try:
        lora_then_remat(wrong, rank, alpha, policy)
        guard = "accepted (unexpected)"
    except RematOrderError as e:
        guard = f"refused: {str(e).split('. ')[0]}."
    return pd.DataFrame([
        {"order": f"remat={policy.upper()}, then qwix LoRA", "LoRA params": count_lora_params(wrong),
         "remat_config": remat_config_of(wrong).upper(), "remat.lora_then_remat": guard},
        {"order": f"qwix LoRA, then remat={policy.upper()}", "LoRA params": count_lora_params(right),
         "remat_config": remat_config_of(right).upper(), "remat.lora_then_remat": "this is what it does"},
    ])


def cached_json(path, compute: Callable[[], object]):
    """``compute()`` once, its JSON in ``path`` reused on rerun; returns (value, cached?)."""
    import json
    from pathlib import Path

    from .course import write_atomic

    path = Path(path)
    if path.is_file():
        return json.loads(path.read_text()), True
    value = compute()
    write_atomic(path, json.dumps(value, indent=1, default=str))
    return value, False


def cached_compare(run_dir, **kwargs):
    """:func:`compare_policies`, cached as JSON in ``run_dir/remat/`` (keyed by its arguments)."""
    import hashlib
    import json
    from pathlib import Path

    import pandas as pd

    key_args = {k: (str(v) if k in ("model_dir", "mesh") else v) for k, v in sorted(kwargs.items())}
    key_args["mesh"] = str(dict(zip(kwargs["mesh"].axis_names, kwargs["mesh"].devices.shape)))
    key = hashlib.sha1(json.dumps(key_args, default=str).encode()).hexdigest()[:10]

    def compute():
        df = compare_policies(**kwargs)
        return {"rows": df.to_dict(orient="records"), "attrs": df.attrs}

    value, cached = cached_json(Path(run_dir) / "remat" / f"compare_{key}.json", compute)
    df = pd.DataFrame(value["rows"])
    df.attrs.update(value["attrs"], cached=cached)
    return df


# ---------------------------------------------------------------------------------------------- the train step


def causal_inputs(tokens):
    """positions (B, T) and a causal attention mask (B, T, T) for unpacked rows (tunix applies the window)."""
    import jax.numpy as jnp

    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), dtype=jnp.bool_))[None], (b, t, t))
    return positions, mask


def _decoder_loop(model, tokens, policy: str, act_sharding, logits_sharding=None):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    cfg = model.config
    positions, mask = causal_inputs(tokens)

    def constrain(x):
        return x if act_sharding is None else jax.lax.with_sharding_constraint(x, act_sharding)

    def layer_call(layer, x, positions, mask, per_layer_input, kv_shared):
        _, x, kvs = layer(x, positions, None, mask, per_layer_input=per_layer_input, kv_shared_cache=kv_shared)
        return x, kvs

    if POLICIES[policy][0] == "jax":
        layer_call = nnx.remat(layer_call, policy=jax_policy(policy), graph_updates=False)

    # tunix's own forward (Gemma4.__call__, prefill path): E2B/E4B add per-layer inputs, and their KV-shared
    # layers read the K/V an earlier layer computed in this same pass.
    x = constrain(model.embedder.encode(tokens))
    per_layer = model.embedder.encode_per_layer_input(x, tokens) if cfg.per_layer_input_dim > 0 else None
    sharing = getattr(model, "kv_cache_sharing_patterns", None) or list(range(len(model.layers)))
    kvs_of = {}
    for i, layer in enumerate(model.layers):
        kv_shared = None
        if sharing[i] != i:
            k, v = kvs_of[sharing[i]]
            kv_shared = {"k": k, "v": v}
        x, kvs = layer_call(layer, x, positions, mask, None if per_layer is None else per_layer[:, :, i, :],
                            kv_shared)
        x = constrain(x)
        if i in sharing[i + 1:]:
            kvs_of[i] = kvs
    x = model.final_norm(x)
    logits = model.embedder.decode(x)
    if logits_sharding is not None:
        logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
    logits = logits.astype(jnp.float32)
    if cfg.final_logit_softcap is not None:
        logits = jnp.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
    return logits


def _loop_class():
    from flax import nnx

    class DecoderLoop(nnx.Module):
        """Holds a LoRA model; its ``__call__`` is the decoder loop (qwix intercepts it, so LoRA is active)."""

        def __init__(self, model, policy: str, act_sharding=None, logits_sharding=None):
            self.model = model
            self.policy = policy
            self.act_sharding = act_sharding
            self.logits_sharding = logits_sharding

        def __call__(self, tokens):
            return _decoder_loop(self.model, tokens, self.policy, self.act_sharding, self.logits_sharding)

    return DecoderLoop


def decoder_loop(model, policy: str, rank: int, alpha: float, act_sharding=None, logits_sharding=None):
    """A module whose call is the training forward pass (no KV cache) of a LoRA ``model``, layer by layer.

    It computes what ``Gemma4.__call__`` computes without a cache (checked in the tests), with the decoder loop
    written out so a ``jax``-kind policy can wrap each layer call in ``nnx.remat(policy=...)``. tunix's own switch
    acts inside each layer call. qwix activates LoRA only inside the method it intercepted (``Gemma4.__call__``),
    so the loop module is intercepted with the same LoRA rules (``rank``, ``alpha``); it reuses the model's LoRA
    params, creating none. ``act_sharding`` (a NamedSharding) constrains the residual stream between layers:
    tunix skips its own activation constraints when ``jax.devices()`` is a CPU, as in an AOT compile on a host.
    """
    import qwix

    policy = check_policy(policy)
    n_before = count_lora_params(model)
    loop = qwix.apply_lora_to_model(_loop_class()(model, policy, act_sharding, logits_sharding),
                                    _lora_provider(rank, alpha),
                                    skip_nnx_init=True, rngs=None)
    if count_lora_params(loop) != n_before:
        raise RematOrderError("the decoder loop's LoRA params differ from the model's")
    return loop


def next_token_loss(logits, tokens, loss_mask=None):
    """Mean next-token cross-entropy with integer labels (``train.token_nll``: no one-hot, no gather)."""
    import jax.numpy as jnp

    from .train import token_nll

    nll = token_nll(logits[:, :-1], tokens[:, 1:])
    weights = jnp.ones_like(nll) if loss_mask is None else loss_mask[:, 1:].astype(nll.dtype)
    return (nll * weights).sum() / jnp.maximum(weights.sum(), 1.0)


@dataclasses.dataclass
class TrainStep:
    """A jitted LoRA train step: ``step(lora, opt_state, frozen, tokens) -> (lora, opt_state, loss)``."""

    module: object  # the decoder-loop module (a LoRA-intercepted copy of the model)
    graphdef: object
    fn: Callable  # the jitted function
    tx: object  # the optax transformation
    policy: str

    def init(self):
        """(lora, opt_state, frozen) state pytrees (concrete or abstract, as the model was)."""
        import jax
        from flax import nnx

        _, lora, frozen = nnx.split(self.module, nnx.LoRAParam, ...)
        leaves = jax.tree_util.tree_leaves(lora)
        opt = (jax.eval_shape(self.tx.init, lora) if leaves and isinstance(leaves[0], jax.ShapeDtypeStruct)
               else self.tx.init(lora))
        return lora, opt, frozen

    def __call__(self, lora, opt_state, frozen, tokens):
        return self.fn(lora, opt_state, frozen, tokens)


def make_train_step(model, policy: str, rank: int, alpha: float, learning_rate: float = 1e-3,
                    weight_decay: float = 0.0, act_sharding=None, logits_sharding=None, donate: bool = True,
                    jit_kwargs=None) -> TrainStep:
    """The jitted LoRA train step of a LoRA ``model`` (concrete or abstract) under a remat policy.

    AdamW on the ``nnx.LoRAParam`` leaves only; the base weights are a frozen argument. The policy is switched
    on the model (:func:`set_remat`), so build and compile one step before switching the model to another.
    """
    import jax
    import optax
    from flax import nnx

    policy = set_remat(model, policy)
    module = decoder_loop(model, policy, rank, alpha, act_sharding, logits_sharding)
    graphdef, _, _ = nnx.split(module, nnx.LoRAParam, ...)
    tx = optax.adamw(learning_rate, weight_decay=weight_decay)

    def loss_fn(lora, frozen, tokens):
        return next_token_loss(nnx.merge(graphdef, lora, frozen)(tokens), tokens)

    def step(lora, opt_state, frozen, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(lora, frozen, tokens)
        updates, opt_state = tx.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state, loss

    fn = jax.jit(step, donate_argnums=(0, 1) if donate else (), **(jit_kwargs or {}))
    return TrainStep(module=module, graphdef=graphdef, fn=fn, tx=tx, policy=policy)


def forward(model, tokens, policy: str, rank: int, alpha: float):
    """Logits of the decoder loop (eager, for checks): equal to ``model(tokens, positions, None, mask)``."""
    return decoder_loop(model, policy, rank, alpha)(tokens)


def memory_figures(compiled) -> dict:
    """XLA's per-device memory analysis of a compiled executable, in bytes."""
    m = compiled.memory_analysis()
    args, out, temp = m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes
    alias = getattr(m, "alias_size_in_bytes", 0)
    code = getattr(m, "generated_code_size_in_bytes", 0)
    return {"argument_bytes": args, "output_bytes": out, "temp_bytes": temp, "alias_bytes": alias,
            "code_bytes": code, "peak_bytes": args + out - alias + temp}


def count_remat_regions(step: TrainStep, *args) -> int:
    """How many rematerialised regions (``checkpoint``/``remat`` equations) the step's jaxpr holds."""
    import jax

    jaxpr = jax.make_jaxpr(step.fn)(*args)
    text = str(jaxpr)
    return text.count("checkpoint[") + text.count("remat[") + text.count("remat2[")


def _tpu_plan_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


def compare_policies(model_dir, mesh, policies=tuple(POLICIES), rank: int = 8, alpha: float = 16.0,
                     batch: int = 2, seq_len: int = 128, steps: int = 3, dtype: str = "float32",
                     learning_rate: float = 1e-3, seed: int = 0, tpu_profile: str | None = "v5p-8",
                     tpu_seq_len: int | None = None):
    """For each remat policy, the jitted LoRA train step on the model in ``model_dir`` (LoRA first, then remat):

    * ``step ms``, ``compile s``, the losses and XLA's CPU memory analysis, from running it on ``mesh``;
    * ``TPU temp MiB`` / ``TPU peak MiB``: the same step compiled ahead of time for ``tpu_profile``'s topology
      (bf16, on that profile's mesh, at ``tpu_seq_len``, default ``seq_len``: activations dominate memory only
      at training lengths; needs libtpu, skipped without it).
      XLA:CPU's buffer assignment does not
      reflect rematerialisation (its temp bytes stay flat across policies, even for a plain MLP), so the memory
      effect is read from the TPU compile.

    Every policy starts from the same LoRA weights and batch: the losses agree (remat changes memory and time,
    not the math).
    """
    import concurrent.futures

    import jax
    import numpy as np
    import pandas as pd

    from . import plan, profiles
    from .gemma4 import load_model, read_text_config

    policies = [check_policy(p) for p in policies]
    model = lora_then_remat(load_model(model_dir, mesh, dtype=dtype), rank, alpha, "none", seed=seed)
    vocab = model.config.num_embed
    tokens = jax.device_put(np.random.default_rng(seed).integers(3, vocab, (batch, seq_len), dtype=np.int32))
    tpu = profiles.get_profile(tpu_profile) if tpu_profile and _tpu_plan_available() else None
    text = read_text_config(model_dir)
    rows = []
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    # The TPU compiles run in a background thread while this one compiles for the CPU mesh: XLA compiles release
    # the GIL, so on a 2-core laptop they overlap (qwix's interception is per thread). The CPU steps are timed
    # only after every compile has finished.
    compiled = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        aot = {policy: pool.submit(plan.compile_train_step, tpu, policy, tpu_seq_len or seq_len,
                                   text["num_hidden_layers"], text_config=text, batch=batch, rank=rank,
                                   alpha=alpha, dtype="bfloat16")
               for policy in (policies if tpu is not None else ())}
        for policy in policies:
            # LoRA params and optimizer state replicated in and out (as in the AOT plan), so the compiled step
            # can be called again on its own outputs.
            step = make_train_step(model, policy, rank, alpha, learning_rate=learning_rate, donate=False,
                                   jit_kwargs={"out_shardings": replicated})
            lora, opt_state, frozen = step.init()
            lora, opt_state = jax.device_put((lora, opt_state), replicated)
            t0 = time.perf_counter()
            compiled[policy] = (step.fn.lower(lora, opt_state, frozen, tokens).compile(), time.perf_counter() - t0,
                                lora, opt_state, frozen)
        aot = {policy: future.result() for policy, future in aot.items()}
    for policy in policies:
        fn, compile_s, lora, opt_state, frozen = compiled.pop(policy)
        mem = memory_figures(fn)
        lora, opt_state, loss0 = fn(lora, opt_state, frozen, tokens)  # warm-up step
        losses = [float(jax.block_until_ready(loss0))]
        t0 = time.perf_counter()
        for _ in range(steps):
            lora, opt_state, loss = fn(lora, opt_state, frozen, tokens)
            losses.append(float(jax.block_until_ready(loss)))
        step_ms = 1000 * (time.perf_counter() - t0) / max(steps, 1)
        row = {"policy": policy, "how": POLICIES[policy][0], "step ms": step_ms, "compile s": compile_s,
               "first loss": losses[0], "last loss": losses[-1], "CPU temp MiB": mem["temp_bytes"] / 2**20}
        if policy in aot:
            row.update({"TPU temp MiB": aot[policy]["temp_bytes"] / 2**20,
                        "TPU peak MiB": aot[policy]["peak_bytes"] / 2**20, "TPU compile s": aot[policy]["compile_s"]})
        rows.append(row)
    set_remat(model, "none")
    df = pd.DataFrame(rows)
    if tpu is not None and "none" in policies:
        df["TPU temp vs none"] = df["TPU temp MiB"] / float(df.loc[df.policy == "none", "TPU temp MiB"].iloc[0])
    df.attrs["tpu_profile"] = tpu.name if tpu is not None else None
    df.attrs["shape"] = {"batch": batch, "seq_len": seq_len, "tpu_seq_len": tpu_seq_len or seq_len, "rank": rank}
    return df


def plot_policies(df, title: str = "Remat policies: LoRA train step"):
    """Bar charts of temp memory and step time per policy; returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    colors = ["tab:blue" if h == "tunix" else "tab:orange" for h in df["how"]]
    mem = "TPU temp MiB" if "TPU temp MiB" in df else "CPU temp MiB"
    where = f"AOT for {df.attrs.get('tpu_profile')}" if mem.startswith("TPU") else "XLA:CPU"
    ax1.bar(df["policy"], df[mem], color=colors)
    ax1.set_ylabel(f"temp memory, MiB per chip ({where})")
    ax2.bar(df["policy"], df["step ms"], color=colors)
    ax2.set_ylabel("step time (ms)")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(f"{title} (blue: tunix remat_config, orange: nnx.remat policy)")
    fig.tight_layout()
    return fig
