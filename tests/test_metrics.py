"""Evaluation metrics on hand-made answers."""
import pytest

from jobs.metrics import Accuracy, ClassificationMetrics, matches, normalize_text


def test_matching_modes():
    assert normalize_text("  Paris!\n") == "paris"
    assert matches("Paris.", "paris", "normalized") and not matches("Paris.", "paris", "exact")
    assert matches("The answer is Paris, France", "paris", "contains")
    assert not matches("Lyon", "Paris", "contains")


def test_accuracy_skips_rows_without_reference():
    acc = Accuracy("normalized")
    assert acc.add("yes", "Yes") is True and acc.add("no", "yes") is False and acc.add("x", None) is None
    assert acc.summary() == {"evaluated_rows": 2, "accuracy": 0.5}


def test_per_label_precision_recall_f1_and_confusion():
    m = ClassificationMetrics()
    pairs = [("pos", "pos"), ("pos", "pos"), ("pos", "neg"), ("neg", "neg"), ("neg", "pos"), ("neu", "neg")]
    for predicted, reference in pairs:
        m.add(predicted, reference)
    s = m.summary()
    assert s["accuracy"] == pytest.approx(3 / 6)
    pos, neg, neu = s["per_label"]["pos"], s["per_label"]["neg"], s["per_label"]["neu"]
    # pos: predicted 3 times, right twice; reference pos twice (one predicted neg)
    assert pos["precision"] == pytest.approx(2 / 3) and pos["recall"] == pytest.approx(2 / 3)
    # neg: predicted twice, right once; reference neg 3 times
    assert neg["precision"] == pytest.approx(1 / 2) and neg["recall"] == pytest.approx(1 / 3)
    assert neu["precision"] == 0 and neu["support"] == 0
    assert s["macro_f1"] == pytest.approx((2 / 3 + 0.4 + 0) / 3)
    cm = s["confusion_matrix"]
    assert cm["labels"] == ["neg", "neu", "pos"]
    assert cm["counts"] == [[1, 1, 1], [0, 0, 0], [1, 0, 2]]   # rows: reference, columns: predicted
