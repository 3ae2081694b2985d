"""docs/tpu-vm.md, the TPU VM runbook, as its reader will type it: every command of the course in it parses with the
course's own parser and runs on a CPU in tests/e2e/test_user_paths.py (or is listed there as not run, with the
reason), every `make` target it names exists, its `gcloud` lines use only the flags of gcloud's reference that are
listed below (and attach each disk in its VM's zone, the disk type and runtime version Cloud TPU documents for that
TPU), and its data disks hold what the pre-flight asks for, computed by the pre-flight's own functions: a change of
the checkpoint size that the disks no longer cover fails here. Each checker is also fed a seeded fault."""

import ast
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from gemma_tpu_helpers import __main__ as main_module
from gemma_tpu_helpers.course.budget import param_memory
from gemma_tpu_helpers.course.commands import cli
from gemma_tpu_helpers.course.config import hub, profiles
from gemma_tpu_helpers.course.front import preflight
from support import REPO

RUNBOOK = REPO / "docs" / "tpu-vm.md"
FIGURES = {f["id"]: f for f in json.loads((REPO / "gemma_tpu_helpers/data/quoted_figures.json").read_text())["figures"]}

# The gcloud commands the runbook may use, with the flags it may pass: each from gcloud's reference
# (https://cloud.google.com/sdk/gcloud/reference/<the command's words joined by />, read 2026-12; --quiet is one of
# gcloud's global flags). (positional arguments: fewest, most or None; allowed flags; required flags)
GCLOUD = {
    ("config", "set"): (2, 2, set(), set()),
    ("services", "enable"): (1, None, set(), set()),
    ("storage", "buckets", "create"): (1, 1, {"--location"}, set()),
    ("storage", "buckets", "add-iam-policy-binding"): (1, 1, {"--member", "--role"}, {"--member", "--role"}),
    ("storage", "cp"): (2, None, {"-r"}, set()),
    ("storage", "rm"): (1, None, {"-r"}, set()),
    ("compute", "disks", "create"): (1, None, {"--zone", "--size", "--type"}, {"--zone", "--size", "--type"}),
    ("compute", "disks", "delete"): (1, None, {"--zone", "--quiet"}, {"--zone"}),
    ("compute", "tpus", "tpu-vm", "accelerator-types", "list"): (0, 0, {"--zone"}, {"--zone"}),
    ("compute", "tpus", "tpu-vm", "versions", "list"): (0, 0, {"--zone"}, {"--zone"}),
    # --version is the runtime version (the reference also accepts --runtime-version on the API)
    ("compute", "tpus", "tpu-vm", "create"): (1, 1, {"--zone", "--accelerator-type", "--version", "--data-disk",
                                                     "--spot"}, {"--zone", "--accelerator-type", "--version"}),
    ("compute", "tpus", "tpu-vm", "ssh"): (1, 1, {"--zone"}, {"--zone"}),
    ("compute", "tpus", "tpu-vm", "describe"): (1, 1, {"--zone", "--format"}, {"--zone"}),
    ("compute", "tpus", "tpu-vm", "delete"): (1, 1, {"--zone", "--quiet"}, {"--zone"}),
    ("compute", "tpus", "tpu-vm", "list"): (0, 0, {"--zone"}, {"--zone"}),
}
# Cloud TPU's "TPU software versions" (cloud.google.com/tpu/docs/runtimes) and "Attach durable block storage to a TPU
# VM" (cloud.google.com/tpu/docs/setup-persistent-disk), read 2026-12: the runtime and the disk types of each TPU
RUNTIME = {"v5p": "v2-alpha-tpuv5", "v6e": "v2-alpha-tpuv6e"}
DISK_TYPES = {"v5p": {"pd-balanced"}, "v6e": {"hyperdisk-balanced", "hyperdisk-ml"}}


def blocks(text: str) -> list[str]:
    """The shell code blocks, a line continued with a backslash joined to the next."""
    return [b.replace("\\\n", " ") for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def shell_lines(text: str) -> list[list[str]]:
    """Every command of the code blocks as words (comments dropped; ``a && b`` is two commands)."""
    out = []
    for block in blocks(text):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            cmd = []
            for w in words + ["&&"]:
                if w in ("&&", "||", ";", "|"):
                    if cmd:
                        out.append(cmd)
                    cmd = []
                else:
                    cmd.append(w)
    return out


def course_commands(text: str) -> list[list[str]]:
    """The argv of every ``python -m gemma_tpu_helpers ...`` in a code block or span."""
    spans = [b for b in blocks(text)] + re.findall(r"`([^`\n]+)`", text)
    out = []
    for span in spans:
        for m in re.finditer(r"python -m gemma_tpu_helpers((?: [^`#\n]*)?)", span):
            argv = shlex.split(m.group(1), comments=True)
            if argv and argv not in out:
                out.append(argv)
    return out


def parse_error(argv) -> str | None:
    try:
        cli.build_parser(main_module.COMMANDS).parse_args(argv)
        return None
    except SystemExit:
        return f"the CLI refuses {' '.join(argv)!r}"


def user_paths_lists() -> tuple[list[str], dict]:
    """ORDER and NOT_RUN of tests/e2e/test_user_paths.py, read from its source (test modules do not import each
    other): the steps it runs from the documentation, and the documented commands it does not run."""
    tree = ast.parse((REPO / "tests/e2e/test_user_paths.py").read_text())
    found = {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
             for t in n.targets if isinstance(t, ast.Name) and t.id in ("ORDER", "NOT_RUN")}
    return found["ORDER"], found["NOT_RUN"]


def as_smoke(argv) -> list[str]:
    """The command as test_user_paths runs it: the TPU profiles' names made ``smoke``."""
    others = [p for p in profiles.PROFILES if not p.startswith("smoke")]
    argv = ["smoke" if a in others and i and argv[i - 1] == "--profile" else a for i, a in enumerate(argv)]
    return [re.sub(r"^(runs/)(%s)(/|$)" % "|".join(map(re.escape, others)), r"\1smoke\3", a) for a in argv]


def make_targets(makefile: str) -> set[str]:
    targets = set()
    for line in makefile.splitlines():
        m = re.match(r"^([A-Za-z0-9_.\- ]+):(?!=)", line)
        if m and not line.startswith("\t"):
            targets |= set(m.group(1).split())
    return targets


def make_problems(text: str, makefile: str) -> list[str]:
    targets = make_targets(makefile)
    named = [w for cmd in shell_lines(text) if cmd[0] == "make" for w in cmd[1:] if "=" not in w]
    named += [m for m in re.findall(r"`make ([a-z][\w-]*)", text)]
    return [f"make {t}: no such target in the Makefile" for t in named if t not in targets] + (
        [] if named else ["the runbook names no make target"])


def assigned_variables(text: str) -> set[str]:
    return {m for line in blocks(text) for m in re.findall(r"(?:^|\s|export\s+)([A-Z_][A-Z0-9_]*)=", line, re.M)}


def gcloud_calls(text: str) -> list[tuple[tuple, list[str], dict, list[str]]]:
    """(command words, positionals, {flag: value}, the words as written) of each gcloud line."""
    out = []
    for cmd in shell_lines(text):
        if cmd[0] == "gcloud":
            words = cmd[1:]
        elif re.fullmatch(r"[A-Z_][A-Z0-9_]*=\$\(gcloud", cmd[0]):  # VAR=$(gcloud ...): its last word ends in ")"
            words = cmd[1:-1] + [cmd[-1].removesuffix(")")]
        else:
            continue
        if "--" in words:  # ssh: what follows goes to ssh itself
            words = words[:words.index("--")]
        path = max((k for k in GCLOUD if tuple(words[:len(k)]) == k), key=len, default=None)
        if path is None:
            out.append((tuple(words[:3]), [], {}, words))
            continue
        flags, positional = {}, []
        for w in words[len(path):]:
            if w.startswith("-"):
                name, _, value = w.partition("=")
                flags[name] = value
            else:
                positional.append(w)
        out.append((path, positional, flags, words))
    return out


def gcloud_problems(text: str) -> list[str]:
    problems = []
    known = assigned_variables(text)
    disks = {}  # disk name (as written) -> (zone, type)
    calls = gcloud_calls(text)
    for path, positional, flags, words in calls:
        if path not in GCLOUD:
            problems.append(f"gcloud {' '.join(words)}: not a command of the allow-list")
            continue
        fewest, most, allowed, required = GCLOUD[path]
        line = f"gcloud {' '.join(words)}"
        if set(flags) - allowed:
            problems.append(f"{line}: {sorted(set(flags) - allowed)} not among {sorted(allowed)}")
        if required - set(flags):
            problems.append(f"{line}: needs {sorted(required - set(flags))}")
        if len(positional) < fewest or (most is not None and len(positional) > most):
            problems.append(f"{line}: {len(positional)} positional arguments")
        for name, value in flags.items():
            if name.startswith("--") and name not in ("--quiet", "--spot") and not value:
                problems.append(f"{line}: {name} without =VALUE")
        unknown = set(re.findall(r"\$([A-Z_][A-Z0-9_]*)", " ".join(words))) - known
        if unknown:
            problems.append(f"{line}: ${', $'.join(sorted(unknown))} is never set in the runbook")
        if path == ("compute", "disks", "create"):
            for disk in positional:
                disks[disk] = (flags.get("--zone"), flags.get("--type"))
    for path, positional, flags, words in calls:
        if path != ("compute", "tpus", "tpu-vm", "create"):
            continue
        line = f"gcloud {' '.join(words)}"
        chip = flags.get("--accelerator-type", "").split("-")[0]
        if flags.get("--accelerator-type") not in profiles.PROFILES:
            problems.append(f"{line}: --accelerator-type is not one of the course's profiles")
        if RUNTIME.get(chip) != flags.get("--version"):
            problems.append(f"{line}: a {chip} takes --version={RUNTIME.get(chip)}")
        m = re.fullmatch(r"source=projects/\$PROJECT/zones/([^/]+)/disks/([^,]+),mode=read-write",
                         flags.get("--data-disk", ""))
        if not m:
            problems.append(f"{line}: --data-disk=source=projects/$PROJECT/zones/ZONE/disks/DISK,mode=read-write")
            continue
        zone, disk = m.groups()
        if zone != flags.get("--zone"):
            problems.append(f"{line}: the disk's zone {zone} is not the VM's {flags.get('--zone')}")
        made = disks.get(disk)
        if made is None:
            problems.append(f"{line}: disk {disk} is never created")
        elif made[0] != flags.get("--zone") or made[1] not in DISK_TYPES.get(chip, ()):
            problems.append(f"{line}: disk {disk} is made in {made[0]} as {made[1]}; a {chip} VM in "
                            f"{flags.get('--zone')} takes {sorted(DISK_TYPES.get(chip, ()))} there")
    return problems


def disk_sizes_gb(text: str) -> dict[str, int]:
    """{chip of the VM that attaches it: --size in GB} of each data disk the runbook creates."""
    calls = gcloud_calls(text)
    sizes = {p[0]: int(re.fullmatch(r"(\d+)GB", f["--size"])[1]) for path, p, f, _ in calls
             if path == ("compute", "disks", "create")}
    out = {}
    for path, _, flags, _ in calls:
        if path == ("compute", "tpus", "tpu-vm", "create"):
            disk = flags["--data-disk"].split("/disks/")[1].split(",")[0]
            out[flags["--accelerator-type"]] = sizes[disk]
    return out


def checkpoint_files_bytes(profile) -> int:
    """The Orbax checkpoints on the training disk: LoRA params and AdamW state (param_memory.memory_estimate,
    unsharded), keep_checkpoints of the full run and the first run's one."""
    from gemma_tpu_helpers.course.config import base_model

    b = param_memory.memory_estimate(profile, base_model.profile_text_config(profile))["per_device_bytes"]
    return (profile.train.keep_checkpoints + 1) * (b["LoRA params (replicated)"] + b["AdamW state (fp32, 2x)"])


MARGIN = 1.1  # the runbook's tenth for the filesystem and room


def disk_problems(text: str, tmp_path, monkeypatch) -> list[str]:
    """The training disk, less the venv, the Orbax checkpoints and the margin, passes the pre-flight's own disk check
    for the run (base + merged copy, its sizes from profiles); the serving disk holds the merged copy and both venvs
    with the margin."""
    sizes = disk_sizes_gb(text)
    venv, serve_venvs = (x * 10**9 for x in FIGURES["tpuvm.venv_budget_gb"]["value"])
    train = profiles.get_profile("v5p-8")
    problems = []
    free = sizes["v5p-8"] * 10**9 / MARGIN - venv - checkpoint_files_bytes(train)  # GB as 10^9: gcloud's GB is GiB
    monkeypatch.setattr(hub, "free_bytes", lambda path: (Path(tmp_path), int(free)))
    check = preflight.check_disk(train, tmp_path / "runs" / "v5p-8")
    if check.status != "ok":
        problems.append(f"the training disk of {sizes['v5p-8']} GB: {check.detail}")
    merged = preflight.checkpoint_bytes(profiles.get_profile("v6e-8"))
    if sizes["v6e-8"] * 10**9 < (merged + serve_venvs) * MARGIN:
        problems.append(f"the serving disk of {sizes['v6e-8']} GB holds less than the merged copy "
                        f"({merged / 1e9:.0f} GB) and the venvs with the margin")
    return problems


# ------------------------------------------------------------------------------------------------- the runbook

TEXT = RUNBOOK.read_text()


def test_every_course_command_parses_and_runs_in_smoke():
    commands = course_commands(TEXT)
    order, not_run = user_paths_lists()
    assert {a[0] for a in commands} >= {"setup", "train", "merge", "verify", "serve", "eval", "bench", "report"}
    assert not [e for e in map(parse_error, commands) if e]
    for argv in commands:
        text = " ".join(as_smoke(argv))
        skipped = next((why for key, why in not_run.items() if text == key or text.startswith(key + " ")), None)
        assert skipped or argv[0] in order, (f"{text!r}: tests/e2e/test_user_paths.py neither runs this step (ORDER) "
                                             f"nor lists the command in NOT_RUN with the reason")
    assert ["report", "--profile", "v5p-8", "--hardware"] in commands


def test_make_targets_exist():
    assert make_problems(TEXT, (REPO / "Makefile").read_text()) == []


def test_gcloud_lines_are_well_formed():
    assert gcloud_problems(TEXT) == []
    paths = {c[0] for c in gcloud_calls(TEXT)}
    assert {("compute", "tpus", "tpu-vm", "create"), ("compute", "disks", "create"),
            ("compute", "tpus", "tpu-vm", "delete"), ("compute", "disks", "delete")} <= paths
    creates = [f for p, _, f, _ in gcloud_calls(TEXT) if p == ("compute", "tpus", "tpu-vm", "create")]
    assert sorted(f["--accelerator-type"] for f in creates) == ["v5p-8", "v6e-8"]
    assert "cloud.google.com/tpu/docs/runtimes" in TEXT  # where the runtime versions come from


def test_data_disks_hold_what_the_preflight_asks(tmp_path, monkeypatch):
    assert disk_problems(TEXT, tmp_path, monkeypatch) == []


def test_the_clone_is_the_repository_of_pyproject():
    url = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    clones = [c for c in shell_lines(TEXT) if c[:2] == ["git", "clone"]]
    assert clones and all(c[2] == url for c in clones), (clones, url)


def test_linked_from_the_readme_and_setup():
    assert "(docs/tpu-vm.md)" in (REPO / "README.md").read_text()
    assert "(tpu-vm.md)" in (REPO / "docs/setup.md").read_text()


# ---------------------------------------------------------------------------------------- each checker, failing

def seeded(old: str, new: str) -> str:
    assert old in TEXT, old
    return TEXT.replace(old, new, 1)


def test_the_checkers_catch_seeded_faults(tmp_path, monkeypatch):
    # a misspelt flag, a disk in another zone, a v6e VM on a persistent disk, a runtime for another chip
    assert any("--acelerator-type" in p for p in gcloud_problems(seeded("--accelerator-type=v5p-8",
                                                                         "--acelerator-type=v5p-8")))
    assert any("zone" in p for p in gcloud_problems(seeded("zones/$TRAIN_ZONE/disks", "zones/$SERVE_ZONE/disks")))
    assert any("takes" in p for p in gcloud_problems(seeded("--type=hyperdisk-balanced", "--type=pd-balanced")))
    assert any("--version=v2-alpha-tpuv6e" in p for p in gcloud_problems(seeded("--version=v2-alpha-tpuv6e",
                                                                                 "--version=v2-alpha-tpuv5")))
    assert any("never set" in p for p in gcloud_problems(seeded("export TRAIN_ZONE=", "export TRAINZONE=")))
    # a make target that does not exist
    assert make_problems(seeded("make tpu-venv", "make tpu-env"), (REPO / "Makefile").read_text())
    # a flag the course's parser does not take
    assert parse_error(["report", "--profile", "v5p-8", "--hardwares"])
    # a disk too small for the pre-flight, and the checkpoint grown past what the sizes allow
    assert disk_problems(seeded("--size=200GB", "--size=150GB"), tmp_path, monkeypatch)
    assert disk_problems(seeded("--size=100GB", "--size=80GB"), tmp_path, monkeypatch)
    monkeypatch.setitem(profiles.DOWNLOAD_BYTES_FALLBACK, "google/gemma-4-31B-it", 80 * 10**9)
    found = disk_problems(TEXT, tmp_path, monkeypatch)
    assert len(found) == 2 and "needs 160.0 GB" in found[0], found


@pytest.mark.parametrize("argv", [["report", "--profile", "smoke", "--hardware"], ["report", "--hardware"]])
def test_report_hardware_parses(argv):
    assert parse_error(argv) is None
