"""The course site: built from small executed notebooks (made here, not the course's), then opened in headless
Chromium from file://, where every image must load, every link resolve, and each page show its title and its
first table. A screenshot of the index stays in the run dir."""

import html
import json
import re
import shutil

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from gemma_tpu_helpers.course.front import colab, logbook, site
from support import REPO, run_cli

PLOT = """import matplotlib
matplotlib.use("module://matplotlib_inline.backend_inline")
import matplotlib.pyplot as plt
plt.plot([1, 3, 2])
plt.title("loss");"""
TABLE = 'import pandas as pd\npd.DataFrame({"step": [1, 2], "loss": [2.5, 1.9]})'
NOTEBOOKS = {  # stem -> (title, cells after the title)
    "00_setup": ("00 · Setup, in small", [TABLE, PLOT]),
    "01_mesh_setup": ("01 · A mesh, in small", [TABLE, "from tqdm.auto import tqdm\nfor _ in tqdm(range(3)): pass"]),
}
# injected into a copy of each page: what the browser sees, written into the DOM for --dump-dom to return
PROBE = """<script>
window.addEventListener("load", () => {
  const out = document.createElement("pre");
  out.id = "site-probe";
  const table = document.querySelector("table");
  out.textContent = JSON.stringify({
    images: [...document.images].map(i => ({src: i.getAttribute("src").slice(0, 40), \
ok: i.complete && i.naturalWidth > 0})),
    title: document.title,
    h1: [...document.querySelectorAll("h1")].map(h => h.textContent.replace("\\u00b6", "").trim()),
    table_rows: table ? table.rows.length : 0,
    table_text: table ? table.innerText : "",
    links: [...document.querySelectorAll("a[href]")].map(a => a.getAttribute("href")),
  });
  document.body.appendChild(out);
});
</script>"""


def _executed_run(tmp_path):
    run_dir = tmp_path / "runs" / "smoke"
    (run_dir / "executed").mkdir(parents=True)
    for stem, (title, cells) in NOTEBOOKS.items():
        # as the course's notebooks open: the Colab badge, then a title that links to a docs page
        badge = new_markdown_cell(colab.BADGE.format(url=colab.colab_url(stem, "https://github.com/acme/course")))
        badge["id"] = colab.BADGE_ID
        nb = new_notebook(cells=[badge, new_markdown_cell(f"# {title}\nA small notebook ([Colab](../docs/colab.md))."),
                                 *map(new_code_cell, cells)])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        NotebookClient(nb, timeout=120, kernel_name="python3").execute()
        nbformat.write(nb, run_dir / "executed" / f"{stem}.ipynb")
    logbook.record(run_dir, "demo", **{"00_setup": "3.1 s", "01_mesh_setup": "RuntimeError: boom"})
    logbook.write_report(run_dir)
    return run_dir


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    run_dir = _executed_run(tmp_path_factory.mktemp("site"))
    return run_dir, site.build(run_dir)


def test_build_writes_an_offline_page_per_notebook_and_an_index(built):
    run_dir, result = built
    out = run_dir / "site"
    assert result["index"] == out / "index.html" and result["pages"] == len(NOTEBOOKS) + 1
    assert sorted(p.name for p in out.iterdir()) == ["00_setup.html", "01_mesh_setup.html", "docs", "index.html"]
    index = (out / "index.html").read_text()
    for nb, *_ in logbook.COURSE:
        assert nb in index
    assert '<a href="00_setup.html"' in index and "02_lora_naming (not run)" in index
    assert "RuntimeError: boom" in index and "3.1 s" in index  # this run's times, from the report
    page = (out / "00_setup.html").read_text()
    assert "data:image/png;base64," in page and 'class="dataframe"' in page
    assert not re.search(r"<script[^>]*src=\"https?:", page + index), "no script from the network"
    # the badge needs the network (left out); ../docs/ links reach the site's copy of the checkout's docs
    assert "colab.research.google.com" not in page and 'href="docs/colab.md"' in page
    assert (out / "docs" / "colab.md").read_text() == (REPO / "docs" / "colab.md").read_text()
    assert site.broken_links(out) == []


def test_a_broken_link_is_reported(built, tmp_path):
    copy = tmp_path / "site"
    shutil.copytree(built[0] / "site", copy)
    (copy / "index.html").write_text('<a href="nowhere.html">x</a><img src="https://example.org/x.png">')
    assert site.broken_links(copy) == ["index.html: nowhere.html (no such file)",
                                       "index.html: https://example.org/x.png (needs the network)"]


def test_build_without_executed_notebooks_says_what_to_run(tmp_path):
    with pytest.raises(site.SiteError, match="make demo"):
        site.build(tmp_path / "runs" / "smoke")


def _probe(page):
    probed = page.with_name(f".probe-{page.name}")  # beside the page: relative links and images resolve the same
    probed.write_text(page.read_text().replace("</body>", PROBE + "</body>", 1))
    try:
        dom = site.dump_dom(probed)
    finally:
        probed.unlink()
    m = re.search(r'<pre id="site-probe">(.*?)</pre>', dom, re.S)
    assert m, f"the probe did not run in {page.name}: {dom[-500:]}"
    return json.loads(html.unescape(m.group(1)))


@pytest.mark.skipif(site.find_chromium() is None, reason="chromium is not installed (apt-get install chromium; "
                                                        "`make test` installs it)")
def test_every_page_in_headless_chromium(built):
    run_dir, result = built
    out = result["index"].parent
    titles = {"index": "gemma-tpu course: smoke", **{s: t for s, (t, _) in NOTEBOOKS.items()}}
    for stem, title in titles.items():
        seen = _probe(out / f"{stem}.html")
        assert title in seen["h1"], (stem, seen["h1"])
        assert seen["table_rows"] >= 2, f"{stem}: no first table"
        first_table = "notebook" if stem == "index" else "loss"
        assert first_table in seen["table_text"], (stem, seen["table_text"][:200])
        assert all(i["ok"] for i in seen["images"]), (stem, seen["images"])
        for href in seen["links"]:
            if href.startswith("#"):
                continue
            assert not re.match(r"^[a-z]+:", href), f"{stem}: {href} needs the network"
            assert (out / href.split("#")[0]).is_file(), f"{stem}: {href} does not resolve"
        if stem == "00_setup":
            assert len(seen["images"]) == 1, "the plot is on the page"
        if stem != "index":
            assert "index.html" in seen["links"]
    bad = out.parent / "bad-page" / "bad.html"  # the probe can fail: a missing image is seen as not loaded
    bad.parent.mkdir(exist_ok=True)
    bad.write_text("<html><head><title>t</title></head><body><h1>t</h1><img src='missing.png'></body></html>")
    assert _probe(bad)["images"] == [{"src": "missing.png", "ok": False}]
    png = site.screenshot(result["index"], run_dir / site.SCREENSHOT)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    print(f"screenshot of the index: {png}")


def test_site_command_builds_the_profile_s_site(built, tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(built[0] / "executed", runs / "smoke" / "executed")
    r = run_cli("site", "--profile", "smoke", "--runs", runs, "--no-screenshot")
    assert r.returncode == 0, r.stderr
    assert "3 pages" in r.stdout and (runs / "smoke" / "site" / "index.html").is_file()
    assert run_cli("site", "--profile", "smoke", "--runs", tmp_path / "empty").returncode == 2


def test_license_and_citation_for_reuse():
    import tomllib

    import yaml


    assert "Apache License\n                           Version 2.0" in (REPO / "LICENSE").read_text()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]  # SPDX, as setuptools wants
    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    paper = cff["preferred-citation"]
    assert cff["cff-version"] == "1.2.0" and cff["license"] == "Apache-2.0"
    assert paper["title"] == "Fine-Tuning and Serving Gemma 4 31B on Google Cloud TPU" and paper["year"] == 2026
    assert paper["identifiers"][0]["value"] == "arXiv:2605.25645" and paper["authors"][0]["family-names"] == "Kishnani"
