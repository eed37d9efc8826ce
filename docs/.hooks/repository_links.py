"""MkDocs hook: links from a page to repository files outside docs/ (the README, recipes, BENCHMARKS.md).

On GitHub these relative links work as written. The site holds only docs/, so MkDocs would report them as missing;
here each one is checked to exist in the repository (a missing one is a warning, which fails the strict build) and
becomes a link into the repository's web view when `repo_url` is set, else the link text with the file's path.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.repository_links")
LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def on_page_markdown(markdown, page, config, files):
    docs = Path(os.path.abspath(config.docs_dir))
    repository = docs.parent
    page_dir = (docs / page.file.src_uri).parent

    def rewrite(match: re.Match) -> str:
        text, target = match.groups()
        if "://" in target or target.startswith(("#", "mailto:")):
            return match.group(0)
        path = Path(os.path.normpath(page_dir / target.split("#", 1)[0]))  # symbolic links stay as they are
        if path == docs or docs in path.parents:
            return match.group(0)  # a page of the site: MkDocs validates it
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
