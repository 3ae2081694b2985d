"""The course site: every executed notebook of a run as HTML, plus an index (``make site``, run by ``make demo``).

``build(run_dir)`` writes ``run_dir/site/``: one page per notebook in ``run_dir/executed/`` and ``index.html`` with
the course map and the run report. The site works offline (relative links, no CDN scripts), so a teacher can zip it
and hand it out. Headless Chromium checks pages in a real browser and takes the index's screenshot.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from ...fixes.core import file_io
from ...fixes.core.errors import GemmaTpuError
from ..config import paths
from .colab import BADGE_ID
from .logbook import COURSE

SITE_DIR = "site"
DOCS = "docs"  # the checkout's docs/*.md the notebooks link to (../docs/X.md), copied into the site
INDEX = "index.html"
SCREENSHOT = "site_index.png"  # in the run dir, next to site/ (not handed out with it)
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars")
BROWSER_TIMEOUT_S = 120
VIRTUAL_TIME_MS = 5000  # --virtual-time-budget: let the page load and its scripts run before dumping / capturing
WINDOW = (1280, 1600)
# scripts nbconvert's lab template loads from the network: removed, so that the site works offline
_REMOTE_SCRIPT = re.compile(r"<script[^>]*\ssrc=\"https?://[^\"]*\"[^>]*>\s*</script>", re.I)
_HREF = re.compile(r"""\b(?:href|src)=["']([^"']+)["']""", re.I)

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 72rem; padding: 0 1rem; color: #222; }
table { border-collapse: collapse; margin: 1rem 0; font-size: 0.92rem; }
th, td { border: 1px solid #ccc; padding: 0.3rem 0.6rem; text-align: left; vertical-align: top; }
th { background: #f0f3f7; }
.missing { color: #888; }
.error { color: #b00020; }
.report { border-top: 1px solid #ccc; margin-top: 2rem; }
nav.gt-nav { font: 14px system-ui, sans-serif; padding: 0.5rem 1rem; background: #f0f3f7; \
border-bottom: 1px solid #ccc; }
nav.gt-nav a { margin-right: 1.2rem; }
"""


class SiteError(GemmaTpuError, RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------- pages


def notebook_title(nb) -> str | None:
    """The text of the notebook's first ``# `` heading (None when it has none)."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return None


def _nav(stem: str, stems: list[str]) -> str:
    i = stems.index(stem)
    links = [f'<a href="{INDEX}">Course index</a>']
    if i > 0:
        links.append(f'<a href="{stems[i - 1]}.html">&larr; {html.escape(stems[i - 1])}</a>')
    if i + 1 < len(stems):
        links.append(f'<a href="{stems[i + 1]}.html">{html.escape(stems[i + 1])} &rarr;</a>')
    return f'<nav class="gt-nav">{"".join(links)}</nav>'


def notebook_html(nb, title: str, nav: str = "", stems: list[str] = ()) -> str:
    """One executed notebook as a standalone, offline HTML page (nbconvert lab template, remote scripts removed).

    Links to ``X.ipynb`` among ``stems`` point to ``X.html``, links to ``../docs/`` to the site's copy of the docs;
    the "Open in Colab" badge (a notebook's first cell, on GitHub) is left out: it needs the network."""
    import copy

    from nbconvert import HTMLExporter

    nb = copy.deepcopy(nb)
    nb.cells = [c for c in nb.cells if c.get("id") != BADGE_ID]
    nb.metadata.pop("widgets", None)  # no widget manager from a CDN: widgets fall back to their text output
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb, resources={"metadata": {"name": title}})
    body = _REMOTE_SCRIPT.sub("", body)
    for stem in stems:
        body = body.replace(f'href="{stem}.ipynb', f'href="{stem}.html')
    body = body.replace('href="../docs/', f'href="{DOCS}/')
    nav_css = "<style>" + "\n".join(line for line in STYLE.splitlines() if line.startswith("nav.gt-nav")) + "</style>"
    body = body.replace("</head>", nav_css + "</head>", 1)
    return re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + nav, body, count=1)


# ---------------------------------------------------------------------------------------------- index


def _run_times(run_dir: Path) -> dict[str, str]:
    path = run_dir / "figures.json"
    try:
        return {k: str(v) for k, v in json.loads(path.read_text()).get("demo", {}).items()}
    except (OSError, json.JSONDecodeError):
        return {}


def _markdown(text: str) -> str:
    import mistune  # nbconvert's own markdown renderer

    return mistune.create_markdown(plugins=["table"], escape=True)(text)


def index_html(run_dir: Path, pages: dict[str, str], generated: str) -> str:
    """The index: the course map with a link per notebook, extra notebooks, and the run report."""
    times = _run_times(run_dir)
    rows = []
    for nb, fix, mods, cpu, tpu in COURSE:
        name = (f'<a href="{nb}.html" title="{html.escape(pages[nb])}">{html.escape(nb)}</a>' if nb in pages
                else f'<span class="missing">{html.escape(nb)} (not run)</span>')
        ran = times.get(nb, "")
        cls = ' class="error"' if ran and not ran.endswith(" s") else ""
        rows.append(f"<tr><td>{name}</td><td>{html.escape(fix)}</td><td>{html.escape(mods)}</td>"
                    f"<td>{html.escape(cpu)}</td><td>{html.escape(tpu)}</td><td{cls}>{html.escape(ran)}</td></tr>")
    known = {c[0] for c in COURSE}
    extra = [s for s in pages if s not in known]
    extra_html = ("<h2>Other notebooks</h2><ul>" + "".join(
        f'<li><a href="{s}.html">{html.escape(pages[s])}</a></li>' for s in extra) + "</ul>") if extra else ""
    report = run_dir / "report.md"
    # the report's own "# title" line is dropped: the section heading above says what it is
    report_text = re.sub(r"\A# [^\n]*\n", "", report.read_text()) if report.is_file() else ""
    report_html = _markdown(report_text) if report_text.strip() else "<p>No report yet (make demo).</p>"
    profile = run_dir.name
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>gemma-tpu course: {html.escape(profile)}</title>
<style>{STYLE}</style></head>
<body>
<h1>gemma-tpu course: {html.escape(profile)}</h1>
<p>LoRA fine-tuning Gemma 4 31B on Cloud TPU, merged and served with vLLM: the notebooks of this run, executed
({len(set(pages) & known)} of {len(COURSE)} course notebooks), built {html.escape(generated)}. \
Open any page offline.</p>
<h2>Course map</h2>
<table class="course-map">
<thead><tr><th>notebook</th><th>the paper's fix</th><th>helpers</th><th>CPU (smoke)</th><th>TPU (est.)</th>
<th>this run</th></tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody></table>
{extra_html}
<div class="report"><h2>Run report</h2>
{report_html}</div>
</body></html>
"""


# ---------------------------------------------------------------------------------------------- build


def build(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> dict:
    """Write the site for ``run_dir`` (default ``run_dir/site``); returns {index, pages, bytes}.

    Built in a temporary directory beside the target and swapped in at the end, so a failed build leaves the old
    site as it was."""
    import nbformat

    run_dir = Path(run_dir)
    executed = sorted((run_dir / "executed").glob("*.ipynb"))
    if not executed:
        raise SiteError(f"No executed notebooks in {run_dir / 'executed'}: run `make demo` (or "
                        f"`python -m gemma_tpu_helpers demo --profile {run_dir.name}`) first.")
    out = Path(out_dir) if out_dir else run_dir / SITE_DIR
    tmp = file_io.temp_dir_beside(out)
    try:
        stems = [p.stem for p in executed]
        pages = {}
        for path in executed:
            nb = nbformat.read(path, as_version=4)
            title = notebook_title(nb) or path.stem
            pages[path.stem] = title
            file_io.write_atomic(tmp / f"{path.stem}.html", notebook_html(nb, title, _nav(path.stem, stems), stems))
        generated = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        file_io.write_atomic(tmp / INDEX, index_html(run_dir, pages, generated))
        shutil.copytree(paths.REPO / DOCS, tmp / DOCS, ignore=shutil.ignore_patterns("*.png", "*.svg"))
        for f in tmp.rglob("*"):  # mkstemp / mkdtemp make them private; a site is for sharing
            f.chmod(0o755 if f.is_dir() else 0o644)
        tmp.chmod(0o755)
        file_io.install_dir(tmp, out)  # a site is always rebuilt whole: replacing the old one is the point
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = [f for f in out.rglob("*") if f.is_file()]
    return {"index": out / INDEX, "pages": len(list(out.glob("*.html"))), "bytes": sum(f.stat().st_size for f in files)}


def broken_links(site_dir: str | os.PathLike) -> list[str]:
    """``page: href`` for every link or image that needs the network or points to a file that is not there.

    In-page anchors (``#...``) and ``data:`` URIs are fine; ``mailto:`` too."""
    site_dir = Path(site_dir)
    out = []
    for page in sorted(site_dir.glob("*.html")):
        for href in _HREF.findall(page.read_text(errors="replace")):
            if href.startswith(("#", "data:", "mailto:")):
                continue
            if re.match(r"^[a-z][a-z0-9+.-]*:", href, re.I):
                out.append(f"{page.name}: {href} (needs the network)")
                continue
            target = (page.parent / href.split("#", 1)[0].split("?", 1)[0]).resolve()
            if not target.exists():
                out.append(f"{page.name}: {href} (no such file)")
    return out


# ---------------------------------------------------------------------------------------------- browser


def find_chromium() -> str | None:
    """The path of a Chromium (Debian's ``chromium``) or Chrome binary; None when there is none."""
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _chromium(args: list[str], timeout: float = BROWSER_TIMEOUT_S) -> subprocess.CompletedProcess:
    exe = find_chromium()
    if not exe:
        raise SiteError("Chromium is not installed: `sudo apt-get install chromium` (make test does it).")
    with tempfile.TemporaryDirectory(prefix="gemma-tpu-chromium-") as profile_dir:
        argv = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile_dir}", *args]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise SiteError(f"chromium exited {r.returncode}: {r.stderr[-2000:]}")
    return r


def dump_dom(page: str | os.PathLike) -> str:
    """The DOM of ``page`` after it loaded and its scripts ran (headless Chromium ``--dump-dom``)."""
    url = Path(page).resolve().as_uri()
    return _chromium([f"--virtual-time-budget={VIRTUAL_TIME_MS}", "--dump-dom", url]).stdout


def screenshot(page: str | os.PathLike, png: str | os.PathLike, window: tuple[int, int] = WINDOW) -> Path:
    """A PNG of ``page`` as headless Chromium renders it."""
    png = Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    tmp = png.with_name(f".{png.name}.tmp.png")
    _chromium([f"--window-size={window[0]},{window[1]}", f"--virtual-time-budget={VIRTUAL_TIME_MS}",
               f"--screenshot={tmp}", Path(page).resolve().as_uri()])
    if not tmp.is_file():
        raise SiteError(f"chromium wrote no screenshot of {page}")
    os.replace(tmp, png)
    return png

