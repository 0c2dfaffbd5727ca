"""The docs site (issue 36): `mkdocs build --strict` passes (no broken link or anchor, no
nav entry without its page, no page outside the nav), and no page loads a script, a
style sheet, a font or an image from outside the site: mermaid diagrams are drawn by the
site's own pinned copy, which a headless browser proves by drawing one offline."""

from __future__ import annotations

import functools
import hashlib
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import pytest

from infra.docgen import mkdocs_hooks, vendor

ROOT = Path(__file__).resolve().parents[2]
LOADS = {  # tag -> the attributes whose URL the browser fetches by itself
    "script": ("src",),
    "img": ("src", "srcset"),
    "iframe": ("src",),
    "source": ("src", "srcset"),
    "video": ("src", "poster"),
    "audio": ("src",),
    "embed": ("src",),
    "object": ("data",),
    "input": ("src",),
}
NAVIGATION = {"alternate", "canonical", "next", "prev", "search", "author", "license"}
CSS_URL = re.compile(r"""(?:url\(\s*['"]?|@import\s+['"])([^'")\s]+)""")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built strict into a temporary directory."""
    if not vendor.mermaid_path().exists() and shutil.which("npm") is None:
        pytest.skip(
            f"mermaid {vendor.MERMAID_VERSION} not fetched and npm not on PATH (Debian: apt-get install npm)"
        )
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    argv = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"`just docs-build` fails:\n{done.stdout}{done.stderr}"
    return out


class Fetches(HTMLParser):
    """Every URL a page makes the browser fetch: scripts, style sheets, fonts, images."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self._style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "link" and not set(a.get("rel", "").split()) <= NAVIGATION:
            self.urls.append(a.get("href", ""))
        for name in LOADS.get(tag, ()):
            if name in a:
                self.urls += [part.split()[0] for part in a[name].split(",") if part.strip()]
        if "style" in a:
            self.urls += CSS_URL.findall(a["style"])
        self._style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self._style = False

    def handle_data(self, data: str) -> None:
        if self._style:
            self.urls += CSS_URL.findall(data)


def fetches(page: Path) -> list[str]:
    parser = Fetches()
    parser.feed(page.read_text())
    return [u for u in parser.urls if u]


def outside(url: str) -> bool:
    """A URL the browser fetches from another host (``data:`` carries its own bytes)."""
    return urlsplit(url).scheme not in ("", "data") or url.startswith("//")


def test_the_site_builds_strict_and_has_every_page(site):
    pages = {p.relative_to(site).as_posix() for p in site.rglob("index.html")}
    for want in ("reference/cli/", "reference/subjects/", "benchmarks/", "benchmarks/history/"):
        assert f"{want}index.html" in pages, sorted(pages)


def test_no_page_loads_anything_from_outside_the_site(site):
    bad, missing = [], []
    for page in sorted(site.rglob("*.html")):
        for url in fetches(page):
            if url.startswith("data:"):
                continue
            if outside(url):
                bad.append(f"{page.relative_to(site)}: {url}")
                continue
            path = urlsplit(url).path  # 404.html's are from the site's root
            target = site / path.lstrip("/") if path.startswith("/") else page.parent / path
            if not target.exists():
                missing.append(f"{page.relative_to(site)}: {url}")
    assert not bad, "pages fetching from outside the site:\n" + "\n".join(bad)
    assert not missing, "pages loading what the site lacks:\n" + "\n".join(missing)


def test_no_style_sheet_loads_a_font_or_anything_from_elsewhere(site):
    bad = [
        f"{css.relative_to(site)}: {url}"
        for css in site.rglob("*.css")
        for url in CSS_URL.findall(css.read_text())
        if outside(url)
    ]
    assert not bad, "\n".join(bad)


def test_a_page_with_a_diagram_loads_the_sites_own_mermaid_first(site):
    drawn = [p for p in site.rglob("*.html") if mkdocs_hooks.DIAGRAM in p.read_text()]
    assert drawn, "no page draws a diagram (reference/subjects.md draws the session states)"
    for page in drawn:
        scripts = [u for u in fetches(page) if u.endswith(".js")]
        ours = [u for u in scripts if u.endswith(vendor.SITE_PATH)]
        assert ours, f"{page} draws a diagram without {vendor.SITE_PATH}"
        bundle = next(u for u in scripts if "/bundle." in u)
        assert scripts.index(ours[0]) < scripts.index(bundle), "mermaid must be there first"
        served = (page.parent / ours[0]).resolve().read_bytes()
        assert hashlib.sha256(served).hexdigest() == vendor.MERMAID_SHA256


def test_pages_without_a_diagram_load_no_mermaid():
    page = "<html><head><title>t</title></head><body><p>no diagram</p></body></html>"
    assert mkdocs_hooks.with_mermaid(page, "reference/cli/") == page
    drawn = page.replace("<p>", '<pre class="mermaid"><code>graph LR; a-->b</code></pre><p>')
    got = mkdocs_hooks.with_mermaid(drawn, "reference/cli/")
    assert '<script src="../../assets/vendor/mermaid.min.js"></script>\n</head>' in got


def test_a_fetched_mermaid_that_is_not_the_pinned_build_is_refused(tmp_path):
    vendor.mermaid_path(tmp_path).write_bytes(b"console.log('not mermaid')")
    with pytest.raises(vendor.VendorError, match="not mermaid"):
        vendor.ensure_mermaid(tmp_path)


def test_nothing_points_at_the_benchmarks_page_that_moved():
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    old = "docs/" + "benchmarks.md"  # docs/benchmarks/index.md and history.md now
    stale = [f for f in files if f.endswith((".py", ".md", ".yml", ".yaml", "justfile"))
             and (ROOT / f).is_file() and old in (ROOT / f).read_text(errors="replace")]  # fmt: skip
    assert not stale, f"{old} moved to docs/benchmarks/: fix {stale}"


@functools.cache
def _browser_missing() -> str | None:
    from tests.helpers.browser import CHROMIUM, DRIVER

    if not (CHROMIUM and DRIVER):
        return "needs chromium and chromium-driver (`just setup` installs them as root)"
    return None


def test_a_browser_draws_the_diagram_with_nothing_from_outside(site):
    if reason := _browser_missing():
        pytest.skip(reason)
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.helpers.browser import new_browser

    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    browser = new_browser()
    try:
        browser.get(urljoin(base, "reference/subjects/"))
        # Material swaps the block for a <div class="mermaid"> holding the drawn SVG (in
        # a closed shadow root) once mermaid.render has drawn it: a drawing, not an error
        drawn = WebDriverWait(browser, 30).until(
            lambda b: b.find_elements(By.CSS_SELECTOR, "div.mermaid")
        )
        assert drawn[0].size["height"] > 100, drawn[0].size
        loaded = browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
        )
    finally:
        browser.quit()
        server.shutdown()
    assert any(u.endswith(vendor.SITE_PATH) for u in loaded), loaded
    assert [u for u in loaded if not u.startswith(base)] == []


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def test_the_offline_check_sees_a_cdn_script_a_web_font_and_a_remote_image(tmp_path):
    page = tmp_path / "p.html"
    page.write_text(
        '<html><head><link rel="stylesheet" href="https://fonts.googleapis.com/css?f=R">'
        '<link rel="preconnect" href="https://fonts.gstatic.com"><link rel="canonical" '
        'href="https://example.org/p"><script src="https://unpkg.com/mermaid@11"></script>'
        '<style>@font-face{src:url("https://cdn.example/f.woff2")}</style></head><body>'
        '<img src="//cdn.example/i.png"><a href="https://example.org">a link</a></body></html>'
    )
    assert [u for u in fetches(page) if outside(u)] == [
        "https://fonts.googleapis.com/css?f=R",
        "https://fonts.gstatic.com",
        "https://unpkg.com/mermaid@11",
        "https://cdn.example/f.woff2",
        "//cdn.example/i.png",
    ]
