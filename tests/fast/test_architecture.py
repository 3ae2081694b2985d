"""The package's layers hold: they are its stage folders, in the order ``gemma_tpu_helpers.TIERS`` declares them;
no import cycle, no private name imported from another module, no import from a later folder, every folder declared,
and this package's imports at the top of a file (only JAX, torch, vLLM and other heavy libraries are imported inside
functions). Read from the source with ``ast``: nothing runs."""

import ast
import re
from pathlib import Path

import pytest

import gemma_tpu_helpers
import support
from support import copy_lines, path_of

PKG = Path(gemma_tpu_helpers.__file__).parent
TIERS = [tier for tier, _ in gemma_tpu_helpers.TIERS]
# The layers, lowest first: "<tier>.<folder>" in the declared order; the CLI (__main__) on top
FOLDERS = [f"{tier}.{folder}" for tier, folders in gemma_tpu_helpers.TIERS for folder in folders]
LAYERS = FOLDERS + ["__main__"]
# every module as "<tier>.<folder>.<name>" ("__main__" at the top), found on disk: nothing lists them by hand
MODULES = sorted([f"{t}.{p.parent.name}.{p.stem}" for t in TIERS for p in (PKG / t).glob("*/*.py")
                  if p.stem != "__init__"] + [p.stem for p in PKG.glob("*.py") if p.stem != "__init__"])


def tier_of(module: str) -> str | None:
    return module.split(".")[0] if "." in module else None


def layer_of(module: str) -> int:
    """The position of a module's folder (or of a folder itself) in LAYERS."""
    return LAYERS.index(".".join(module.split(".")[:2]))


def imports(module: str):
    """(imported module as "<tier>.<folder>.<name>", imported names, inside a function?) for each import of this
    package in ``module``: relative imports resolved from the module's own folder; a name imported from a folder
    (``from ..train import lora``) is a module of that folder."""
    tree = ast.parse(path_of(module).read_text())
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if n is not f}
    package = module.split(".")[:-1]  # the module's folder, inside gemma_tpu_helpers
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ["gemma_tpu_helpers"] + package[:len(package) - node.level + 1] if node.level else []
            found = [(".".join(base + ([node.module] if node.module else [])), [a.name for a in node.names])]
        else:
            continue
        for dotted, names in found:
            parts = dotted.split(".")
            if parts[0] != "gemma_tpu_helpers":
                continue
            inside = ".".join(parts[1:])
            if len(parts) == 4 or not isinstance(node, ast.ImportFrom):  # a module, its names imported
                out.append((inside, names, id(node) in inner))
            else:  # a folder, a tier or the package: the names are its modules
                named = [".".join([*parts[1:], n]) for n in names]
                out.extend((m, [], id(node) in inner) for m in named if m in MODULES or len(parts) == 3)
    return out


GRAPH = {m: sorted({t for t, _, _ in imports(m)}) for m in MODULES}


def stage_problems(pkg: Path, folders: list[str]) -> list[str]:
    """What in the package folder ``pkg`` breaks the stage layout that ``folders`` ("<tier>.<folder>") declares: a
    module beside the tiers or loose in a tier, a folder on disk that is not declared or a declared one that is
    missing, a folder without its docstring or without a module, two modules of one name."""
    tiers = sorted({f.split(".")[0] for f in folders})
    found = [f"{p.name} beside the tiers" for p in sorted(pkg.glob("*.py")) if p.name not in ("__init__.py",
                                                                                            "__main__.py")]
    found += [f"{t}/{p.name} outside a stage folder" for t in tiers for p in sorted((pkg / t).glob("*.py"))
              if p.name != "__init__.py"]
    on_disk = {f"{t}.{d.name}" for t in tiers for d in (pkg / t).iterdir() if d.is_dir() and d.name != "__pycache__"}
    found += [f"{f} is not declared in TIERS" for f in sorted(on_disk - set(folders))]
    found += [f"{f} is declared but missing" for f in sorted(set(folders) - on_disk)]
    for f in sorted(on_disk & set(folders)):
        init = pkg / f.replace(".", "/") / "__init__.py"
        if not init.is_file() or not ast.get_docstring(ast.parse(init.read_text())):
            found.append(f"{f} has no docstring (its __init__.py)")
        if not [p for p in (pkg / f.replace(".", "/")).glob("*.py") if p.name != "__init__.py"]:
            found.append(f"{f} holds no module")
    stems = [p.stem for p in pkg.glob("*/*/*.py") if p.stem != "__init__"]
    found += [f"two modules named {s}" for s in sorted({s for s in stems if stems.count(s) > 1})]
    return found


def test_the_stages_are_the_declared_folders():
    """Whoever opens the package sees the stages: only the CLI and the package docstring sit beside the two tiers, a
    tier holds only its stage folders, each folder on disk is one that TIERS declares (and the other way round), with
    its docstring, and a module's name alone says which file it is (in the copy lines, the notebooks and the seeded
    faults)."""
    assert not stage_problems(PKG, FOLDERS), stage_problems(PKG, FOLDERS)


def ignored_by_git(paths: list[str]) -> list[str]:
    """Which of ``paths`` (relative to the checkout) the checkout's ignore rules match, whether git tracks them or
    not: a file there can be in this working tree and missing from a fresh clone."""
    import subprocess

    out = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], input="\n".join(paths), text=True,
                         capture_output=True, cwd=support.REPO)
    assert out.returncode in (0, 1), out.stderr  # 1: none ignored
    return out.stdout.split()


def test_no_file_of_the_package_is_ignored_by_git():
    """A stage folder whose name the checkout ignores (``runs/`` holds the run directories) loses its new files in
    every clone; the package's files must all be ones git keeps."""
    if not (support.REPO / ".git").exists():  # a copy of the tree (tools/seed_faults.py), not a checkout
        pytest.skip("not a git checkout: no ignore rules to ask")
    files = [str(p.relative_to(support.REPO)) for p in PKG.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert len(files) > 80 and not ignored_by_git(files), ignored_by_git(files)
    assert ignored_by_git(["gemma_tpu_helpers/course/runs/__init__.py", "gemma_tpu_helpers/fixes/core/errors.py"]) == [
        "gemma_tpu_helpers/course/runs/__init__.py"]


def test_the_stage_check_sees_a_violation(tmp_path):
    for f in ("fixes/core", "fixes/train", "fixes/extra", "course/config"):
        (tmp_path / f).mkdir(parents=True)
        (tmp_path / f / "__init__.py").write_text('"""A stage."""\n')
    for f in ("helpers.py", "fixes/loose.py", "fixes/core/lora.py", "fixes/train/lora.py", "fixes/extra/x.py"):
        (tmp_path / f).write_text("")
    (tmp_path / "course" / "config" / "__init__.py").write_text("")
    assert stage_problems(tmp_path, ["fixes.core", "fixes.train", "fixes.model", "course.config"]) == [
        "helpers.py beside the tiers", "fixes/loose.py outside a stage folder", "fixes.extra is not declared in TIERS",
        "fixes.model is declared but missing", "course.config has no docstring (its __init__.py)",
        "course.config holds no module", "two modules named lora"]


def upward(graph: dict[str, list[str]]) -> list[str]:
    """Each import of a module in a later folder than the importer's (LAYERS' order)."""
    return [f"{m} imports {t}" for m, targets in graph.items() for t in targets if layer_of(t) > layer_of(m)]


def test_no_import_goes_up_a_layer():
    assert not upward(GRAPH), upward(GRAPH)
    seeded = {"fixes.core.file_io": ["fixes.train.lora"], "fixes.train.lora": ["fixes.train.remat"],
              "course.config.paths": ["course.training.train", "fixes.eval.eval_score"]}
    assert upward(seeded) == ["fixes.core.file_io imports fixes.train.lora",
                              "course.config.paths imports course.training.train"]


def test_no_import_cycle():
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for t in GRAPH.get(m, []):
            if state.get(t) == "open":
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in MODULES:
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_no_private_name_imported_from_another_module():
    private = [f"{m} imports {t}.{n}" for m in MODULES for t, names, _ in imports(m) for n in names
               if n.startswith("_") and t != m]
    assert not private, private


def test_this_packages_imports_are_at_the_top():
    inner = [f"{m} imports {t} inside a function" for m in MODULES for t, _, is_inner in imports(m) if is_inner]
    assert not inner, inner


@pytest.mark.parametrize("module", ["fixes.core.file_io", "fixes.core.process_groups", "fixes.core.http_client",
                                    "fixes.model.chat_format", "fixes.core.compat"])
def test_the_core_imports_only_the_error_base(module):
    assert set(GRAPH[module]) <= {"fixes.core.errors"} and GRAPH["fixes.core.errors"] == []


def test_the_course_is_on_top_of_the_fixes():
    """The tier rule: a fix imports only fixes (the course imports the fixes, never the other way round)."""
    down = [f"{m} imports {t}" for m in MODULES if tier_of(m) == "fixes" for t in GRAPH[m] if tier_of(t) != "fixes"]
    assert not down, down


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    """The checks can fail: an upward, private, function-level import in a scratch module is seen as such."""
    (tmp_path / "fixes" / "core").mkdir(parents=True)
    (tmp_path / "fixes" / "core" / "scratch.py").write_text(
        "from ..train import lora\nfrom . import errors as e\n"
        "def f():\n    from ...course.front.site import _private\n")
    monkeypatch.setattr(support, "PKG", tmp_path)  # path_of reads the package's folder from there
    assert imports("fixes.core.scratch") == [("fixes.train.lora", [], False), ("fixes.core.errors", [], False),
                                             ("course.front.site", ["_private"], True)]


def closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for t in GRAPH.get(todo.pop(), []):
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen - {module}


def test_each_notebook_names_the_files_that_travel_together():
    """A notebook's "Copy into your project" line lists exactly what its module imports from this package."""
    for name, (module, listed) in copy_lines().items():
        assert listed == closure(module), (name, sorted(listed ^ closure(module)))


COPY_BUDGET_LINES = 1500  # what copying one fix may cost, the module and what it imports together (2650 before
# #44 split the modules by concern and cut their prose; 2200 before #62 moved the notebooks' tables, plots and traps to
# course/, split the checkpoint reading (hf_checkpoint, model_size) and the AOT compile (step) from what a copy needs:
# 06's copy went from 2,165 lines to the train step's 229)


def test_a_fix_travels_without_the_course():
    """Notebooks 01-09 teach one fix each: its copy holds no course module and stays within the budget."""
    lines = {}
    for name, (module, listed) in copy_lines().items():
        if not name.startswith(tuple(f"0{i}_" for i in range(1, 10))):
            continue
        assert tier_of(module) == "fixes" and all(tier_of(m) == "fixes" for m in listed), (name, module, listed)
        lines[name] = sum(len(path_of(m).read_text().splitlines()) for m in listed | {module})
    print(lines)
    assert len(lines) == 9 and max(lines.values()) <= COPY_BUDGET_LINES, lines


PLOTTING = ("matplotlib",)  # a fix returns data; the figures are drawn by the course or the notebook


def plotting_imports(source: str, module: str) -> list[str]:
    """Imports of a plotting library in ``source``, at the top or inside a function."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        found += [f"{module}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in PLOTTING]
    return found


def test_no_fix_draws():
    """A copied fix needs no plotting library: plots of its results are the course's (course/views/)."""
    found = [f for m in MODULES if tier_of(m) == "fixes" for f in plotting_imports(path_of(m).read_text(), m)]
    assert not found, found
    seeded = "def chart(rows):\n    import matplotlib.pyplot as plt\n    return plt.subplots()\n"
    assert plotting_imports(seeded, "fixes.train.data") == ["fixes.train.data:2 imports matplotlib.pyplot"]


# ------------------------------------------------------------------------------------- the configuration boundary

# Where a fix may touch the environment, and why. Anything else that reads os.environ or os.getenv, locates files from
# its own __file__, or names the course (its package, its cache folder, its variables) in a string, is the course's.
ENVIRONMENT_ALLOWED = {
    "fixes.core.http_client": "VLLM_API_KEY is vLLM's own variable (its server reads it too), not the course's",
    "fixes.train.multihost": "JAX reads its CPU device count from XLA_FLAGS before its backend starts: setting it is "
                             "the fix",
    "fixes.serve.vllm_command": "vLLM's parser runs in a child process, which inherits the caller's environment",
    "fixes.serve.vllm_server": "the server runs in a child process, which inherits the caller's environment",
}
COURSE_NAMES = ("gemma_tpu_helpers", "gemma-tpu", "GEMMA_TPU", "python -m", "this course")


def cli_flags() -> set[str]:
    """Every ``--flag`` the course's command line adds (``add_argument`` in course/*/*.py), read from the source."""
    flags = set()
    for path in (PKG / "course").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "add_argument":
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return flags


CLI_FLAGS = cli_flags()


def course_settings_in(source: str, module: str, flags=frozenset()) -> list[str]:
    """What in a fix's ``source`` belongs to the course: environment reads, __file__-relative paths, the course's
    names in strings (docstrings included: a copied file's reader has no course), and its command line's ``flags``
    in any string but an argument list's items (``["--port", ...]``: another program's command line)."""
    found = []
    tree = ast.parse(source)
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" and \
                node.attr in ("environ", "getenv", "putenv") and module not in ENVIRONMENT_ALLOWED:
            found.append(f"{module}:{node.lineno} reads os.{node.attr}")
        elif isinstance(node, ast.Name) and node.id == "__file__":
            found.append(f"{module}:{node.lineno} locates files from its own __file__")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [f"{module}:{node.lineno} names the course ({name!r})" for name in COURSE_NAMES
                      if name in node.value.lower() or name in node.value]
            whole = parent[node] if isinstance(parent.get(node), ast.JoinedStr) else node  # an f-string's part
            if not isinstance(parent.get(whole), (ast.List, ast.Tuple, ast.Set)):
                found += [f"{module}:{node.lineno} names the course's flag {flag}" for flag in
                          sorted(set(re.findall(r"--[a-z][a-z0-9-]*", node.value)) & flags)]
    return found


def test_no_fix_reads_the_courses_settings():
    """A fix takes every location and setting as an argument: the course reads the environment and its own paths
    (course/config/paths.py) and passes them down."""
    found = [f for m in MODULES if tier_of(m) == "fixes"
             for f in course_settings_in(path_of(m).read_text(), m, CLI_FLAGS)]
    assert not found, found


def test_the_boundary_check_sees_a_violation():
    """The check can fail: each kind of course setting, seeded into a fix's source, is found."""
    seeded = ("import os\nfrom pathlib import Path\n"
              "CACHE = os.environ.get('X')\nDATA = Path(__file__).parent / 'data'\n"
              "HINT = 'run gemma_tpu_helpers'\n")
    found = course_settings_in(seeded, "fixes.train.data")
    assert sorted(found) == ["fixes.train.data:3 reads os.environ",
                             "fixes.train.data:4 locates files from its own __file__",
                             "fixes.train.data:5 names the course ('gemma_tpu_helpers')"], found
    assert course_settings_in("import os\nos.environ.get('VLLM_API_KEY')\n", "fixes.core.http_client") == []


def test_a_fix_message_names_its_parameters_not_the_courses_flags():
    """A fix's error names its own parameters (``overwrite=True``); the course's CLI maps them to its flags
    (course/commands/cli.py FLAGS). A message naming one of the CLI's flags, or the course's commands, is found; another
    program's argument list (vLLM's ``["--port", ...]``) is not a message."""
    assert {"--overwrite", "--num-processes", "--port"} <= CLI_FLAGS
    message = ("def f(n, overwrite):\n"
               "    raise ValueError(f'{n} exists; pass --overwrite to replace it')\n"
               "def g(n):\n"
               "    raise ValueError(f'start every worker with --num-processes {n}')\n"
               "HINT = 'run `python -m tool eval` again'\n"
               "WHO = 'Was it trained by this course?'\n"
               "ARGV = ['--port', '8000', f'--model={1}']\n")
    assert sorted(course_settings_in(message, "fixes.train.data", CLI_FLAGS)) == [
        "fixes.train.data:2 names the course's flag --overwrite",
        "fixes.train.data:4 names the course's flag --num-processes",
        "fixes.train.data:5 names the course ('python -m')", "fixes.train.data:6 names the course ('this course')"]
    assert course_settings_in("raise ValueError('pass overwrite=True to replace it')\n", "fixes.train.data",
                              CLI_FLAGS) == []


# ---------------------------------------------------------------------------------------------- the tests' tiers

TESTS = Path(__file__).resolve().parent.parent
# What makes a test end-to-end (tests/e2e): a fixture that trains or starts a server, or a call that walks the CLI,
# trains in several processes or runs the learning check.
E2E_FIXTURES = {"smoke_run": "the smoke training", "gcs": "fake-gcs-server"}
E2E_CALLS = {"walk": "a CLI walk", "learn": "the learning check", "sigterm_processes": "a killed training"}
E2E_TEXT = {"--num-processes": "a multi-process training"}


def test_the_fast_tier_trains_no_run_and_starts_no_server():
    """tests/fast is what `make check` runs after every edit: nothing there may wait on a shared training, a server
    or a multi-process run (each of those belongs in tests/e2e)."""
    found = []
    for path in sorted((TESTS / "fast").glob("test_*.py")):
        if path == Path(__file__).resolve():
            continue  # this file names what it looks for
        text = path.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [f"{path.name}::{node.name} uses {E2E_FIXTURES[a.arg]}" for a in node.args.args
                          if a.arg in E2E_FIXTURES]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and (node.func.value.id, node.func.attr) in {
                        ("support", "walk"), ("learning_check", "learn")}:
                found.append(f"{path.name}:{node.lineno} runs {E2E_CALLS[node.func.attr]}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in E2E_CALLS:
                found.append(f"{path.name}:{node.lineno} runs {E2E_CALLS[node.func.id]}")
        found += [f"{path.name} starts {why}" for needle, why in E2E_TEXT.items() if needle in text]
    assert not found, "move these to tests/e2e: " + "; ".join(found)


def test_no_test_module_imports_another():
    """Shared helpers live in tests/support.py (and fixtures in conftest.py): a test module never imports another
    test module or conftest, so each can move, or run alone, on its own."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(TESTS)} imports {n}" for n in names
                      if n.split(".")[0].startswith("test_") or n.split(".")[0] == "conftest"]
    assert not found, found


# -------------------------------------------------------------------------------- the course's settings, in one place

# reads and sets every environment variable the course uses, and locates the checkout
SETTINGS_MODULE = "course.config.paths"


def environment_uses(source: str, module: str) -> list[str]:
    """Where ``source`` touches the process environment (``os.environ``, ``getenv``, ``putenv``, ``unsetenv``) or
    locates files from its own ``__file__``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" and \
                node.attr in ("environ", "getenv", "putenv", "unsetenv"):
            found.append(f"{module}:{node.lineno} uses os.{node.attr}")
        elif isinstance(node, ast.Name) and node.id == "__file__":
            found.append(f"{module}:{node.lineno} locates files from its own __file__")
    return found


def test_the_course_reads_its_settings_in_paths_alone():
    """course/config/paths.py is the one course module that reads or sets the environment or computes the checkout's
    locations; the others ask it (``paths.runs_root()``, ``paths.setting(...)``, ``paths.REPO`` ...)."""
    found = [f for m in MODULES if tier_of(m) == "course" and m != SETTINGS_MODULE
             for f in environment_uses(path_of(m).read_text(), m)]
    assert not found, found
    assert environment_uses(path_of(SETTINGS_MODULE).read_text(), SETTINGS_MODULE)  # it is there, in paths


def test_the_settings_check_sees_a_violation():
    seeded = ("import os\nfrom pathlib import Path\n"
              "ROOT = os.environ.get('GEMMA_TPU_RUNS')\nHERE = Path(__file__).parent\nos.putenv('X', '1')\n")
    assert sorted(environment_uses(seeded, "course.config.profiles")) == [
        "course.config.profiles:3 uses os.environ", "course.config.profiles:4 locates files from its own __file__",
        "course.config.profiles:5 uses os.putenv"]


IMPORT_EVERYTHING = """
import importlib, json, os, sys
import threadpoolctl  # a dependency's own import sets KMP_DUPLICATE_LIB_OK: not the package's doing
before = dict(os.environ)
for name in sys.argv[1:]:
    importlib.import_module(name)
after = dict(os.environ)
print(json.dumps(sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))))
"""


def test_importing_the_package_changes_no_environment():
    """Importing every module of the package (the course included) leaves PATH and every other variable as it was:
    the course sets what it must when a command or a notebook asks (``profiles.configure_jax``, ``colab.setup``)."""
    import json
    import subprocess
    import sys

    names = ["gemma_tpu_helpers"] + [f"gemma_tpu_helpers.{m}" for m in MODULES]
    out = subprocess.run([sys.executable, "-c", IMPORT_EVERYTHING, *names], capture_output=True, text=True,
                         timeout=300, cwd=support.REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# ---------------------------------------------------------------------------------------------- short functions

MAX_FUNCTION_LINES = 60  # a function longer than this is named steps waiting to be written (docstring included)


def long_functions(source: str, module: str) -> dict[str, int]:
    """``{"module.function": lines}`` for each function (methods and nested ones too) over MAX_FUNCTION_LINES."""
    return {f"{module}.{node.name}": node.end_lineno - node.lineno + 1 for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}


def test_no_function_over_60_lines():
    found = {k: n for m in MODULES for k, n in long_functions(path_of(m).read_text(), m).items()}
    assert not found, found


def test_the_length_check_sees_a_long_function():
    seeded = "def f():\n" + "    x = 1\n" * 60 + "\n\ndef g():\n    return 1\n"
    assert long_functions(seeded, "course.training.train") == {"course.training.train.f": 61}


# ------------------------------------------------------------------------------------- tests use the public API

def private_uses(source: str, where: str) -> list[str]:
    """Calls ``module._name(...)`` in a test's ``source`` where ``module`` is one of the package's (imported by name
    from ``gemma_tpu_helpers``): what a user of the package could not call either."""
    tree = ast.parse(source)
    ours = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gemma_tpu_helpers"):
            ours |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            ours |= {a.asname or a.name for a in node.names if a.name.startswith("gemma_tpu_helpers")}
    return [f"{where}:{call.lineno} {f.value.id}.{f.attr}" for call in ast.walk(tree) if isinstance(call, ast.Call)
            for f in [call.func] if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
            and f.value.id in ours and f.attr.startswith("_") and not f.attr.startswith("__")]


def test_no_test_calls_a_private_function():
    found = [f for path in sorted((support.REPO / "tests").rglob("*.py"))
             for f in private_uses(path.read_text(), str(path.relative_to(support.REPO)))]
    assert not found, found


def test_the_private_check_sees_one():
    seeded = "from gemma_tpu_helpers.course.training import train as t\nt._apply_lora(1)\nt.train(2)\nt.__doc__\nt._X\n"
    assert private_uses(seeded, "tests/x.py") == ["tests/x.py:2 t._apply_lora"]
