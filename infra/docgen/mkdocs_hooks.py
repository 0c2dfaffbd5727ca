"""MkDocs hooks (``mkdocs.yml``'s ``hooks:``): the site serves mermaid itself.

Material for MkDocs draws a ```` ```mermaid ```` block with the ``mermaid`` global when the
page defines one, and otherwise loads mermaid from a CDN. So every page that draws a
diagram gets ``<script src=".../assets/vendor/mermaid.min.js">`` in its ``<head>``, before
Material's bundle looks for it; the file is the pinned build ``infra/docgen/vendor.py``
keeps (fetched from npm once). Pages without a diagram load nothing extra.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.utils import get_relative_url

from infra.docgen import vendor

DIAGRAM = 'class="mermaid"'  # what pymdownx.superfences' mermaid fence renders
_mermaid: Path | None = None


def on_config(config):
    global _mermaid
    try:
        _mermaid = vendor.ensure_mermaid()
    except vendor.VendorError as exc:
        raise PluginError(str(exc)) from None
    return config


def on_files(files: Files, config) -> Files:
    assert _mermaid is not None
    files.append(File.generated(config, vendor.SITE_PATH, abs_src_path=str(_mermaid)))
    return files


def on_post_page(output: str, page, config) -> str:
    return with_mermaid(output, page.url)


def with_mermaid(html: str, page_url: str) -> str:
    """The page's HTML, loading mermaid in its head when it draws a diagram."""
    if DIAGRAM not in html:
        return html
    src = get_relative_url(vendor.SITE_PATH, page_url)
    return html.replace("</head>", f'<script src="{src}"></script>\n</head>', 1)
