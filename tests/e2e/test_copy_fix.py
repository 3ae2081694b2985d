"""Copy one fix: for notebooks 00-09, the files of the notebook's "Copy into your project" line go into an empty
folder as a package of another name (fix00 ... fix09), each file in its stage folder, and the notebook's documented
calls run there, in a process where ``gemma_tpu_helpers`` cannot be imported. They must give what the same calls
give in the package.

A fix takes plain arguments: where one takes a model (the step, the sharding audit), the model is made by the copies
a user would have made it with (notebook 00's ``gemma4.load_model``, notebook 02's ``lora.apply_lora``).

One script runs every notebook's calls: once on ``gemma_tpu_helpers.fixes`` (the reference) and once on the copies.
A file missing from a copy line fails the copy run with its ImportError; a result that differs fails the comparison.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gemma_tpu_helpers.course.config import paths
from gemma_tpu_helpers.fixes.eval import eval_problems
from gemma_tpu_helpers.fixes.model import gemma4, layout
from gemma_tpu_helpers.fixes.train import lora_checkpoint, multihost
from support import copy_lines, path_of

NOTEBOOKS = [f"0{i}" for i in range(10)]

# The calls each notebook's "Use it in your project" section shows, on plain arguments: the tiny replica's files, a
# LoRA checkpoint, a shipped problem. `fix(nb, name)` imports module `name` of notebook `nb`'s package.
SCRIPT = textwrap.dedent(r'''
    import dataclasses, hashlib, importlib, json, os, sys
    mode, work = sys.argv[1], json.loads(sys.argv[2])
    os.environ["XLA_FLAGS"] = work["xla_flags"]  # 2 virtual CPU devices, patient collectives
    os.environ["JAX_PLATFORMS"] = "cpu"  # not libtpu (installed for the AOT plans), which looks for a TPU first
    if mode == "copies":
        sys.modules["gemma_tpu_helpers"] = None  # any import of the course's package fails here
        sys.path.insert(0, work["copies"])

    def fix(nb, name):  # a module by its name: its stage folder comes along in a copy too (fix02/train/lora.py)
        where = work["folders"][name]
        return importlib.import_module(f"fix{nb}.{where}" if mode == "copies" else f"gemma_tpu_helpers.fixes.{where}")

    import jax
    import numpy as np
    from transformers import AutoTokenizer

    tiny, out = work["tiny"], {}
    import time
    clock = [time.perf_counter()]

    def done(nb):  # each notebook's seconds on stderr: a slow or stuck call shows where
        now = time.perf_counter()
        print(f"{mode} {nb}: {now - clock[0]:.1f} s", file=sys.stderr, flush=True)
        clock[0] = now
    auto_mesh = jax.make_mesh((2, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def model():  # notebook 00's copy loads a checkpoint (gemma4.load_model)
        return fix("00", "gemma4").load_model(tiny, auto_mesh, dtype="float32")

    def table(df):
        return json.loads(df.to_json(orient="records"))

    # 00 the port: the replica loaded into tunix by the checked loader, through the one config mapping
    m = model()
    out["00"] = {"layers": len(m.layers), "embed": list(m.embedder.input_embedding.value.shape),
                 "config": {f.name: str(getattr(cfg, f.name)) for cfg in [fix("00", "gemma4").to_tunix_config(
                     fix("00", "hf_checkpoint").read_text_config(tiny))] for f in dataclasses.fields(cfg)}}
    done("00")

    # 01 mesh: make_mesh(shape, axes), and its error for a shape the devices do not fill
    mesh_lib = fix("01", "mesh")
    mesh = mesh_lib.make_mesh((2, 1), ("fsdp", "tp"))
    try:
        mesh_lib.make_mesh((2, 2), ("fsdp", "tp"))
    except mesh_lib.MeshError as e:
        error = str(e)
    out["01"] = {"ids": [[d.id for d in row] for row in mesh.devices],
                 "axes": list(mesh.axis_names), "auto": all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types),
                 "error": error}
    done("01")

    # 02 LoRA naming: apply_lora with HF names and its coverage report, on the replica's model
    lora = fix("02", "lora")
    spec = lora.LoraSpec(rank=4, alpha=8.0, dropout=0.0)
    _, report = lora.apply_lora(model(), targets=spec.targets, rank=spec.rank, alpha=spec.alpha,
                                dropout=spec.dropout, abstract=True)
    out["02"] = {"report": table(report), "lora_params": int(report.attrs["lora_params"]),
                 "regex": report.attrs["regex"]}
    done("02")

    # 03 sharding: audit and fix a LoRA model's annotations on a (1, 8) mesh (tp=8 cannot divide the KV heads)
    sharding = fix("03", "sharding")
    text = fix("03", "hf_checkpoint").read_text_config(tiny)
    m, _ = lora.apply_lora(sharding.model_from_config(text, abstract=True), rank=4, alpha=8.0, abstract=True)
    tp8 = jax.sharding.AbstractMesh((1, 8), ("fsdp", "tp"))
    before = sharding.audit(m, tp8)
    changes = sharding.fix_shardings(m, tp8, apply=False)
    out["03"] = {"flags": [dataclasses.asdict(r) for r in sharding.flagged(before)],
                 "changes": [dataclasses.asdict(c) for c in changes],
                 "flags_after": len(sharding.flagged(sharding.audit(m, tp8)))}
    done("03")

    # 04 remat: LoRA first, then the policy
    remat = fix("04", "remat")
    m = remat.lora_then_remat(model(), 4, 8.0, "block")
    out["04"] = {"remat": remat.remat_config_of(m), "lora_params": int(remat.count_lora_params(m))}
    done("04")

    # 05 data: the assistant-only mask on the replica's tokenizer, and packing
    chat_tokens, packing = fix("05", "chat_tokens"), fix("05", "packing")
    tok = AutoTokenizer.from_pretrained(tiny)
    ids, mask = chat_tokens.tokenize_example(tok, [{"role": "user", "content": "Write a 2-to-1 mux."},
                                            {"role": "assistant", "content": "module mux(); endmodule"}])
    packed = packing.pack([(ids, mask)] * 3, 64)
    out["05"] = {"ids": np.asarray(ids).tolist(), "mask": np.asarray(mask).tolist(),
                 "packed": packed.stats, "segments": packed.segment_ids.tolist()}
    done("05")

    # 06 the train step: two updates of a LoRA model (loaded and adapted by 00's and 02's copies) on a fixed batch
    sft = fix("06", "sft")
    m, _ = lora.apply_lora(model(), rank=4, alpha=8.0)
    train = sft.TrainSpec(learning_rate=1e-2, warmup_steps=0, schedule="cosine", weight_decay=0.0, micro_batch=2,
                           grad_accum=1, max_seq_len=16, epochs=1, max_steps=2, eval_every=2, checkpoint_every=2,
                           keep_checkpoints=1, remat="none")
    optimizer = sft.optimizer_for(m, train, 2)
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(2, 500, (2, 16)).astype(np.int32), "loss_mask": np.ones((2, 16), np.int8),
             "segment_ids": np.ones((2, 16), np.int32), "positions": np.tile(np.arange(16, dtype=np.int32), (2, 1))}
    with jax.set_mesh(auto_mesh):
        train_step = sft.jitted()  # compiled once, as training runs it
        losses = [float(train_step(m, optimizer, batch)[0]) for _ in range(2)]
    out["06"] = {"losses": losses}
    done("06")

    # 07 merge: the streamed merge of a small LoRA checkpoint
    merge = fix("07", "merge")
    r = merge.merge_lora(tiny, work["checkpoint"], os.path.join(work["out"], f"merged-{mode}"), progress=False)
    from safetensors.numpy import load_file
    tensors = {}
    for shard in sorted(os.listdir(r.out_dir)):
        if shard.endswith(".safetensors"):
            tensors.update({k: hashlib.sha256(v.tobytes()).hexdigest()
                            for k, v in load_file(os.path.join(r.out_dir, shard)).items()})
    out["07"] = {"step": r.step, "merged": r.merged_tensors, "copied": r.copied_tensors, "tensors": tensors}
    done("07")

    # 08 serving: the TPU command and the per-chip HBM arithmetic
    command = fix("08", "vllm_command")
    target = command.ServeTarget(name="v6e-8", platform="tpu", chips=8, hbm_gib_per_chip=32.0,
                                 spec=command.ServeSpec(tensor_parallel=8, max_model_len=4096,
                                                        max_num_batched_tokens=2048, gpu_memory_utilization=0.9))
    out["08"] = {"argv": command.serve_command(target, tiny),
                 "hbm": command.hbm_per_chip(target, fix("08", "hf_checkpoint").read_text_config(tiny))}
    done("08")

    # 09 evaluation: pass@k of the reference design on a shipped problem
    problems_lib, score = fix("09", "eval_problems"), fix("09", "eval_score")
    problems = problems_lib.load_problems(work["problems"])
    rows = [{"task_id": p.task_id, "completion": problems_lib.reference_code(p)} for p in problems]
    results, scores = score.score_completions(problems, rows, ks=(1,), progress=False)
    out["09"] = {"categories": sorted(results["category"]), "pass@1": scores[1]}
    done("09")

    print("RESULT " + json.dumps(out, default=str))
''')


RUN_TIMEOUT_S = 1800  # about 100 s on an idle 2-core machine; several times that beside the other xdist worker


def run(mode: str, work: dict, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    try:
        r = subprocess.run([sys.executable, "-c", SCRIPT, mode, json.dumps(work)], capture_output=True, text=True,
                           cwd=cwd, env=env, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        done = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"{mode}: no result in {RUN_TIMEOUT_S} s; finished so far: "
                    f"{[x for x in done.splitlines() if x.startswith(mode)]}")
    assert r.returncode == 0, f"{mode}: {r.stderr[-4000:]}"
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


MODULES = [f"fixes.{p.parent.name}.{p.stem}" for p in path_of("fixes.core.errors").parents[1].glob("*/*.py")
           if p.stem != "__init__"]


def copy_into(pkg: Path, modules: set[str]) -> None:
    """The files of ``modules`` ("fixes.<folder>.<name>") into the package ``pkg``, each in its stage folder, as the
    copy line says: ``pkg/train/lora.py``, ``pkg/core/errors.py`` ..."""
    for m in modules:
        _, folder, _ = m.split(".")
        (pkg / folder).mkdir(parents=True, exist_ok=True)
        for init in (pkg / "__init__.py", pkg / folder / "__init__.py"):
            init.touch()
        shutil.copy(path_of(m), pkg / folder / path_of(m).name)


@pytest.fixture(scope="module")
def results(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("copy_fix")
    copies = root / "copies"
    lines = {name[:2]: files for name, files in copy_lines().items()}
    for nb in NOTEBOOKS:
        module, listed = lines[nb]
        copy_into(copies / f"fix{nb}", listed | {module})
    text = gemma4.read_text_config(tiny_dir)
    checkpoint = root / "checkpoints"
    meta = {"targets": list(layout.TARGETS), "rank": 4, "alpha": 8.0, "num_layers": text["num_hidden_layers"]}
    lora_checkpoint.write_lora_checkpoint(checkpoint, layout.synthetic_lora(text, layout.TARGETS, 4, std=0.05), meta)
    problems = root / "problems"
    problems.mkdir()
    for suffix in eval_problems.FILE_SUFFIXES.values():
        shutil.copy(paths.SHIPPED_EVAL / f"Prob001_majority3{suffix}", problems)
    work = {"tiny": str(tiny_dir), "checkpoint": str(checkpoint), "problems": str(problems), "out": str(root),
            "copies": str(copies), "xla_flags": multihost.cpu_xla_flags(2),
            "folders": {m.split(".")[-1]: m.split(".", 1)[1] for m in MODULES}}
    empty = root / "elsewhere"
    empty.mkdir()
    return run("package", work, empty), run("copies", work, empty)


@pytest.mark.parametrize("nb", NOTEBOOKS)
def test_the_copied_fix_gives_what_the_package_gives(results, nb):
    package, copies = results
    assert package[nb], f"notebook {nb}: no result"
    assert same(package[nb], copies[nb]), (nb, package[nb], copies[nb])


def test_the_calls_did_real_work(results):
    """The compared results are the fixes working, not empty agreement."""
    package, _ = results
    assert package["01"]["auto"] and "needs 4 devices but 2 are visible" in package["01"]["error"]
    assert package["02"]["lora_params"] > 0 and "k_einsum" in package["02"]["regex"]
    assert package["03"]["flags"] and package["03"]["changes"] and package["03"]["flags_after"] == 0
    assert package["04"]["remat"] == "block" and package["04"]["lora_params"] > 0
    assert 0 in package["05"]["mask"] and 1 in package["05"]["mask"]
    first, second = package["06"]["losses"]
    assert math.isfinite(first) and second < first  # the step trains
    assert package["07"]["merged"] > 0 and package["07"]["tensors"]
    assert package["08"]["argv"][:2] == ["docker", "run"] and package["08"]["hbm"]["fits"]
    assert package["09"]["categories"] == ["pass"] and package["09"]["pass@1"] == 1.0


def test_a_copy_without_one_of_its_files_fails(tmp_path):
    """The copy run can fail: notebook 02's package imports with every file of its copy line, not without
    layout.py."""
    module, listed = {n[:2]: f for n, f in copy_lines().items()}["02"]
    code = ("import sys; sys.modules['gemma_tpu_helpers'] = None; "
            f"sys.path.insert(0, {str(tmp_path)!r}); import fix02.train.lora")
    copy_into(tmp_path / "fix02", listed | {module})
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=tmp_path).returncode == 0
    shutil.rmtree(tmp_path / "fix02")
    copy_into(tmp_path / "fix02", (listed | {module}) - {"fixes.model.layout"})
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0 and "layout" in r.stderr
