"""The course's own steps: solutions, site, demo, report (and report --hardware, the run's figures to paste back), and
badges (each notebook's "Open in Colab" badge and install URL from pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys

from ..config import profiles
from ..front import colab, exercises, logbook, site
from . import hardware_report
from .cli import Command, profile_argument, runs_argument

# ------------------------------------------------------------------------------------------------------ solutions


def solutions_arguments(p) -> None:
    p.add_argument("notebook", nargs="?", default=None, help="notebook number, e.g. 02 (default: all)")


def run_solutions(args) -> int:
    """The exercises' tasks and solutions, for teachers."""
    print(exercises.format_solutions(args.notebook))
    return 0


# ----------------------------------------------------------------------------------------------------------- site

def site_arguments(p) -> None:
    p.add_argument("--profile", default=None, help="the run's profile (default: $GEMMA_TPU_PROFILE, else smoke)")
    runs_argument(p)
    p.add_argument("--no-screenshot", action="store_true", help="skip the index screenshot (needs chromium)")


def run_site(args) -> int:
    """The course site: executed notebooks as HTML and an index, in runs/<profile>/site."""
    prof = profiles.get_profile(args.profile)
    run_dir = prof.run_dir(args.runs)
    if (run_dir / "figures.json").is_file():
        logbook.write_report(run_dir)
    result = site.build(run_dir)
    print(f"wrote {result['index']}: {result['pages']} pages, {result['bytes'] / 2**20:.1f} MiB")
    broken = site.broken_links(result["index"].parent)
    for b in broken:
        print(f"broken link: {b}", file=sys.stderr)
    if not args.no_screenshot and site.find_chromium():
        try:
            print(f"screenshot: {site.screenshot(result['index'], run_dir / site.SCREENSHOT)}")
        except (site.SiteError, subprocess.TimeoutExpired) as e:
            print(f"screenshot skipped: {e}", file=sys.stderr)
    return 1 if broken else 0


# ----------------------------------------------------------------------------------------------------------- demo

def demo_arguments(p) -> None:
    profile_argument(p)
    runs_argument(p)


def run_demo(args) -> int:
    """Run every notebook in order under the profile; executed copies and report.md go to runs/<profile>/."""
    prof = profiles.get_profile(args.profile)
    run_dir = prof.run_dir(args.runs)
    results = logbook.run_notebooks(prof.name, run_dir)
    for r in results:
        print(f"{r['notebook']:28s} {r['seconds']:7.1f} s  {r['error'] or 'ok'}")
    print(logbook.write_report(run_dir))
    return 1 if any(r["error"] for r in results) else 0


def report_arguments(p) -> None:
    profile_argument(p)
    runs_argument(p)
    p.add_argument("--hardware", action="store_true",
                   help="the run's figures to paste back from real hardware: versions, devices, the clean step time, "
                        "peak HBM, the merge's seconds, the serving sweep and pass@1, each missing one with the step "
                        f"that makes it (also in runs/<profile>/{hardware_report.REPORT})")


def run_report(args) -> int:
    """Write runs/<profile>/report.md from the figures the notebooks recorded; with --hardware, print the run's
    figures as a markdown block to paste, and write it to runs/<profile>/hardware_report.md."""
    prof = profiles.get_profile(args.profile)
    if args.hardware:
        text, path = hardware_report.write_report(prof, prof.run_dir(args.runs))
        print(text)
        print(f"(also in {path}: paste the block above into your report to the course, docs/tpu-vm.md step 11)")
        return 0
    print(logbook.write_report(prof.run_dir(args.runs)))
    return 0


# --------------------------------------------------------------------------------------------------------- badges

def badges_arguments(p) -> None:
    p.add_argument("--repo", default=None, help="the course's GitHub URL (default: [project.urls] Repository in "
                   "pyproject.toml)")
    p.add_argument("--branch", default="main", help="the branch the badges open (default: main)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a notebook differs")


def run_badges(args) -> int:
    """Write each notebook's "Open in Colab" badge and its install cell's REPO_URL (after publishing the course)."""
    changed = colab.write_badges(repo=args.repo, branch=args.branch, check=args.check)
    verb = "would change" if args.check else "wrote"
    print(f"{verb} {len(changed)} notebook(s){': ' + ', '.join(changed) if changed else ''}")
    return 1 if args.check and changed else 0


COMMANDS = (
    Command("solutions", "workshop: the exercises' tasks and solutions, for teachers (e.g. solutions 02)",
            solutions_arguments, run_solutions),
    Command("site", "the course site: executed notebooks as HTML + an index, in runs/<profile>/site",
            site_arguments, run_site),
    Command("demo", "run all notebooks in order (executed copies + report.md in runs/<profile>/)", demo_arguments,
            run_demo),
    Command("report", "write runs/<profile>/report.md from the recorded figures; --hardware: the run's figures to "
            "paste back from real hardware", report_arguments, run_report),
    Command("badges", "write each notebook's Open-in-Colab badge and install URL from pyproject.toml's repository "
            "(--check: only compare)", badges_arguments, run_badges),
)
