"""The report's plots: matplotlib figures drawn from the figures' dicts, each returned as an inline
SVG element (text kept as text, no metadata, no reference to anything outside it).

matplotlib is an optional extra (`jobrunner[report]`): `require()` says how to install it. Figures are
made with matplotlib.figure.Figure, never pyplot, so no global figure state outlives a call."""
from __future__ import annotations

import hashlib
import io
import re

INSTALL = "pip install 'jobrunner[report]'"
BLUE, ORANGE, GREY, RED = "#3b6ea8", "#e08a2c", "#9aa5b1", "#c0392b"
_STYLE = {"svg.fonttype": "none", "font.size": 9, "axes.spines.top": False, "axes.spines.right": False,
          "axes.titlesize": 10, "axes.titleweight": "bold"}

__all__ = ["INSTALL", "require", "histogram", "bars", "paired_bars", "confusion", "reliability", "progress"]


class MissingPlotLibrary(ImportError):
    """matplotlib is not installed; the message says how to install it."""


def require() -> None:
    """MissingPlotLibrary unless matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingPlotLibrary(f"the report's plots need matplotlib: {INSTALL}") from None


def _figure(width: float = 6.0, height: float = 2.8):
    from matplotlib.figure import Figure
    return Figure(figsize=(width, height), layout="constrained")


def _svg(fig) -> str:
    """The figure as an <svg> element sized by its container: no XML prolog, DOCTYPE or metadata."""
    import matplotlib
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)
    # ids unique on the page: matplotlib numbers each figure's groups from 1 (figure_1, axes_1, ...)
    prefix = "f" + hashlib.sha1(text.encode()).hexdigest()[:8] + "-"
    text = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{prefix}{m.group(1)}"', text)
    text = re.sub(r'href="#([^"]+)"', lambda m: f'href="#{prefix}{m.group(1)}"', text)
    text = re.sub(r"url\(#([^)]+)\)", lambda m: f"url(#{prefix}{m.group(1)})", text)
    # the outer element: the page sizes it (its viewBox keeps the aspect)
    return re.sub(r'^<svg([^>]*?) width="[^"]*" height="[^"]*"', r'<svg\1 class="plot"', text, count=1)


def _styled(draw):
    """draw(fig) in the report's style, returning the SVG."""
    def make(*args, **kwargs) -> str:
        import matplotlib
        with matplotlib.rc_context(_STYLE):
            fig = draw(*args, **kwargs)
            return _svg(fig)
    make.__doc__ = draw.__doc__
    make.__name__ = draw.__name__
    return make


@_styled
def histogram(dist: dict, title: str, xlabel: str):
    """A distribution's histogram with its p50, p95 and p99 marked."""
    fig = _figure()
    ax = fig.add_subplot()
    h = dist["hist"]
    if h["counts"]:
        ax.stairs(h["counts"], h["edges"], fill=True, color=BLUE, alpha=0.8)
    if h.get("log"):
        ax.set_xscale("log")
    for q, style in (("p50", "-"), ("p95", "--"), ("p99", ":")):
        if dist.get(q) is not None and (not h.get("log") or dist[q] > 0):
            ax.axvline(dist[q], color=ORANGE, linestyle=style, linewidth=1.2, label=f"{q} {dist[q]:.4g}")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("rows")
    ax.legend(frameon=False, fontsize=8)
    return fig


@_styled
def bars(counts: dict, title: str, xlabel: str = "rows"):
    """Horizontal bars, one per value, most rows first (top)."""
    names = list(counts)[::-1]
    fig = _figure(6.0, max(1.4, 0.3 * len(names) + 0.8))
    ax = fig.add_subplot()
    ax.barh(names, [counts[n] for n in names], color=BLUE)
    for i, n in enumerate(names):
        ax.annotate(f"{counts[n]:,}", (counts[n], i), xytext=(3, 0), textcoords="offset points", va="center",
                    fontsize=8)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    return fig


@_styled
def paired_bars(first: dict, second: dict, names: tuple[str, str], title: str):
    """Two counts per label side by side (the predicted labels against the reference's)."""
    import numpy as np
    labels = list(dict.fromkeys([*second, *first]))
    x = np.arange(len(labels))
    fig = _figure(6.0, 2.8)
    ax = fig.add_subplot()
    ax.bar(x - 0.2, [first.get(k, 0) for k in labels], 0.4, label=names[0], color=BLUE)
    ax.bar(x + 0.2, [second.get(k, 0) for k in labels], 0.4, label=names[1], color=GREY)
    ax.set_xticks(x, labels, rotation=30 if len(labels) > 6 else 0, ha="right" if len(labels) > 6 else "center")
    ax.set_ylabel("rows")
    ax.set_title(title)
    ax.legend(frameon=False, fontsize=8)
    return fig


@_styled
def confusion(cm: dict):
    """The confusion matrix: references down, predictions across, each cell's rows written in it."""
    import numpy as np
    labels, counts = cm["labels"], np.array(cm["counts"])
    size = min(8.0, 3.6 + 0.3 * len(labels))
    fig = _figure(size + 1.2, size)
    ax = fig.add_subplot()
    ax.imshow(counts, cmap="Blues")
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("predicted")
    ax.set_ylabel("reference")
    ax.set_title("Confusion matrix")
    if len(labels) <= 20:
        top = counts.max() or 1
        for (r, p), n in np.ndenumerate(counts):
            ax.text(p, r, f"{n:,}", ha="center", va="center", fontsize=8, color="white" if n > top / 2 else "black")
    return fig


@_styled
def reliability(rel: dict):
    """Accuracy against mean confidence per confidence bin, beside the diagonal of perfect calibration."""
    fig = _figure(5.6, 4.2)
    ax = fig.add_subplot()
    bins = [b for b in rel["bins"] if b["rows"]]
    ax.plot([0, 1], [0, 1], color=GREY, linestyle="--", linewidth=1, label="perfectly calibrated")
    ax.bar([(b["low"] + b["high"]) / 2 for b in bins], [b["accuracy"] for b in bins], width=0.09, color=BLUE,
           alpha=0.8, label="accuracy")
    ax.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], "o", color=ORANGE, markersize=4,
            label="(mean confidence, accuracy)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.set_title(f"Reliability (ECE {rel['ece']:.3f})")
    ax.legend(frameon=False, fontsize=7, loc="upper left")
    return fig


@_styled
def progress(points: list[dict], runs: list[dict]):
    """Rows written against the time since each run started, one line per run (its rows/s in the legend)."""
    fig = _figure()
    ax = fig.add_subplot()
    for run in dict.fromkeys(p["run"] for p in points):
        mine = [p for p in points if p["run"] == run]
        if run is None:
            name = "before any recorded run"
        else:
            r = runs[run]
            rate = f", {r['rows_per_s']:.3g} rows/s" if r.get("rows_per_s") is not None else ""
            name = f"run {run + 1} ({r.get('started_at') or '?'}{rate})"
        ax.plot([p["seconds"] for p in mine], [p["rows"] for p in mine], drawstyle="steps-post", marker=".",
                label=name)
    ax.set_xlabel("seconds since the run started (parts' write times)")
    ax.set_ylabel("rows written")
    ax.set_title("Progress per run")
    ax.legend(frameon=False, fontsize=8)
    return fig
