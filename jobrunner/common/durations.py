"""A duration as a person reads it in a summary, a progress line or a report: 12.3 s, 4 min 05 s, 2 h 03 min."""
from __future__ import annotations


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.3g} s"
    m, sec = divmod(round(seconds), 60)
    if m < 60:
        return f"{m} min {sec:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"
