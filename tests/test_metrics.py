"""Evaluation metrics on hand-made answers."""
import math

import pytest

from jobrunner.jobs.metrics import Accuracy, ClassificationMetrics, job_metrics, matches, normalize_text


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


def test_normalized_match_keys_every_figure_by_the_normalized_label():
    """Issue 15 (7): labels `Positive,Negative` against references `positive`/`negative`. 10 negative
    references, 3 predicted Negative and 7 Positive; 10 positive ones, all predicted Positive."""
    m = ClassificationMetrics("normalized")
    for predicted, reference in [("Negative", "negative")] * 3 + [("Positive", "negative")] * 7 + \
            [("Positive", "positive")] * 10:
        m.add(predicted, reference)
    s = m.summary()
    assert s["accuracy"] == pytest.approx(13 / 20)
    assert set(s["per_label"]) == {"Negative", "Positive"}          # shown as the labels are configured
    neg, pos = s["per_label"]["Negative"], s["per_label"]["Positive"]
    assert neg["recall"] == pytest.approx(0.3) and neg["precision"] == 1.0 and neg["support"] == 10
    assert pos["recall"] == 1.0 and pos["precision"] == pytest.approx(10 / 17) and pos["support"] == 10
    assert s["confusion_matrix"] == {"labels": ["Negative", "Positive"], "counts": [[3, 7], [0, 10]]}


def test_exact_match_keeps_raw_text_and_unpredicted_classes_show_their_reference():
    m = ClassificationMetrics("exact")
    for predicted, reference in [("Yes", "yes"), ("Yes", "Yes"), ("No", "maybe!")]:
        m.add(predicted, reference)
    s = m.summary()
    assert s["confusion_matrix"]["labels"] == ["No", "Yes", "maybe!", "yes"]
    assert s["per_label"]["yes"]["recall"] == 0 and s["per_label"]["Yes"]["recall"] == 1.0
    n = ClassificationMetrics("normalized")
    n.add("No", "Maybe!")                                       # never predicted: its first reference's spelling
    assert n.summary()["confusion_matrix"]["labels"] == ["Maybe!", "No"]


def test_contains_match_keys_by_normalized_label():
    m = ClassificationMetrics("contains")
    for predicted, reference in [("Very Good", "good"), ("very good", "bad"), ("Bad", "bad")]:
        m.add(predicted, reference)
    s = m.summary()
    assert s["accuracy"] == pytest.approx(2 / 3)
    assert s["confusion_matrix"]["labels"] == ["Bad", "Very Good"]
    assert s["confusion_matrix"]["counts"] == [[1, 1], [0, 1]]


def test_metrics_from_columns_equal_metrics_from_rows():
    """The summary recomputes metrics from the output's columns (add_columns): the same figures."""
    pairs = [("Positive", "negative"), ("Negative", "negative"), (None, "positive"), ("Positive", None),
             ("Positive", "positive")]
    live = ClassificationMetrics()
    for p, r in pairs:
        if p is not None:          # an error row has no label and is not evaluated
            live.add(p, r)
    cols = ClassificationMetrics()
    cols.add_columns({"label": [p for p, _ in pairs[:2]], "reference": [r for _, r in pairs[:2]]})
    cols.add_columns({"label": [p for p, _ in pairs[2:]], "reference": [r for _, r in pairs[2:]]})
    assert cols.summary() == live.summary() and live.summary()["evaluated_rows"] == 3
    acc = job_metrics("generate", "normalized", has_reference=True)
    acc.add_columns({"correct": [True, None, False, True]})
    assert acc.summary() == {"evaluated_rows": 3, "accuracy": pytest.approx(2 / 3)}
    ll = job_metrics("score", "normalized", has_reference=False)
    ll.add_columns({"logprob": [-2.0, None, -4.0], "scored_tokens": [1, None, 3]})
    assert ll.summary() == {"scored_tokens": 4, "mean_logprob": -1.5, "perplexity": pytest.approx(math.exp(1.5))}
    assert job_metrics("classify", "exact", has_reference=False) is None
    assert job_metrics("score", "exact", has_reference=False).summary() == {"scored_tokens": 0, "perplexity": None}


def test_configured_labels_give_the_spelling_of_a_class_never_predicted():
    m = ClassificationMetrics("normalized", labels=("Yes", "No"))
    for predicted, reference in [("No", "yes"), ("No", "no")]:
        m.add(predicted, reference)
    s = m.summary()
    assert s["confusion_matrix"] == {"labels": ["No", "Yes"], "counts": [[1, 0], [1, 0]]}
    assert s["per_label"]["Yes"]["recall"] == 0 and s["per_label"]["Yes"]["support"] == 1
