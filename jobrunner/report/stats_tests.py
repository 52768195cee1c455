"""Paired tests for two runs over the same rows: McNemar's exact test and a bootstrap interval.

Both take counts of a paired table's cells, not rows: resampling n rows with replacement draws the
cells' counts from a multinomial over their shares, so a bootstrap of a million rows costs as much
as one of a hundred (the draw per resample is over the cells, a few per label)."""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

EXACT_UP_TO = 2000          # discordant pairs summed in integers; past that, in log space
BOOTSTRAP_RESAMPLES = 1000
CONFIDENCE = 0.95

__all__ = ["mcnemar_exact", "bootstrap_interval", "BOOTSTRAP_RESAMPLES"]


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided p-value of McNemar's exact test: b rows right only in the first run, c only in the
    second; under the null each discordant row is either with probability 1/2, so
    p = min(1, 2 P[Binomial(b + c, 1/2) <= min(b, c)]). 1.0 when no row is discordant."""
    n, k = b + c, min(b, c)
    if n == 0:
        return 1.0
    if n <= EXACT_UP_TO:
        return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)
    # the terms grow with i up to k < n/2: sum from k down and stop once they no longer count
    log_half = n * math.log(0.5)
    total = 0.0
    for i in range(k, -1, -1):
        term = math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + log_half)
        total += term
        if term < total * 1e-17:
            break
    return min(1.0, 2 * total)


def bootstrap_interval(cells: np.ndarray, statistic: Callable[[np.ndarray], np.ndarray],
                       resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                       confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """The percentile interval of `statistic` over resamples of the rows behind `cells` (each
    cell's row count). statistic: [resamples, cells] counts -> [resamples] values (NaN where it is
    undefined: those resamples are dropped). Seeded: the same cells give the same interval."""
    cells = np.asarray(cells, dtype=np.int64)
    n = int(cells.sum())
    if n == 0:
        return None
    draws = np.random.default_rng(seed).multinomial(n, cells / n, size=resamples)
    values = statistic(draws)
    values = values[~np.isnan(values)]
    if not len(values):
        return None
    tail = (1 - confidence) / 2 * 100
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return float(lo), float(hi)


def macro_f1(confusion: np.ndarray) -> np.ndarray:
    """Macro-F1 of each [.., K, K] confusion matrix (rows: reference, columns: predicted), over the
    classes that occur in it (as a reference or a prediction), as ClassificationMetrics counts them:
    a class's F1 is 2 tp / (2 tp + fp + fn)."""
    tp = np.diagonal(confusion, axis1=-2, axis2=-1)
    predicted, referenced = confusion.sum(axis=-2), confusion.sum(axis=-1)
    denominator = predicted + referenced            # 2 tp + fp + fn
    present = denominator > 0
    f1 = np.divide(2 * tp, denominator, out=np.zeros(tp.shape, dtype=float), where=present)
    classes = present.sum(axis=-1)
    return np.divide(f1.sum(axis=-1), classes, out=np.full(classes.shape, np.nan), where=classes > 0)
