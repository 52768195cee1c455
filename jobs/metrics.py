"""Evaluation against a reference column: per-row correctness and the job's accuracy,
and for classification per-label precision, recall, F1 and the confusion matrix."""
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
    def __init__(self, mode: str):
        self.mode = mode
        self.correct = self.total = 0

    def add(self, output: str, reference) -> bool | None:
        if reference is None:
            return None
        ok = matches(output, str(reference), self.mode)
        self.correct += ok
        self.total += 1
        return ok

    def summary(self) -> dict:
        return {"evaluated_rows": self.total, "accuracy": self.correct / self.total if self.total else None}


class ClassificationMetrics(Accuracy):
    """Predicted label vs reference label (compared after normalization)."""

    def __init__(self, mode: str = "normalized"):
        super().__init__(mode)
        self.pairs: Counter[tuple[str, str]] = Counter()   # (reference, predicted) -> count

    def add(self, predicted: str, reference) -> bool | None:
        ok = super().add(predicted, reference)
        if ok is not None:
            ref = predicted if ok else str(reference)
            self.pairs[(ref, predicted)] += 1
        return ok

    def summary(self) -> dict:
        out = super().summary()
        labels = sorted({r for r, _ in self.pairs} | {p for _, p in self.pairs})
        per_label = {}
        for lab in labels:
            tp = self.pairs[(lab, lab)]
            fp = sum(n for (r, p), n in self.pairs.items() if p == lab and r != lab)
            fn = sum(n for (r, p), n in self.pairs.items() if r == lab and p != lab)
            precision = tp / (tp + fp) if tp + fp else 0.0
            recall = tp / (tp + fn) if tp + fn else 0.0
            f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
            per_label[lab] = {"precision": precision, "recall": recall, "f1": f1, "support": tp + fn}
        out["per_label"] = per_label
        out["macro_f1"] = sum(v["f1"] for v in per_label.values()) / len(per_label) if per_label else None
        out["confusion_matrix"] = {"labels": labels,
                                   "counts": [[self.pairs[(r, p)] for p in labels] for r in labels]}
        return out


def merge_metrics(metrics: list[dict | None]) -> dict | None:
    """Job metrics of several workers as one: accuracy, confusion matrix, log-likelihood recombined from counts."""
    ms = [m for m in metrics if m]
    if not ms:
        return None
    if len(ms) == 1:
        return ms[0]
    out: dict = {}
    if any("evaluated_rows" in m for m in ms):
        acc = ClassificationMetrics() if any("confusion_matrix" in m for m in ms) else Accuracy("normalized")
        for m in ms:
            n = m.get("evaluated_rows") or 0
            acc.total += n
            acc.correct += round((m.get("accuracy") or 0.0) * n)
            cm = m.get("confusion_matrix")
            if cm:
                pairs = Counter({(r, p): c for r, row in zip(cm["labels"], cm["counts"])
                                 for p, c in zip(cm["labels"], row) if c})
                acc.pairs.update(pairs)
        out.update(acc.summary())
    if any("scored_tokens" in m for m in ms):
        tokens = sum(m.get("scored_tokens") or 0 for m in ms)
        logprob = sum((m.get("mean_logprob") or 0.0) * (m.get("scored_tokens") or 0) for m in ms)
        out.update(scored_tokens=tokens, mean_logprob=logprob / tokens if tokens else None,
                   perplexity=math.exp(-logprob / tokens) if tokens else None)
    for m in ms:            # anything else: as the first worker that has it reported it
        for k, v in m.items():
            out.setdefault(k, v)
    return out
