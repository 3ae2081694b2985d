"""One source for quoted figures: every time, pass@1, GiB and ratio the README, docs/ and the course map quote is an
entry of gemma_tpu_helpers/data/quoted_figures.json, and this test fails when a quoted figure disagrees with it, or
when the file disagrees with the figure's own source (the shipped AOT points through the course's plan code, the
profiles, the serving arithmetic).

How an entry is found: each of its ``quoted`` regexes runs over every file of the data file's ``files`` (globs; a
notebook's markdown cells count as its text), with runs of whitespace made one space; each group is one number of
the entry's ``value`` (a number, or a list in the order of the groups). Every regex must match at least once. A
``{"files": GLOB, "re": REGEX}`` item searches only the files GLOB matches.
"""

import fnmatch
import glob
import json
import re
from pathlib import Path

import pytest

from gemma_tpu_helpers.course.front import logbook
from support import REPO

DATA = json.loads(logbook.QUOTED_FIGURES.read_text())
FIGURES = {f["id"]: f for f in DATA["figures"]}
KINDS = {"measured", "compiled", "predicted", "computed", "paper", "estimate"}
UNITS_S = {"s": 1, "min": 60, "h": 3600}


def read_text(path: Path) -> str:
    """A file's text as a reader sees it: a notebook's markdown cells, any other file whole; whitespace runs -> one
    space (a figure may wrap at the line's end)."""
    if path.suffix == ".ipynb":
        text = "\n\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                           if c["cell_type"] == "markdown")
    else:
        text = path.read_text()
    return re.sub(r"\s+", " ", text)


def quoted_files(root: Path = REPO) -> dict[str, str]:
    return {str(p.relative_to(root)): read_text(p)
            for pattern in DATA["files"] for p in sorted(Path(root).glob(pattern))}


def number(text: str) -> float:
    """A quoted number: "1,082", "0.9744", "2.4e-5", or a time as "2 min 54 s" (seconds)."""
    m = re.fullmatch(r"(\d+) min (\d+) s", text)
    if m:
        return int(m[1]) * 60 + int(m[2])
    text = text.replace(",", "")
    return int(text) if text.isdigit() else float(text)


def as_list(value) -> list:
    return list(value) if isinstance(value, list | tuple) else [value]


def regex(quote) -> str:
    """A ``quoted`` item: a regex searched in every file, or ``{"files": GLOB, "re": REGEX}`` for the files GLOB
    matches (a notebook's "Time." line, for instance: the same words in every notebook, another figure in each)."""
    return quote["re"] if isinstance(quote, dict) else quote


def disagreements(entry: dict, texts: dict[str, str]) -> tuple[int, list[str]]:
    """How many places quote ``entry``, and one line per place (or regex) that disagrees with its value."""
    want, found, bad = as_list(entry["value"]), 0, []
    for quote in entry["quoted"]:
        pattern, where = regex(quote), quote.get("files", "*") if isinstance(quote, dict) else "*"
        scope = {name: text for name, text in texts.items() if fnmatch.fnmatch(name, where)}
        hits = [(name, m) for name, text in scope.items() for m in re.finditer(pattern, text)]
        if not hits:
            bad.append(f"{entry['id']}: {pattern!r} matches nothing in {sorted(scope)}: reword it with the text")
        for name, m in hits:
            found += 1
            got = [number(g) for g in m.groups()]
            if len(got) != len(want) or any(abs(a - b) > 1e-12 * max(1.0, abs(b)) for a, b in zip(got, want)):
                bad.append(f"{name} quotes {entry['id']} as {m.group(0)!r}: {got}, the source says {want} "
                           f"({entry['source']})")
    return found, bad


def test_the_figures_file_is_well_formed():
    assert len(FIGURES) == len(DATA["figures"]), "ids must be unique"
    for f in DATA["figures"]:
        assert {"id", "value", "unit", "kind", "how", "source", "quoted"} <= f.keys(), f["id"]
        assert f["kind"] in KINDS, (f["id"], f["kind"])
        assert f["value"] is not None and all(isinstance(x, int | float) for x in as_list(f["value"])), f["id"]
        assert f["quoted"] or f["id"].startswith("course."), f"{f['id']} is quoted nowhere: drop it or add its regex"
        for q in f["quoted"]:
            assert re.compile(regex(q)).groups == len(as_list(f["value"])), (f["id"], q)
        for p in f.get("parts", []):
            assert p in FIGURES, (f["id"], p)


@pytest.mark.parametrize("fig_id", [f["id"] for f in DATA["figures"] if f["quoted"]])
def test_every_quote_agrees_with_the_file(fig_id):
    found, bad = disagreements(FIGURES[fig_id], quoted_files())
    assert not bad, "\n".join(bad)
    assert found


def test_the_check_fails_on_a_disagreement():
    """The checker itself: a figure quoted right passes, the same figure changed by one digit fails, and a regex
    that no longer finds its quote fails."""
    entry = {"id": "x", "value": [174, 115], "source": "s", "quoted": [r"in (\d+ min \d+ s) \(training (\d+) s\)"]}
    assert disagreements(entry, {"a.md": "runs it in 2 min 54 s (training 115 s)."}) == (1, [])
    found, bad = disagreements(entry, {"a.md": "runs it in 2 min 54 s (training 116 s).", "b.md": ""})
    assert found == 1 and len(bad) == 1 and "a.md quotes x" in bad[0] and "[174, 116]" in bad[0]
    found, bad = disagreements(entry, {"a.md": "runs it in about 3 minutes"})
    assert found == 0 and "matches nothing" in bad[0]


def test_notebooks_can_join_the_files(tmp_path):
    """The next wave adds notebooks/*.ipynb to ``files``: their markdown is read, their code is not."""
    nb = {"cells": [{"cell_type": "markdown", "source": ["**Time.** CPU: about\n", "15 s"]},
                    {"cell_type": "code", "source": ["# about 99 s"]}]}
    (tmp_path / "00.ipynb").write_text(json.dumps(nb))
    assert read_text(tmp_path / "00.ipynb") == "**Time.** CPU: about 15 s"
    entry = {"id": "course.cpu.00_setup", "value": 15, "source": "s",
             "quoted": [{"files": "notebooks/00_*.ipynb", "re": r"\*\*Time\.\*\* CPU: about (\d+) s"}]}
    texts = {"notebooks/00_setup.ipynb": read_text(tmp_path / "00.ipynb"),
             "notebooks/01_mesh_setup.ipynb": "**Time.** CPU: about 20 s"}
    assert disagreements(entry, texts) == (1, [])  # 01's own time is another entry's
    found, bad = disagreements(entry, {**texts, "notebooks/00_setup.ipynb": "**Time.** CPU: about 30 s"})
    assert found == 1 and "notebooks/00_setup.ipynb quotes course.cpu.00_setup" in bad[0]


# ---------------------------------------------------------------------------------------------- against their sources

def seconds(fig: dict) -> float:
    return max(as_list(fig["value"])) * UNITS_S[fig["unit"]]


def test_a_total_covers_its_parts():
    """A time quoted with its parts is at least their sum (the learning check's 2 min 54 s once had parts adding to
    207 s)."""
    for f in DATA["figures"]:
        if f.get("parts"):
            total = sum(seconds(FIGURES[p]) for p in f["parts"])
            assert seconds(f) >= total, f"{f['id']}: {seconds(f)} s is less than its parts' {total} s ({f['parts']})"


def derive_namespace(tmp_dir) -> dict:
    """What a ``derive`` expression may use: the values (``v``), the shipped AOT points through the course's own plan
    code (``gib``, ``pred``, ``point``), the profiles and the serving and sharding arithmetic."""
    from gemma_tpu_helpers.course.budget import param_memory, plan, predictions, serving_bench
    from gemma_tpu_helpers.course.config import base_model, profiles
    from gemma_tpu_helpers.course.training import profile_steps
    from gemma_tpu_helpers.fixes.model import gemma4, model_size

    GIB = 2**30

    def setting(name, remat, qlora=None):
        return (name, remat) if qlora is None else (name, remat, qlora)

    def compiled(name, remat, qlora=None):
        (p,) = plan.course_plans(tmp_dir, settings=(setting(name, remat, qlora),))
        return p

    def gib(name, remat, qlora=None):
        p = compiled(name, remat, qlora)
        return [round(getattr(p, k) / GIB, 2) for k in ("argument_bytes", "temp_bytes", "peak_bytes")]

    def pred(name, remat, qlora=None):
        return predictions.predict_run(compiled(name, remat, qlora), profiles.get_profile(name))

    def text(name):
        return base_model.profile_text_config(profiles.get_profile(name))

    def point(key):
        (p,) = plan.REFERENCE_POINTS[key]
        return p

    def ple(name):
        c = text(name)
        return c["vocab_size"] * c["num_hidden_layers"] * c["hidden_size_per_layer_input"]

    def lora_bytes(name):
        table = profile_steps.sharding_plan(profiles.get_profile(name))[0]
        return table.loc["LoRA params", "as annotated"], table.loc["LoRA params", "paper: LoRA replicated"]

    def xla_31b():
        return [pred(n, r)["xla_over_analytic"] for n, r in (*plan.COURSE_PLANS, ("v5p-16", "block"))]

    e_keys = [k for k in plan.REFERENCE_POINTS if k.startswith("colab-v") and "moe" not in k
              and not plan.REFERENCE_POINTS[k][0].get("hbm_oom")]
    # compiled beside other work (docs/design-notes.md, the shipped AOT points' table)
    beside = {"colab-v5e-1_decoder_seq2048_Lfit", "colab-v6e-1_decoder_seq3072_Lfit"}
    return {"v": {k: f["value"] for k, f in FIGURES.items()}, "GIB": GIB, "gib": gib, "pred": pred, "point": point,
            "text": text, "ple": ple, "lora_bytes": lora_bytes, "XLA_31B": xla_31b, "plan": plan,
            "param_memory": param_memory, "predictions": predictions, "profiles": profiles, "gemma4": gemma4,
            "model_size": model_size, "serving_bench": serving_bench,
            "hbm": profiles.CHIP_HBM_USABLE_GIB,
            "serving": lambda name: profile_steps.hbm_per_chip(profiles.get_profile(name)),
            "IDLE_E": [point(k)["compile_s"] for k in e_keys if k not in beside],
            "ALL_E": [point(k)["compile_s"] for k in e_keys]}


def derived(fig: dict, namespace: dict):
    value = eval(fig["derive"], namespace)  # noqa: S307 - the repository's own data file
    return [x.item() if hasattr(x, "item") else x for x in as_list(value)] if isinstance(value, list | tuple) else value


@pytest.fixture(scope="module")
def namespace(tmp_path_factory):
    return derive_namespace(tmp_path_factory.mktemp("no-cached-plans"))


@pytest.mark.parametrize("fig_id", [f["id"] for f in DATA["figures"] if f.get("derive")])
def test_a_derived_figure_equals_its_source(fig_id, namespace):
    fig = FIGURES[fig_id]
    assert derived(fig, namespace) == fig["value"], (
        f"{fig_id}: the file says {fig['value']}, its source ({fig['derive']}) gives {derived(fig, namespace)}: "
        f"update the value and every place it is quoted")


# ---------------------------------------------------------------------------------------------- the course map

def test_the_course_map_reads_its_times_from_the_file():
    for nb, _fix, mods, cpu, tpu in logbook.COURSE:
        assert cpu == logbook.cpu_time(nb) and f"{FIGURES['course.cpu.' + nb]['value']} s" == cpu
        fig = FIGURES["course.tpu." + nb]
        assert fig["kind"] == "estimate" and "est." in tpu, (nb, tpu)
        assert "-".join(str(x) for x in as_list(fig["value"])) + " " + fig["unit"] in tpu, (nb, tpu)
    assert [c[0] for c in logbook.COURSE] == sorted(p.stem for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_the_course_map_names_modules_that_exist():
    import importlib.util

    for nb, _fix, mods, *_ in logbook.COURSE:
        for m in mods.split(", "):
            assert importlib.util.find_spec(f"gemma_tpu_helpers.{m}"), (nb, m)


def test_files_globs_find_files():
    assert all(glob.glob(str(REPO / p)) for p in DATA["files"]), DATA["files"]
