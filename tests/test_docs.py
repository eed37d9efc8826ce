"""The documentation: README.md as the entry point, docs/ built as a site in strict mode (a broken link or a missing
page fails the build), and every relative link of the README, the pages and the recipes pointing at a file, and a
heading, that exists."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PRESETS = sorted(p.stem for p in (REPO / "lightning_dist" / "conf" / "strategy").glob("*.yaml"))


def markdown_files() -> list[Path]:
    """README.md, docs/, the recipes, and every other Markdown file of the repository (BENCHMARKS.md, the configs'
    sources): what a reader can follow a link into."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"], cwd=REPO,
                            capture_output=True, text=True, check=True)
    return [REPO / name for name in listed.stdout.split()]


def outside_code(text: str) -> str:
    """The text without its fenced code blocks and code spans, whose brackets are code, not links."""
    text = re.sub(r"(?ms)^[ \t]*```.*?^[ \t]*```", "", text)
    return re.sub(r"`[^`\n]*`", "", text)


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub (and MkDocs' toc) give the page's headings: lower case, punctuation dropped, spaces to '-'."""
    headings = re.findall(r"(?m)^#{1,6} +(.+?) *$", outside_code(page.read_text()))
    return {re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-") for heading in headings}


def broken_links(page: Path) -> list[str]:
    """`page: target: what is wrong` for each relative link that points at no file, or at no heading of one."""
    broken = []
    for target in LINK.findall(outside_code(page.read_text())):
        if "://" in target or target.startswith("mailto:"):
            continue
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(REPO) if REPO in page.parents else page}: {target}"
        if not linked.exists():
            broken.append(f"{where}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
            broken.append(f"{where}: {linked.name} has no heading #{anchor}")
    return broken


def mkdocs_build(config_dir: Path, site: Path, repo_url: str | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "LIGHTNING_DIST_REPO_URL"}
    if repo_url:
        environment["LIGHTNING_DIST_REPO_URL"] = repo_url
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=config_dir, capture_output=True, text=True, timeout=120, env=environment)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as `mkdocs build --strict` makes it from this checkout, built once for the tests that read it."""
    path = tmp_path_factory.mktemp("site") / "site"
    built = mkdocs_build(REPO, path)
    assert built.returncode == 0, built.stderr
    assert "WARNING" not in built.stderr
    return path


def test_the_readme_is_an_entry_point_that_links_every_page():
    text = README.read_text()
    assert len(text) < 13_000  # the plain-Lightning example, runnable as written, is a third of it
    sections = re.findall(r"(?m)^## (.+)$", text)
    assert sections == ["The two commands", "Choose a strategy", "Three ways to use it",
                        "Check a run before you launch it", "Where the outputs go", "Documentation",
                        "When not to use this"]
    linked = {Path(target.partition("#")[0]).name for target in LINK.findall(text) if target.startswith("docs/")}
    assert linked == {page.name for page in DOCS.glob("*.md")} - {"index.md"}


def test_every_preset_is_in_the_readmes_table_and_on_the_strategies_page():
    choose = README.read_text().split("## Choose a strategy", 1)[1].split("\n## ", 1)[0]
    assert [name for name in PRESETS if f"`{name}`" not in choose] == []
    table = (DOCS / "strategies.md").read_text().split("\n\n| Hydra option", 1)[1].split("\n\n", 1)[0]
    documented = re.findall(r"(?m)^\| `(\w+)` \| `ld_(\w+)` \|", table)
    assert [name for name, lightning_name in documented if name != lightning_name] == []
    assert sorted(name for name, _ in documented) == [name for name in PRESETS if name not in ("auto_fit", "deepspeed")]


def test_no_relative_link_in_the_readme_the_pages_or_the_recipes_is_broken():
    pages = markdown_files()
    assert {README, DOCS / "strategies.md", REPO / "recipes" / "multi_node" / "README.md"} <= set(pages)
    assert [problem for page in pages for problem in broken_links(page)] == []


def test_the_link_checker_names_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Clusters: what to share, what to set\n")
    page = tmp_path / "page.md"
    page.write_text("[a](other.md#clusters-what-to-share-what-to-set) [b](other.md#nothing) [c](gone.md) "
                    "`[not a link](code.md)` [d](https://example.org/x)\n```\n[in code](code.md)\n```\n")
    assert broken_links(page) == [f"{page}: other.md#nothing: other.md has no heading #nothing",
                                  f"{page}: gone.md: no such file"]


def test_the_site_builds_in_strict_mode_with_every_page(site, tmp_path):
    pages = sorted(p.stem for p in DOCS.glob("*.md"))
    assert [name for name in pages if not (site / ("" if name == "index" else name) / "index.html").exists()] == []
    # The recipes are pages of the site, read from their READMEs; a page's link to one goes there, and a recipe's
    # links to the pages are read from where its README is.
    recipes = sorted(p.parent.name for p in (REPO / "recipes").glob("*/README.md"))
    assert [name for name in recipes if not (site / "recipes" / name / "index.html").exists()] == []
    assert (site / "recipes" / "index.html").exists()
    assert 'href="../recipes/finetune/"' in (site / "finetune" / "index.html").read_text()
    assert 'href="../../finetune/"' in (site / "recipes" / "hf_causal_lm" / "index.html").read_text()
    # A link into the repository outside docs/ becomes its path in the site (on GitHub it stays a link)...
    assert "README (<code>README.md</code>)" in (site / "index.html").read_text()
    # ... and a link into the repository's web view where the publisher says where that is.
    published = mkdocs_build(REPO, tmp_path / "published", repo_url="https://example.org/owner/lightning-dist")
    assert published.returncode == 0, published.stderr
    assert '<a href="https://example.org/owner/lightning-dist/blob/main/README.md">README</a>' in (
        tmp_path / "published" / "index.html").read_text()


def test_the_site_loads_nothing_from_outside_itself(site):
    """Read offline or on an air-gapped cluster, a page that loads a script or a style from a CDN waits on it and
    renders without it (the theme's highlight.js did). scripts/docs_in_browser.py loads every page in Chromium."""
    from scripts.docs_in_browser import outside_loads

    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 30
    assert {page.relative_to(site).as_posix(): outside_loads(page.read_text()) for page in pages
            if outside_loads(page.read_text())} == {}
    assert outside_loads('<script src="https://cdn.example/x.js"></script><a href="https://example.org">x</a>') == [
        "https://cdn.example/x.js"]  # a load is found; a link a reader follows is not a load
    assert 'class="highlight"' in (site / "getting-started" / "index.html").read_text()  # highlighted at build time


def test_the_api_reference_has_a_page_per_strategy_with_every_argument(site):
    """Rendered from the docstrings by mkdocstrings: an argument the docstring leaves out has no row in its table."""
    import inspect

    from lightning_dist import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

    for strategy, page in ((DDPStrategy, "ddp"), (FSDPStrategy, "fsdp"), (DeepSpeedStrategy, "deepspeed")):
        html = (site / "api" / page / "index.html").read_text()
        table = html.split(">Parameters:</span>", 1)[1].split("</table>", 1)[0]
        rows = set(re.findall(r'<tr class="doc-section-item">\s*<td>\s*<code>\**(\w+)</code>', table))
        arguments = set(inspect.signature(strategy.__init__).parameters) - {"self"}
        assert rows == arguments, (page, arguments - rows, rows - arguments)


# The public API (docs/releasing.md): what `lightning_dist` exports, the `__all__` of these modules, and the names
# the pages tell users to import from the others.
PUBLIC_MODULES = ("lightning_dist", "lightning_dist.callbacks", "lightning_dist.checkpoints", "lightning_dist.memory",
                  "lightning_dist.optim")
PUBLIC_NAMES = {"lightning_dist.dry_run": ("dry_run", "RankView"),
                "lightning_dist.models": ("GPTLanguageModel", "HFLanguageModel", "export", "generate", "load_model")}


def test_the_api_reference_documents_every_public_name_under_the_name_users_import(site):
    import importlib

    public = {name for module in PUBLIC_MODULES for name in importlib.import_module(module).__all__}
    public |= {name for names in PUBLIC_NAMES.values() for name in names}
    headings = {}  # name shown -> the page that documents it
    for page in sorted((site / "api").glob("*/index.html")):
        for shown in re.findall(r'<h2 id="lightning_dist\.[\w.]+" class="doc doc-heading">(.*?)</h2>',
                                page.read_text(), flags=re.S):
            headings[re.sub(r"<[^>]+>", " ", shown).split()[0]] = page.parent.name  # then its labels (dataclass)
    assert sorted(public - set(headings)) == []  # every public name has its entry...
    assert sorted(name for name in headings if "." in name) == []  # ... headed by its name, not its module path
    pages = {page.stem for page in (DOCS / "api").glob("*.md")}
    assert {f"api/{page}.md" for page in pages} <= set(re.findall(r"api/[\w-]+\.md", (REPO / "mkdocs.yml").read_text()))


def test_a_broken_link_fails_the_strict_build_naming_it(tmp_path):
    """The site's own pages (MkDocs' check) and files of the repository outside docs/ (our hook's)."""
    (tmp_path / "mkdocs.yml").write_text((REPO / "mkdocs.yml").read_text())
    shutil.copytree(DOCS, tmp_path / "docs")
    for name in ("README.md", "BENCHMARKS.md", "GPU.md", "recipes", "tests"):
        (tmp_path / name).symlink_to(REPO / name)
    with (tmp_path / "docs" / "install.md").open("a") as page:
        page.write("\n[gone](nowhere.md) and [gone too](../recipes/nowhere/README.md)\n")
    built = mkdocs_build(tmp_path, tmp_path / "site")
    assert built.returncode == 1
    assert "'install.md' contains a link 'nowhere.md', but the target is not found" in built.stderr
    assert "'install.md' links to '../recipes/nowhere/README.md': recipes/nowhere/README.md is not in the repository" in built.stderr
    assert "Aborted with 2 warnings in strict mode!" in built.stdout + built.stderr


def test_the_exit_code_table_is_the_codes_the_code_gives():
    """docs/faults.md's table against the constants `train.py` exits with, and every "exit N" the pages mention
    against the table (checkpoints.md once said 2 for a finished run's resume, which exits 0)."""
    import signal

    from lightning_dist.callbacks import PREEMPTED_EXIT_CODE
    from lightning_dist.lifecycle.exits import FAILED, FINISHED, REFUSED
    from lightning_dist.lifecycle.stop_signals import STOP_CODES
    from lightning_dist.run.resume import NothingLeftToTrain

    faults = (REPO / "docs" / "faults.md").read_text()
    table = dict(re.findall(r"^  \| (\d+) \| (.+) \|$", faults, flags=re.MULTILINE))
    assert sorted(map(int, table)) == [0, 1, 2, 75, 130]
    said = {code: table[str(code)] for code in (FINISHED, FAILED, REFUSED, PREEMPTED_EXIT_CODE)}
    assert "finished" in said[FINISHED] and "nothing left to train" in table[str(NothingLeftToTrain.exit_code)]
    assert said[FAILED].startswith("failed") and said[REFUSED].startswith("refused")
    for signum, code in STOP_CODES.items():
        assert signum.name in table[str(code)], (signum, code)
    assert STOP_CODES[signal.SIGTERM] == PREEMPTED_EXIT_CODE
    for page in sorted((REPO / "docs").glob("*.md")):
        for code in re.findall(r"\bexit(?:s| code)? (\d+)\b", page.read_text()):
            assert code in table or code == "137", f"{page.name}: exit {code} is not in the table"
