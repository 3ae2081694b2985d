"""layout.py, the one tunix <-> HF LoRA table, against what qwix creates on tunix's Gemma 4 and what PEFT creates on
transformers' Gemma 4: shapes, counts, the qwix regex's matches and the PEFT keys.

The tunix side is built abstractly (``nnx.eval_shape``: shapes only, no weights), on the real 31B / E2B / E4B
configs (``gemma4.TEXT_CONFIGS``) cut to whole sliding/global periods with their KV-shared tail kept; the full
configs run under ``-m slow`` (about 6 minutes on a 2-core CPU).
"""

import math
import re

import pytest

from gemma_tpu_helpers.course.training import equivalence
from gemma_tpu_helpers.fixes.export import peft_export
from gemma_tpu_helpers.fixes.model import gemma4, hf_checkpoint, layout
from gemma_tpu_helpers.fixes.train import lora

RANK = 4
TARGET_LISTS = [(t,) for t in layout.TARGETS] + [layout.TARGETS, equivalence.PARITY_TARGETS, ("q_proj", "v_proj"),
                                                 ("k_proj", "v_proj"), ("v_proj", "o_proj", "down_proj")]


def _cut(c: dict) -> dict:
    """The config cut to one period (31B) or two periods, the second KV-shared (E2B/E4B): every kind of layer the
    full model has, at its real widths."""
    pattern = list(hf_checkpoint.PATTERN)
    period = len(pattern) if c["layer_types"][:6] == pattern else c["layer_types"].index("full_attention") + 1
    shared = period if c.get("num_kv_shared_layers") else 0
    n = period + shared
    return dict(c, num_hidden_layers=n, layer_types=list(c["layer_types"][:n]), num_kv_shared_layers=shared)


def _abstract_lora_model(text_config: dict, targets=layout.TARGETS, rank: int = RANK):
    """tunix Gemma 4 + qwix LoRA (our provider for ``targets``), as shapes only, like model_views.remat_trap."""
    import qwix
    from flax import nnx
    from tunix.models.gemma4 import model as gm

    def build():
        model = gm.Gemma4(gemma4.to_tunix_config(text_config, dtype="bfloat16"), rngs=nnx.Rngs(0))
        return qwix.apply_lora_to_model(model, lora.make_provider(targets, rank=rank), rngs=nnx.Rngs(0),
                                        **model.get_model_input())

    return nnx.eval_shape(build)


def _lora_params(model) -> dict[str, tuple]:
    from flax import nnx

    return {"/".join(map(str, p)): tuple(v.value.shape)
            for p, v in nnx.iter_graph(model) if isinstance(v, nnx.LoRAParam)}


def _base_params(model) -> dict[str, tuple]:
    from flax import nnx

    return {"/".join(map(str, p)): tuple(v.value.shape) for p, v in nnx.iter_graph(model)
            if isinstance(v, nnx.Param) and not isinstance(v, nnx.LoRAParam)}


CUT = {name: _cut(c) for name, c in gemma4.TEXT_CONFIGS.items()}


@pytest.fixture(scope="module", params=sorted(CUT))
def abstract(request):
    c = CUT[request.param]
    return request.param, c, _abstract_lora_model(c)


# ------------------------------------------------------------------------------------------------ the table itself


def test_cut_configs_keep_every_layer_kind():
    for name, c in CUT.items():
        kinds = {(L.kind, L.kv_shared, L.k_eq_v, L.f) for L in layout.layers(c)}
        if name in ("31b", "26b-a4b"):  # no KV-shared layers; k=v global layers
            assert {(k, s, e) for k, s, e, _ in kinds} == {("local", False, False), ("global", False, True)}
        else:
            assert {(k, s) for k, s, _, _ in kinds} == {(k, s) for k in ("local", "global") for s in (False, True)}
            widths = {f for _, s, _, f in kinds if s}
            assert widths == {c["intermediate_size"] * (2 if c["use_double_wide_mlp"] else 1)}


def test_at_most_one_row_per_target_and_layer_and_one_module_per_param_name():
    for c in CUT.values():
        for layer in layout.layers(c):
            rows = layout.rows_for(layer)
            assert len({r.target for r in rows}) == len(rows)
    for module in layout.MODULES:
        rows = layout.rows_of_module(module)
        assert len({(r.param, r.weight, r.a, r.b) for r in rows}) <= len(rows) and len({r.param for r in rows}) == 1
    assert layout.TARGETS == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_unknown_targets_and_paths():
    with pytest.raises(layout.LayoutError, match="q_einsum"):
        layout.check_targets(["q_proj", "q_einsum"])
    assert layout.parse_lora_path("layers/12/attn/kv_einsum/w_lora_b") == (12, "attn/kv_einsum", "w", "b")
    assert layout.parse_lora_path("layers/1/attn/qkv_einsum/w_lora_a") is None
    assert layout.parse_lora_path("layers/1/mlp/gate_proj/kernel") is None


# ------------------------------------------------------------------------------------------------ against qwix / tunix


def test_shapes_and_count_are_the_lora_params_qwix_creates(abstract):
    name, c, model = abstract
    got = _lora_params(model)
    assert got == layout.lora_shapes(c, RANK)
    assert sum(math.prod(s) for s in got.values()) == layout.lora_param_count(c, RANK)
    if c.get("num_kv_shared_layers"):  # E2B/E4B: qwix gave the never-called kv_einsum of the KV-shared layers
        # no LoRA, as the table says
        shared = [L.index for L in layout.layers(c) if L.kv_shared]
        assert shared and not [p for p in got if p.split("/")[1] in map(str, shared) and "kv_einsum" in p]


def test_tunix_weights_and_hf_shapes_are_the_tables(abstract):
    """The base weight each row names exists with the row's shape; ΔW = A2·B2 has the HF weight's [out, in]."""
    import numpy as np

    _, c, model = abstract
    base = _base_params(model)
    for layer in layout.layers(c):
        for row in layout.rows_for(layer):
            assert base[f"layers/{layer.index}/{row.module}/{row.param}"] == row.weight(layer), (layer, row.target)
            a, b = np.zeros(row.a(layer, RANK)), np.zeros(row.b(layer, RANK))
            a2, b2 = layout.delta_factors(row, a, b, RANK)
            assert (b2.shape[1], a2.shape[0]) == row.hf_shape(layer) and a2.shape[1] == b2.shape[0] == RANK


@pytest.mark.parametrize("targets", TARGET_LISTS, ids="+".join)
def test_qwix_regex_matches_exactly_the_tables_modules(abstract, targets):
    """The regex full-matches the modules the table gives LoRA, plus only the KV-shared layers' kv_einsum, which tunix
    keeps but never calls (so qwix gives it no LoRA: the test above)."""
    _, c, model = abstract
    regex = layout.qwix_regex(targets)
    matched = {"/".join(map(str, p)) for p, _ in model.iter_modules() if re.fullmatch(regex, "/".join(map(str, p)))}
    table = set(layout.modules(c, targets))
    uncalled = {f"layers/{L.index}/attn/kv_einsum" for L in layout.layers(c)
                if L.kv_shared and {"k_proj", "v_proj"} & set(targets)}
    assert matched - uncalled == table and matched >= uncalled
    assert lora.regex_for(targets) == regex


def test_a_subset_gets_the_tables_shapes_from_qwix():
    """v_proj alone adapts the whole kv_einsum (k too) on unshared local layers, and nothing on k=v or shared layers."""
    targets = ("v_proj", "o_proj", "down_proj")
    for name in ("31b", "e2b"):
        c = CUT[name]
        got = _lora_params(_abstract_lora_model(c, targets))
        assert got == layout.lora_shapes(c, RANK, targets)
        assert sum(math.prod(s) for s in got.values()) == layout.lora_param_count(c, RANK, targets)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(gemma4.TEXT_CONFIGS))
def test_full_real_configs(name):
    c = gemma4.TEXT_CONFIGS[name]
    got = _lora_params(_abstract_lora_model(c))
    assert got == layout.lora_shapes(c, RANK)
    assert sum(math.prod(s) for s in got.values()) == layout.lora_param_count(c, RANK)


# ------------------------------------------------------------------------------------------------ against PEFT


@pytest.mark.parametrize("targets", [layout.TARGETS, ("v_proj", "o_proj"), ("k_proj", "gate_proj")], ids="+".join)
@pytest.mark.parametrize("which", ["31b", "e2b"])
def test_peft_keys_and_shapes_are_the_tables(targets, which, tiny_dir, e2b_dir):
    """PEFT on transformers' Gemma 4 (multimodal layout, with its vision tower) for lora.peft_target_modules: the
    same keys as the table's, in a live model (adapter ``default``) and in a saved adapter, with A (r, in),
    B (out, r)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from gemma_tpu_helpers.fixes.model import parity

    model_dir = tiny_dir if which == "31b" else e2b_dir
    text = gemma4.read_text_config(model_dir)
    peft_model = get_peft_model(parity.load_hf(model_dir), LoraConfig(
        r=RANK, lora_alpha=2 * RANK, target_modules=lora.peft_target_modules(targets)))
    live = {k: tuple(v.shape) for k, v in peft_model.state_dict().items() if ".lora_" in k}
    saved = set(get_peft_model_state_dict(peft_model))
    assert set(live) == set(peft_export.peft_keys(text, targets, adapter="default"))
    assert saved == set(peft_export.peft_keys(text, targets))
    for layer in layout.layers(text):
        for row in layout.rows_for(layer, targets):
            out, inp = row.hf_shape(layer)
            assert live[peft_export.peft_key(layer.index, row, "A", "default")] == (RANK, inp)
            assert live[peft_export.peft_key(layer.index, row, "B", "default")] == (out, RANK)


@pytest.mark.parametrize("variant", ["31b", "e2b"])
def test_targeted_weights_are_the_checkpoints_own_tensors(variant, tiny_dir, e2b_dir):
    """Every weight the table says LoRA adapts is in the replica's files at that [out, in] shape (k=v layers, KV-shared
    layers and E2B's doubled MLP included), and it leaves out only what no forward pass reads: the k/v projections
    the real E files still carry on KV-shared layers."""
    from gemma_tpu_helpers.fixes.export import safetensors_io

    base = tiny_dir if variant == "31b" else e2b_dir
    text = gemma4.read_text_config(base)
    _, _, entries = safetensors_io.base_layout(base)
    got = layout.targeted_weights(text)
    assert got and all(tuple(entries[k]["shape"]) == shape for k, shape in got.items())
    shared = gemma4.kv_shared_layers(text)
    unread = {k for k in entries
              if (m := re.match(rf"{re.escape(gemma4.KEY_PREFIX)}layers\.(\d+)\.self_attn\.[kv]_proj\.", k))
              and int(m.group(1)) in shared}
    assert bool(unread) == (variant == "e2b")
    projections = {k for k in entries
                   if re.match(rf"{re.escape(gemma4.KEY_PREFIX)}layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$", k)}
    assert projections - unread == set(got)  # all seven targets: nothing missed, nothing made up
