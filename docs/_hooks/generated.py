"""MkDocs hook: pages generated from the code at build time, so they cannot drift from it. A page holding the marker
``<!-- generated: config-reference -->`` gets the configuration reference (`hybridflow.engine.config.reference`)."""

from __future__ import annotations

MARKER = "<!-- generated: config-reference -->"


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (MkDocs' hook signature)
    if MARKER not in markdown:
        return markdown
    from hybridflow.engine.config.reference import config_reference

    return markdown.replace(MARKER, config_reference())
