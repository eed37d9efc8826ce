"""MkDocs hook: the recipes as pages of the site, and links from a page to repository files outside docs/.

The recipes' READMEs (recipes/README.md and recipes/<name>/README.md) become the site's pages recipes/index.md and
recipes/<name>.md, read from the repository as they are (one source, rendered on GitHub and here). A link to one of
them, from any page, goes to its page; a link from one of them is read from where its README is.

On GitHub relative links work as written. The site holds only docs/ and the recipes' pages, so MkDocs would report
links to other files (the README, a recipe's YAML, BENCHMARKS.md) as missing: here each one is checked to exist in
the repository (a missing one is a warning, which fails the strict build) and becomes a link into the repository's
web view when `repo_url` is set, else the link text with the file's path.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.repository_links")
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def on_files(files, config):
    """The recipes' READMEs, added as pages under recipes/."""
    from mkdocs.structure.files import File

    repository = Path(os.path.abspath(config.docs_dir)).parent
    for readme, page in recipe_pages(repository).items():
        files.append(File.generated(config, page, abs_src_path=str(readme)))
    return files


def recipe_pages(repository: Path) -> dict[Path, str]:
    """{a recipe README: its page's path in the site}."""
    recipes = repository / "recipes"
    pages = {recipes / "README.md": "recipes/index.md"}
    pages.update({readme: f"recipes/{readme.parent.name}.md" for readme in sorted(recipes.glob("*/README.md"))})
    return pages


def on_page_markdown(markdown, page, config, files):
    docs = Path(os.path.abspath(config.docs_dir))
    repository = docs.parent
    pages = recipe_pages(repository)
    source = Path(page.file.abs_src_path)  # where the page's relative links are read from (a recipe: its README)
    site_dir = (docs / page.file.src_uri).parent  # where the page is in the site

    def rewrite(match: re.Match) -> str:
        text, target = match.groups()
        if "://" in target or target.startswith(("#", "mailto:")):
            return match.group(0)
        location, hash_, anchor = target.partition("#")
        path = Path(os.path.normpath(source.parent / location))  # symbolic links stay as they are
        if path.is_dir() and (path / "README.md") in pages:
            path = path / "README.md"  # a recipe's folder: its README, as GitHub shows it
        if path in pages:  # a recipe: its page
            return f"[{text}]({os.path.relpath(docs / pages[path], site_dir)}{hash_}{anchor})"
        if path == docs or docs in path.parents:  # a page of the site, from where this page is: MkDocs checks it
            return f"[{text}]({os.path.relpath(path, site_dir)}{hash_}{anchor})" if path.exists() else match.group(0)
        where = path.relative_to(repository).as_posix() if repository in path.parents else str(path)
        if not path.exists():
            log.warning(f"Doc file '{page.file.src_uri}' links to '{target}': {where} is not in the repository")
            return text
        if config.repo_url:
            return f"[{text}]({config.repo_url.rstrip('/')}/blob/main/{where})"
        return f"`{where}`" if text.strip("`") == where else f"{text} (`{where}`)"

    return "".join(chunk if fenced else LINK.sub(rewrite, chunk) for chunk, fenced in _chunks(markdown))


def _chunks(markdown: str):
    """The page in pieces, each with whether it is a fenced code block (links there are code, not links)."""
    inside, chunk = False, []
    for line in markdown.splitlines(keepends=True):
        if line.lstrip().startswith("```") and not inside:
            yield "".join(chunk), False
            inside, chunk = True, [line]
        elif line.lstrip().startswith("```") and inside:
            yield "".join(chunk) + line, True
            inside, chunk = False, []
        else:
            chunk.append(line)
    yield "".join(chunk), inside
