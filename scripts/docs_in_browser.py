"""The documentation site as a reader's browser shows it: built with `mkdocs build --strict`, served on localhost,
and every page loaded in headless Chromium, which runs the theme's scripts. Each page must render (after its
scripts: its title heading, the navigation with every section), show something (its screenshot is not a blank
page), and load nothing from outside the site (an offline reader, an air-gapped cluster). Prints a table; exits 1
naming the pages that fail.

    apt-get install chromium                       # Debian's; or CHROMIUM=/path/to/chrome
    python scripts/docs_in_browser.py --out /tmp/docs-in-browser   # the screenshots land there

The static half of it (nothing loaded from outside the site) is also a test: tests/test_docs.py.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAV_SECTIONS = ("Start", "Guides", "Reference", "Recipes", "API reference")  # the navigation's, on every page
BLANK = 0.01  # a screenshot with less than this share of non-white pixels shows nothing
TOP_BAR = 80  # pixels: the theme's top bar on one line (56 at 1280 wide); twenty top-level pages wrapped it to 165


def chromium() -> str:
    found = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("google-chrome")
    if not found:
        sys.exit("error: no Chromium here: apt-get install chromium, or set CHROMIUM=/path/to/chrome")
    return found


def build_site(site: Path) -> None:
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=REPO,
                           capture_output=True, text=True)
    if built.returncode != 0:
        sys.exit(f"error: mkdocs build --strict failed:\n{built.stderr[-3000:]}")


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def outside_loads(html: str) -> list[str]:
    """What the page's scripts, styles and images load from another host (links a reader follows are not loads)."""
    loads = re.findall(r'<(?:script|img|iframe)\b[^>]*\bsrc="(https?://[^"]+)"', html)
    loads += re.findall(r'<link\b[^>]*\bhref="(https?://[^"]+)"', html)
    return loads


def in_browser(browser: str, url: str, screenshot: Path) -> tuple[str, float, int]:
    """The page's DOM after its scripts ran, the share of its screenshot's pixels that are not white, and the height
    of its top bar (the rows from the top whose left edge has about the bar's colour)."""
    from PIL import Image

    common = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
              "--window-size=1280,1600", "--virtual-time-budget=3000"]
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    subprocess.run([*common, f"--screenshot={screenshot}", url], capture_output=True, timeout=120, check=True)
    with Image.open(screenshot) as image:
        grey = image.convert("L")
        inked = sum(count for value, count in enumerate(grey.histogram()) if value < 240)
        rgb = image.convert("RGB")
        blue = rgb.getpixel((4, 0))  # the bar's colour, a gradient downwards: the page below it is far from it
        bar = next((y for y in range(rgb.height)
                    if sum(abs(a - b) for a, b in zip(rgb.getpixel((4, y)), blue)) > 150), rgb.height)
        return dom, inked / (grey.width * grey.height), bar


def check_page(html: str, dom: str, inked: float, bar: int) -> list[str]:
    problems = [f"loads {url}" for url in outside_loads(html)]
    if not re.search(r"<h1\b", dom):
        problems.append("no title heading after its scripts ran")
    problems += [f"no {section!r} in its navigation" for section in NAV_SECTIONS if section not in dom]
    if bar > TOP_BAR:
        problems.append(f"its top bar is {bar} pixels high (more than one line)")
    if inked < BLANK:
        problems.append(f"its screenshot is blank ({inked:.1%} of the pixels not white)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs-in-browser"), help="where the screenshots go")
    args = parser.parse_args(argv)
    browser = chromium()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        site = Path(scratch) / "site"
        build_site(site)
        server, base = serve(site)
        failures = 0
        print("| page | non-white pixels | top bar | headings | code blocks | problems |\n|---|---|---|---|---|---|")
        try:
            for page in sorted(site.rglob("index.html")):
                relative = page.parent.relative_to(site).as_posix().removeprefix(".")
                if relative.startswith(("search", "css", "js")):
                    continue
                name = relative or "home"
                url = f"{base}/{relative}/" if relative else f"{base}/"
                dom, inked, bar = in_browser(browser, url, args.out / f"{name.replace('/', '_')}.png")
                problems = check_page(page.read_text(), dom, inked, bar)
                failures += bool(problems)
                headings, code_blocks = len(re.findall(r"<h[1-3]\b", dom)), dom.count('class="highlight"')
                print(f"| {name} | {inked:.1%} | {bar} px | {headings} | {code_blocks} |"
                      f" {'; '.join(problems) or 'none'} |")
        finally:
            server.shutdown()
    if failures:
        print(f"error: {failures} page(s) failed in the browser (screenshots: {args.out})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
