"""The report's markdown as a self-contained HTML page (`report.html`): headings, lists, tables, paragraphs and the
report's own PNG plots inlined. Text from run directories reaches it already escaped by the report
(`mhgpo.run.report.md_text`); this module escapes everything else it writes and inlines only the images it is
given, by name."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

_IMAGE = re.compile(r"^!\[([^\]]*)\]\(([A-Za-z0-9_]+\.png)\)$")


def to_html(markdown: str, images: dict[str, Path]) -> str:
    """A self-contained page: the markdown's headings, lists, tables and paragraphs; an image line is inlined only
    when it names one of `images` (the plots written for this report, by file name)."""
    files = {Path(p).name: Path(p) for p in images.values()}
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>mhgpo report</title><style>"
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto;line-height:1.4}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "td:first-child{text-align:left}img{max-width:100%}code{background:#f4f4f4}</style></head><body>"
    ]
    table: list[list[str]] = []

    def flush() -> None:
        if table:
            head, *rest = table
            parts.append(
                "<table><tr>"
                + "".join(f"<th>{c}</th>" for c in head)
                + "</tr>"
                + "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rest)
                + "</table>"
            )
            table.clear()

    for line in markdown.splitlines():
        if line.startswith("|"):
            protected, literals = _protect(line.strip().strip("|"))
            cells = [c.strip() for c in protected.split("|")]
            if not all(set(c) <= {"-"} for c in cells):
                table.append([_format(c, literals) for c in cells])
            continue
        flush()
        image = _IMAGE.match(line)
        if image and image.group(2) in files:
            data = base64.b64encode(files[image.group(2)].read_bytes()).decode()
            parts.append(f"<img alt='{html.escape(image.group(1))}' src='data:image/png;base64,{data}'>")
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            parts.append(f"<h{level}>{_inline(line[level:].strip())}</h{level}>")
        elif line.startswith("- "):
            parts.append(f"<div>• {_inline(line[2:])}</div>")
        elif line.strip():
            parts.append(f"<p>{_inline(line)}</p>")
    flush()
    parts.append("</body></html>")
    return "\n".join(parts)


def _protect(text: str) -> tuple[str, list[str]]:
    """Set backslash-escaped characters apart (as numbered placeholders) so that no formatting rule sees them."""
    literals: list[str] = []

    def stash(m: re.Match) -> str:
        literals.append(m.group(1))
        return f"\x00{len(literals) - 1}\x00"

    return re.sub(r"\\(.)", stash, text.replace("\x00", "")), literals


def _format(text: str, literals: list[str]) -> str:
    text = html.escape(text)
    text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", text)
    text = re.sub(r"`(.+?)`", r"<code>\1</code>", text)
    text = re.sub(r"\*(.+?)\*", r"<i>\1</i>", text)
    return re.sub("\x00(\\d+)\x00", lambda m: html.escape(literals[int(m.group(1))]), text)


def _inline(text: str) -> str:
    return _format(*_protect(text))
