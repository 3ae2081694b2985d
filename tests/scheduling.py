"""The test suite's own pytest plugin (registered by conftest.py): the order of the work on two xdist workers, the
garbage collector's tuning for the workers, and the run's last line about what was skipped."""

import gc
import importlib.util
from pathlib import Path

# A full garbage collection walks a test worker's whole heap (JAX, tunix, transformers, torch and the session's
# fixtures: over a million objects, 0.2-0.5 s each) and finds almost nothing: one after every 100 collections of the
# middle generation instead of every 10. tests/fast on two workers: 60 full collections taking 20.6 s -> 23 taking
# 11.9 s. The processes the tests start (the CLI, vLLM) keep Python's defaults.
gc.set_threshold(*gc.get_threshold()[:2], 100)


# `make test` runs the suite on two pytest-xdist workers. Each module stays on one worker, so a module fixture (a
# training run, a vLLM server) runs once, and the modules of a group run one after another on one worker:
# - "processes": the modules that start the most processes (vLLM servers, the documented CLI commands one after
#   another), so that two such bursts never meet on 24 GiB;
# - "smoke_run": the modules that read conftest's smoke run (a session fixture is per worker: together, it trains
#   once).
GROUPS = {"processes": {"test_multihost", "test_serve", "test_bench", "test_user_paths"},
          "smoke_run": {"test_train", "test_resume", "test_merge", "test_colab_first_cells"}}


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: its module's group, or its module."""
    module = nodeid.split("::", 1)[0]
    return next((g for g, mods in GROUPS.items() if Path(module).stem in mods), module)


# The longest work units go first, so that neither worker is left with one of them at the end while the other idles.
FIRST = ("test_learn", "smoke_run", "processes")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        unit = work_unit(item.nodeid)
        name = unit if unit in GROUPS else Path(unit).stem
        return FIRST.index(name) if name in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: the order within a unit stays as collected


if importlib.util.find_spec("xdist"):  # the hook exists only with xdist; without it the suite runs in one process

    def pytest_xdist_make_scheduler(config, log):
        from xdist.scheduler import LoadScopeScheduling

        class ModulesAndGroups(LoadScopeScheduling):
            def _split_scope(self, nodeid):
                return work_unit(nodeid)

        config.option.loadscopereorder = False  # xdist would order the units by test count, not as FIRST says
        return ModulesAndGroups(config, log)


def skipped_line(reports) -> str | None:
    """One line for what a run skipped and why (a missing .venv-serve, Icarus, Chromium, libtpu): the count per
    reason, most first. None when nothing was skipped."""
    reasons = {}
    for r in reports:
        text = r.longrepr[2] if isinstance(r.longrepr, tuple) else str(r.longrepr)
        text = text.removeprefix("Skipped: ")
        reasons[text] = reasons.get(text, 0) + 1
    if not reasons:
        return None
    parts = [f"{n} x {why}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
    return f"skipped {sum(reasons.values())} tests: " + "; ".join(parts)


def pytest_unconfigure(config):
    """The run's last line names what it skipped and why, so a green `make check` on a machine without the serving
    venv, Icarus or Chromium does not pass for a full one."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or hasattr(config, "workerinput"):  # an xdist worker: the controller reports
        return
    line = skipped_line(reporter.stats.get("skipped", []))
    if line:
        reporter.write_line(line, yellow=True)
