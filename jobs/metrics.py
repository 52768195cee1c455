"""Evaluation against a reference column: per-row correctness and the job's accuracy, for
classification per-label precision, recall, F1 and the confusion matrix, and for scoring the
log-likelihood. Each accumulator is fed row by row as a job runs (`add`) or from the output's
columns, a chunk of rows at a time (`add_columns`), so a summary can be recomputed from the parts."""
from __future__ import annotations

import math
import re
import string
from collections import Counter

_PUNCT = re.compile(f"[{re.escape(string.punctuation)}]")


def normalize_text(text: str) -> str:
    """Lower case, punctuation dropped, whitespace runs collapsed."""
    return " ".join(_PUNCT.sub(" ", text.lower()).split())


def matches(output: str, reference: str, mode: str) -> bool:
    if mode == "exact":
        return output == reference
    if mode == "contains":
        return normalize_text(reference) in normalize_text(output)
    return normalize_text(output) == normalize_text(reference)


class Accuracy:
    columns = ("correct",)      # the output columns add_columns reads

    def __init__(self, mode: str):
        self.mode = mode
        self.correct = self.total = 0

    def add(self, output: str, reference, count: int = 1) -> bool | None:
        """One row, or `count` rows of the same output and reference (a grouped table's)."""
        if reference is None:
            return None
        ok = matches(output, str(reference), self.mode)
        self.correct += ok * count
        self.total += count
        return ok

    def add_columns(self, cols: dict[str, list]) -> None:
        """Rows' `correct` values (null: not evaluated)."""
        for ok in cols["correct"]:
            if ok is not None:
                self.correct += bool(ok)
                self.total += 1

    def summary(self) -> dict:
        return {"evaluated_rows": self.total, "accuracy": self.correct / self.total if self.total else None}


class ClassificationMetrics(Accuracy):
    """Predicted label vs reference label.

    Every figure is keyed by a label's key: its normalized text under normalized or contains
    match (so `Negative` and `negative` are one class), its raw text under exact match. A key is
    shown as the label's spelling as configured (`labels`, else as first predicted), or, for a class
    neither configured nor predicted, as its first reference's spelling.
    """

    columns = ("label", "reference")

    def __init__(self, mode: str = "normalized", labels=()):
        super().__init__(mode)
        self.pairs: Counter[tuple[str, str]] = Counter()   # (reference key, predicted key) -> count
        self._predicted = {self.key(label): label for label in reversed(labels)}   # key -> configured spelling
        self._referenced: dict[str, str] = {}              # key -> first reference spelling

    def key(self, label: str) -> str:
        return label if self.mode == "exact" else normalize_text(label)

    def add(self, predicted: str, reference, count: int = 1) -> bool | None:
        ok = super().add(predicted, reference, count)
        if ok is not None:
            p = self.key(predicted)
            r = p if ok else self.key(str(reference))     # a match is the predicted class (contains: by definition)
            self._predicted.setdefault(p, predicted)     # rows' own labels (--labels-column)
            self._referenced.setdefault(r, str(reference))
            self.pairs[(r, p)] += count
        return ok

    def add_columns(self, cols: dict[str, list]) -> None:
        """Rows' predicted `label` and reference values (a null label: an error row, not evaluated)."""
        for predicted, reference in zip(cols["label"], cols["reference"]):
            if predicted is not None:
                self.add(predicted, reference)

    def name(self, key: str) -> str:
        return self._predicted[key] if key in self._predicted else self._referenced[key]

    def summary(self) -> dict:
        out = super().summary()
        keys = sorted({r for r, _ in self.pairs} | {p for _, p in self.pairs}, key=lambda k: (self.name(k), k))
        per_label = {}
        for k in keys:
            tp = self.pairs[(k, k)]
            fp = sum(n for (r, p), n in self.pairs.items() if p == k and r != k)
            fn = sum(n for (r, p), n in self.pairs.items() if r == k and p != k)
            precision = tp / (tp + fp) if tp + fp else 0.0
            recall = tp / (tp + fn) if tp + fn else 0.0
            f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
            per_label[self.name(k)] = {"precision": precision, "recall": recall, "f1": f1, "support": tp + fn}
        out["per_label"] = per_label
        out["macro_f1"] = sum(v["f1"] for v in per_label.values()) / len(per_label) if per_label else None
        out["confusion_matrix"] = {"labels": [self.name(k) for k in keys],
                                   "counts": [[self.pairs[(r, p)] for p in keys] for r in keys]}
        return out


class LogLikelihood:
    """Summed log-likelihood of scored text over its tokens."""

    columns = ("logprob", "scored_tokens")

    def __init__(self):
        self.logprob = 0.0
        self.tokens = 0

    def add(self, logprob: float, tokens: int) -> None:
        self.logprob += logprob
        self.tokens += tokens

    def add_columns(self, cols: dict[str, list]) -> None:
        """Rows' `logprob` and `scored_tokens` (null: an error row, not scored)."""
        for logprob, tokens in zip(cols["logprob"], cols["scored_tokens"]):
            if logprob is not None and tokens:
                self.add(logprob, tokens)

    def summary(self) -> dict:
        if not self.tokens:
            return {"scored_tokens": 0, "perplexity": None}
        return {"scored_tokens": self.tokens, "mean_logprob": self.logprob / self.tokens,
                "perplexity": math.exp(-self.logprob / self.tokens)}


def job_metrics(kind: str, mode: str, has_reference: bool, labels=()):
    """The accumulator of a job's metrics: classify and generate need a reference column, score
    always has its log-likelihood; None when the job has no metrics. labels: classify's --labels."""
    if kind == "score":
        return LogLikelihood()
    if not has_reference:
        return None
    return ClassificationMetrics(mode, labels) if kind == "classify" else Accuracy(mode)
