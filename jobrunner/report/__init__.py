"""A job you can look at: one HTML page of an output (`jobrunner report`), and what changed between
two outputs of the same dataset, with gates for schedulers (`jobrunner compare`).

    source.py         an output opened for figures: summary, manifest, a lazy polars scan of the parts
    distributions.py  a column's count, mean, percentiles and histogram (streaming queries)
    kinds.py          each kind's figures (classify's metrics and calibration, generate, score, embed)
    figures.py        every figure of the report page, as one dict (no plotting)
    stats_tests.py    McNemar's exact test, the bootstrap interval over a paired table's cells
    compare.py        the comparison of two outputs and its gates
    plots.py          matplotlib figures as inline SVG (the optional `jobrunner[report]` extra)
    html.py, page.py, compare_page.py   the self-contained pages

Everything is read with polars lazy scans under the streaming engine: memory is bounded by the
figures kept (a few per label, bin and error message), not by the output's rows.
"""
from __future__ import annotations

from jobrunner.common import storage
from jobrunner.output import OutputError
from jobrunner.report.compare import NotComparableError, compare
from jobrunner.report.plots import INSTALL, MissingPlotLibrary

REPORT_NAME = "report.html"         # beside the parts (layout.OURS_RE counts it as ours)

__all__ = ["REPORT_NAME", "INSTALL", "MissingPlotLibrary", "NotComparableError", "OutputError", "compare",
           "write_report", "report_figures", "write_page"]


def report_figures(output: str) -> dict:
    """Every figure the report page shows, as a JSON-able dict (OutputError: no output, or no part)."""
    from jobrunner.report.figures import report_figures as figures
    from jobrunner.report.source import open_output
    out = open_output(output)
    if not out.paths:
        raise OutputError(f"{output} has no part files yet: nothing to report")
    return figures(out)


def write_report(output: str, path: str | None = None) -> str:
    """The report page of `output`, written to `path` (any fsspec URL; default OUTPUT/report.html);
    returns where. MissingPlotLibrary without matplotlib, OutputError without an output."""
    from jobrunner.report import page, plots
    plots.require()
    html = page.render(report_figures(output))
    return write_page(html, path or f"{output.rstrip('/')}/{REPORT_NAME}")


def write_page(html: str, path: str) -> str:
    """An HTML page written whole (atomically) to path, any fsspec URL; returns path."""
    fs, p = storage.url_fs(path)
    head = p.rsplit("/", 1)[0]
    if head:
        fs.makedirs(head, exist_ok=True)
    storage.atomic_write(fs, p, html.encode("utf-8"))
    return path
