"""The pieces of a self-contained HTML page: escaping, number formats, tables, figure cards and the
document with its style inline. Nothing here refers to anything outside the page (no script, no
stylesheet, font or image fetched), so it reads offline and as an e-mail attachment."""
from __future__ import annotations

import html
import json
import math

from jobrunner.common.durations import duration

__all__ = ["esc", "num", "pct", "seconds", "usd", "table", "cards", "section", "figures", "value_text", "document"]

_CSS = """
body{font-family:-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:0;color:#1f2933;background:#f5f7fa}
main{max-width:1100px;margin:0 auto;padding:16px 24px 48px}
header{background:#1f2933;color:#f5f7fa;padding:14px 24px}
header h1{margin:0;font-size:20px} header p{margin:4px 0 0;font-size:13px;color:#cbd2d9}
h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #cbd2d9;padding-bottom:4px}
h3{font-size:14px;margin:16px 0 6px}
.status{display:inline-block;padding:1px 8px;border-radius:9px;font-size:12px;margin-left:8px;vertical-align:middle}
.ok{background:#2f8132;color:#fff} .warn{background:#c77c02;color:#fff} .bad{background:#b3261e;color:#fff}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(190px,1fr));gap:10px;margin:14px 0}
.card{background:#fff;border-radius:6px;padding:10px 12px;box-shadow:0 1px 2px rgba(0,0,0,.08)}
.card .k{font-size:11px;text-transform:uppercase;letter-spacing:.04em;color:#616e7c}
.card .v{font-size:20px;font-weight:600;margin-top:2px} .card .n{font-size:12px;color:#616e7c;margin-top:2px}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:12px}
figure{background:#fff;margin:0;padding:8px;border-radius:6px;box-shadow:0 1px 2px rgba(0,0,0,.08)}
svg.plot{width:100%;height:auto;display:block}
table{border-collapse:collapse;background:#fff;font-size:13px;margin:6px 0 12px}
th,td{padding:4px 10px;border-bottom:1px solid #e4e7eb;text-align:left;vertical-align:top}
th{background:#e4e7eb;font-weight:600} td.n{text-align:right;font-variant-numeric:tabular-nums}
td pre{margin:0;white-space:pre-wrap;word-break:break-word;font-size:12px;max-width:720px}
p.note{font-size:12px;color:#616e7c}
"""


def esc(value) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def num(v, digits: int = 4) -> str:
    """A figure as the page shows it: integers with thousands separators, floats to `digits`
    significant digits, None as an en dash."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "\u2013"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 10 ** digits else f"{v:.{digits}g}"
    return str(v)


def pct(v) -> str:
    return "\u2013" if v is None else f"{v:.1%}"


def seconds(v) -> str:
    """12.3 s, 4 min 05 s, 2 h 03 min; milliseconds under a second."""
    if v is None:
        return "\u2013"
    return f"{v * 1000:.3g} ms" if v < 1 else duration(v)


def usd(v) -> str:
    if v is None:
        return "\u2013"
    return f"${v:,.2f}" if v >= 1 else f"${v:.4f}" if v >= 0.01 else f"${v:.6f}"


def table(headers: list[str], rows: list[list], numeric: set[int] = frozenset()) -> str:
    """A table; numeric: the columns (by index) aligned right. Cells are escaped; a cell given as
    ("pre", text) is shown preformatted."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = []
    for r in rows:
        cells = []
        for i, c in enumerate(r):
            if isinstance(c, tuple) and c[0] == "pre":
                cells.append(f"<td><pre>{esc(c[1])}</pre></td>")
            else:
                cells.append(f'<td class="n">{esc(c)}</td>' if i in numeric else f"<td>{esc(c)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def cards(items: list[tuple[str, str, str]]) -> str:
    """(name, value, note) figure cards in a grid."""
    return '<div class="cards">' + "".join(
        f'<div class="card"><div class="k">{esc(k)}</div><div class="v">{esc(v)}</div>'
        + (f'<div class="n">{esc(n)}</div>' if n else "") + "</div>" for k, v, n in items) + "</div>"


def section(title: str, body: str, anchor: str) -> str:
    return f'<section id="{esc(anchor)}"><h2>{esc(title)}</h2>{body}</section>'


def figures(svgs: list[str]) -> str:
    """Plots (inline SVG elements) side by side where the page is wide enough."""
    return '<div class="grid">' + "".join(f"<figure>{s}</figure>" for s in svgs if s) + "</div>"


def value_text(v) -> str:
    """A configuration value as text: JSON for lists and dicts, as is otherwise."""
    return json.dumps(v, ensure_ascii=False) if isinstance(v, (list, dict)) else num(v)


def document(title: str, subtitle: str, body: str, status: tuple[str, str] | None = None) -> str:
    """The whole page: title bar (with a status badge: (text, ok|warn|bad)), then body."""
    badge = f'<span class="status {status[1]}">{esc(status[0])}</span>' if status else ""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{esc(title)}</title>"
            f"<style>{_CSS}</style></head><body><header><h1>{esc(title)}{badge}</h1><p>{esc(subtitle)}</p></header>"
            f"<main>{body}</main></body></html>\n")
