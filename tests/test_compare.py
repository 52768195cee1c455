"""`jobrunner compare`: every figure of --json recomputed here from the parts, the gates' exit codes
over a table of cases, the paired tests, and outputs written by different runs of a resumed job."""
from __future__ import annotations

import json
import math
import random

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

import jobrunner
from jobrunner.cli.main import main
from jobrunner.report import NotComparableError
from jobrunner.report.stats_tests import EXACT_UP_TO, bootstrap_interval, macro_f1, mcnemar_exact
from tests.cli_helpers import jsonl
from tests.report_helpers import (LABELS, classify_rows, embed_rows, generate_rows, parts, run_record, score_rows,
                                  write_output)

CLASSIFY = {"reference_column": "label", "labels": LABELS, "match": "normalized"}
FLIPS = {"r001": "neutral", "r002": "positive", "r007": "negative", "r010": "negative", "r013": "positive",
         "r018": "negative", "r022": "positive", "r031": "neutral"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """base: 40 classify rows; candidate: 8 labels changed, 3 rows dropped, 2 added, one row failing,
    another template and quantization, a higher cost."""
    root = tmp_path_factory.mktemp("compare")
    base_rows = classify_rows(40)
    cand_rows = [r for r in classify_rows(42, flips=FLIPS, errors={5, 16, 27, 33}) if r["id"] not in
                 ("r003", "r020", "r038")]
    base = write_output(root / "base", "classify", base_rows, CLASSIFY,
                        runs=[run_record(base_rows, wall_s=10.0, cost_usd=0.02)])
    cand = write_output(root / "cand", "classify", cand_rows,
                        {**CLASSIFY, "template": "Review: {prompt}", "quantization": "int8"},
                        runs=[run_record(cand_rows, wall_s=12.0, cost_usd=0.025)])
    return base, cand, root


def _joined(base: str, cand: str) -> pl.DataFrame:
    return parts(base).join(parts(cand), on="id", how="inner", suffix="_c")


def test_compare_json_figures_from_the_parts(pair):
    base, cand, _ = pair
    r = CliRunner().invoke(main, ["compare", base, cand, "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    assert got == json.loads(json.dumps(jobrunner.compare(base, cand), default=str))       # the API's figures
    b, c, j = parts(base), parts(cand), _joined(base, cand)
    rows = got["rows"]
    assert rows["common"] == len(j) == 37
    assert rows["only_in_base"] == len(set(b["id"]) - set(c["id"])) == 3
    assert rows["only_in_candidate"] == len(set(c["id"]) - set(b["id"])) == 2
    assert set(rows["only_in_base_ids"]) == {"r003", "r020", "r038"} and rows["inputs_changed"] == 0
    ok_b, ok_c = j["error"].is_null(), j["error_c"].is_null()
    label_changed = ok_b & ok_c & (j["label"].str.to_lowercase() != j["label_c"].str.to_lowercase())
    changed = (ok_b != ok_c) | label_changed
    assert got["changed"]["rows"] == changed.sum() and got["changed"]["status_changed"] == (ok_b != ok_c).sum()
    assert got["changed"]["rate"] == pytest.approx(changed.sum() / len(j))
    assert {t["id"] for t in got["changed"]["top"]} == set(j.filter(changed)["id"])
    transitions = j.filter(label_changed).group_by("label", "label_c").len()
    assert sum(t["rows"] for t in got["changed"]["transitions"]) == transitions["len"].sum()

    ev = j.filter(ok_b & ok_c)
    ref = ev["input_label"].to_list()
    pb, pc = ev["label"].str.to_lowercase().to_list(), ev["label_c"].str.to_lowercase().to_list()
    right_b = np.array([p == x for p, x in zip(pb, ref)])
    right_c = np.array([p == x for p, x in zip(pc, ref)])
    m = got["metrics"]
    assert m["evaluated_rows"] == len(ev)
    assert m["accuracy"]["base"] == pytest.approx(right_b.mean())
    assert m["accuracy"]["candidate"] == pytest.approx(right_c.mean())
    assert m["accuracy"]["delta"] == pytest.approx(right_c.mean() - right_b.mean())
    only_b, only_c = int((right_b & ~right_c).sum()), int((~right_b & right_c).sum())
    assert (m["mcnemar"]["base_only_right"], m["mcnemar"]["candidate_only_right"]) == (only_b, only_c)
    n = only_b + only_c
    assert m["mcnemar"]["p_value"] == pytest.approx(min(1.0, 2 * sum(math.comb(n, i) for i in
                                                                     range(min(only_b, only_c) + 1)) / 2 ** n))

    def f1s(pred):
        out = {}
        for lab in LABELS:
            tp = sum(p == lab and x == lab for p, x in zip(pred, ref))
            fp = sum(p == lab and x != lab for p, x in zip(pred, ref))
            fn = sum(p != lab and x == lab for p, x in zip(pred, ref))
            out[lab] = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
        return out
    fb, fc = f1s(pb), f1s(pc)
    assert m["macro_f1"]["base"] == pytest.approx(np.mean(list(fb.values())))
    assert m["macro_f1"]["candidate"] == pytest.approx(np.mean(list(fc.values())))
    for lab in LABELS:
        assert m["per_label"][lab]["f1"]["delta"] == pytest.approx(fc[lab] - fb[lab])
    lo, hi = m["accuracy"]["interval"]
    assert lo <= m["accuracy"]["delta"] <= hi
    lo, hi = m["macro_f1"]["interval"]
    assert lo <= m["macro_f1"]["delta"] <= hi

    sb, sc = (json.load(open(f"{u}/_stats.json")) for u in (base, cand))
    cost = got["costs"]["cost_per_row_usd"]
    assert cost["relative"] == pytest.approx((sc["cost_usd"] / sc["rows"]) / (sb["cost_usd"] / sb["rows"]) - 1)
    assert got["costs"]["rows_per_s"]["relative"] == pytest.approx(sc["rows_per_s"] / sb["rows_per_s"] - 1)
    common_ok = j.filter(ok_b & ok_c)
    assert got["costs"]["per_common_row"]["prompt_tokens"]["base"] == pytest.approx(common_ok["prompt_tokens"].mean())
    diffs = {d["key"]: (d["base"], d["candidate"]) for d in got["config_differences"]}
    assert diffs == {"template": (None, "Review: {prompt}"), "quantization": ("none", "int8")}
    assert [d["key"] for d in got["config_differences"]] == ["template", "quantization"]
    assert got["gates"] == [] and got["exit_code"] == 0


def test_the_gates_exit_codes(pair, tmp_path):
    base, cand, root = pair
    r = jobrunner.compare(base, cand)
    rate, drop = r["changed"]["rate"], -r["metrics"]["accuracy"]["delta"]
    increase = r["costs"]["cost_per_row_usd"]["relative"]
    other_kind = write_output(root / "gen", "generate", generate_rows())
    renamed = write_output(root / "renamed", "classify", [{**x, "id": "x" + x["id"]} for x in classify_rows()],
                           CLASSIFY)
    other_inputs = write_output(root / "inputs", "classify", classify_rows(), CLASSIFY,
                                inputs={"prompt": __import__("pyarrow").string()})
    new_prompts = write_output(root / "prompts", "classify", [{**x, "prompt": "other " + x["prompt"]}
                                                              for x in classify_rows()], CLASSIFY)
    no_reference = write_output(root / "noref", "classify", classify_rows(), {"labels": LABELS})
    unpriced = [write_output(root / f"unpriced{i}", "classify", classify_rows(), CLASSIFY,
                             runs=[run_record(classify_rows(), cost_usd=None, device_hours=0.0)]) for i in (0, 1)]
    cases = [  # (base, candidate, options, exit code)
        (base, cand, [], 0),
        (base, cand, ["--max-changed-rate", str(rate + 0.01)], 0),
        (base, cand, ["--max-changed-rate", str(rate - 0.01)], 3),
        (base, cand, ["--max-accuracy-drop", str(drop + 0.01)], 0),
        (base, cand, ["--max-accuracy-drop", str(drop - 0.01)], 3),
        (base, cand, ["--max-cost-increase", str(increase + 0.01)], 0),
        (base, cand, ["--max-cost-increase", str(increase - 0.01)], 3),
        (base, cand, ["--max-changed-rate", "1", "--max-accuracy-drop", "1", "--max-cost-increase", "0"], 3),
        (base, base, ["--max-changed-rate", "0", "--max-accuracy-drop", "0", "--max-cost-increase", "0"], 0),
        (base, other_kind, [], 2),
        (base, renamed, [], 2),
        (base, other_inputs, [], 2),
        (base, new_prompts, [], 2),
        (no_reference, no_reference, ["--max-accuracy-drop", "0.1"], 2),
        (unpriced[0], unpriced[1], ["--max-cost-increase", "0.1"], 2),
        (base, str(tmp_path / "missing"), [], 2),
    ]
    for b, c, options, code in cases:
        out = CliRunner().invoke(main, ["compare", b, c, *options])
        assert out.exit_code == code, (b, c, options, out.output)
        if code == 2:
            assert out.output.startswith("error: ") and "Traceback" not in out.output
        if code == 3:
            assert "CROSSED" in out.output
    with pytest.raises(NotComparableError, match="no id in common"):
        jobrunner.compare(base, renamed)


def test_compare_page_and_lines(pair, tmp_path):
    base, cand, _ = pair
    page = tmp_path / "cmp.html"
    r = CliRunner().invoke(main, ["compare", base, cand, "-o", str(page), "--max-changed-rate", "0.01"])
    assert r.exit_code == 3 and "gate        max_changed_rate" in r.output
    html = page.read_text()
    assert "gate crossed: max_changed_rate" in html and "McNemar" in html and "<script" not in html
    assert "http" not in html.replace("http-equiv", "")


def test_generate_score_and_embed_changes(tmp_path):
    g = generate_rows()
    g2 = [{**x, "output": x["output"] + "!"} if x["id"] in ("r001", "r002") else x for x in g]
    r = jobrunner.compare(write_output(tmp_path / "g1", "generate", g, {"reference_column": "label"}),
                          write_output(tmp_path / "g2", "generate", g2, {"reference_column": "label"}))
    assert r["changed"]["rows"] == 2 and {t["id"] for t in r["changed"]["top"]} == {"r001", "r002"}
    assert r["metrics"]["accuracy"]["delta"] == pytest.approx(0.0)

    s = score_rows()
    s2 = [{**x, "perplexity": x["perplexity"] * 1.05} if x["id"] == "r004" else
          {**x, "perplexity": x["perplexity"] * 1.001} if x.get("perplexity") else x for x in s]
    r = jobrunner.compare(write_output(tmp_path / "s1", "score", s), write_output(tmp_path / "s2", "score", s2),
                          score_rtol=0.01)
    assert r["changed"]["rows"] == 1 and r["changed"]["top"][0]["id"] == "r004"
    assert r["metrics"]["perplexity"]["delta"] == pytest.approx(0.0)      # logprob columns unchanged

    e = embed_rows()
    e2 = [{**x, "embedding": [-v for v in x["embedding"]]} if x["id"] == "r005" else x for x in e]
    r = jobrunner.compare(write_output(tmp_path / "e1", "embed", e), write_output(tmp_path / "e2", "embed", e2))
    top = r["changed"]["top"][0]
    assert r["changed"]["rows"] == 1 and top["id"] == "r005" and top["candidate"].endswith("cosine -1.0")
    assert r["changed"]["cosine"]["min"] == pytest.approx(-1.0)


def test_mcnemar_exact_and_its_large_sample_branch():
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(5, 5) == 1.0
    assert mcnemar_exact(0, 3) == pytest.approx(0.25) and mcnemar_exact(1, 9) == pytest.approx(22 / 1024)
    b, c = 1250, 1400
    assert b + c > EXACT_UP_TO
    exact = 2 * sum(math.comb(b + c, i) for i in range(b + 1)) / 2 ** (b + c)
    assert mcnemar_exact(b, c) == pytest.approx(exact, rel=1e-9)
    scipy_stats = pytest.importorskip("scipy.stats")
    assert mcnemar_exact(30, 45) == pytest.approx(scipy_stats.binomtest(30, 75, 0.5).pvalue)


def test_bootstrap_over_cells_is_the_row_bootstrap():
    """Resampling rows with replacement = a multinomial draw of the cells' counts: the intervals agree."""
    cells = np.array([120, 30, 14, 36])             # (right, right), (right, wrong), (wrong, right), (wrong, wrong)
    ok_b, ok_c = np.array([1, 1, 0, 0.0]), np.array([1, 0, 1, 0.0])
    n = cells.sum()
    stat = lambda draws: draws @ (ok_c - ok_b) / n                   # noqa: E731
    lo, hi = bootstrap_interval(cells, stat, resamples=4000, seed=1)
    assert bootstrap_interval(cells, stat, resamples=4000, seed=1) == (lo, hi)     # seeded
    rows = np.repeat(np.arange(4), cells)
    rng = random.Random(2)
    naive = [np.mean([(ok_c - ok_b)[rows[rng.randrange(n)]] for _ in range(n)]) for _ in range(1500)]
    assert lo == pytest.approx(np.percentile(naive, 2.5), abs=0.015)
    assert hi == pytest.approx(np.percentile(naive, 97.5), abs=0.015)
    conf = np.array([[[3, 1], [0, 2]], [[0, 0], [0, 5]]])
    assert macro_f1(conf).tolist() == pytest.approx([(6 / 7 + 4 / 5) / 2, 1.0])


def test_compare_across_the_runs_of_a_resumed_job(tiny_hf_model_dir, tmp_path):
    """The same job in one run and in two (stopped by --limit, then resumed): nothing changed, every id in
    common; the resumed output's report shows both runs."""
    ds = jsonl(tmp_path / "d.jsonl", [{"id": f"q{i}", "prompt": f"question {i}?", "label": "Yes" if i % 2 else "No"}
                                      for i in range(8)])
    args = ["-m", str(tiny_hf_model_dir("llama")), "--device", "cpu", "--kv-cache-memory", "16MB", "--kind",
            "classify", "--labels", "Yes,No", "--reference-column", "label", "--device-hourly-cost", "1.0"]
    once, resumed = str(tmp_path / "once"), str(tmp_path / "resumed")
    for out, extra in ((once, []), (resumed, ["--limit", "3"]), (resumed, [])):
        r = CliRunner().invoke(main, ["submit", ds, "-o", out, *args, *extra])
        assert r.exit_code == 0, r.output
    assert json.load(open(f"{resumed}/_stats.json"))["runs_recorded"] == 2
    r = CliRunner().invoke(main, ["compare", once, resumed, "--json", "--max-changed-rate", "0"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    assert got["rows"]["common"] == 8 and got["changed"]["rows"] == 0 and got["config_differences"] == []
    assert got["metrics"]["accuracy"]["delta"] == 0 and got["metrics"]["mcnemar"]["p_value"] == 1.0
    pytest.importorskip("matplotlib")
    page = open(jobrunner.write_report(resumed)).read()
    assert "<h3>Runs</h3>" in page and "Progress per run" in page
    from jobrunner.report import report_figures
    fig = report_figures(resumed)
    assert [x["rows"] for x in fig["runs"]] == [3, 5] and {p["run"] for p in fig["progress"]} == {0, 1}
