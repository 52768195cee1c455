"""`jobrunner report`: every figure on the page recomputed here from the parts (polars, numpy), the
page fetching nothing, the extra's message without matplotlib, and a real browser rendering it."""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from jobrunner.cli.main import main
from jobrunner.output.manifest import check_output
from jobrunner.report import report_figures, write_report
from jobrunner.report.html import num, pct, seconds
from tests.report_helpers import (LABELS, classify_rows, embed_rows, generate_rows, parts, run_record, score_rows,
                                  write_output)

pytest.importorskip("matplotlib")

START = 1_767_322_800.0             # 2026-01-02T03:00:00Z, run_record's default started_at


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """One output of each kind, written once; classify's over two runs."""
    root = tmp_path_factory.mktemp("report")
    rows = classify_rows()
    runs = [run_record(rows[:20], wall_s=4.0, cost_usd=0.01),
            run_record(rows[20:], wall_s=6.0, cost_usd=0.015, started_at="2026-01-02T03:00:10Z")]
    times = [START + 1, START + 2, START + 4, START + 4.5, START + 5, START + 11, START + 12, START + 14,
             START + 15, START + 15.5]
    made = {"classify": write_output(root / "classify", "classify", rows,
                                     {"reference_column": "label", "labels": LABELS, "match": "normalized"},
                                     runs=runs, part_times=times),
            "generate": write_output(root / "generate", "generate", generate_rows(), {"reference_column": "label"}),
            "score": write_output(root / "score", "score", score_rows(), {"score_column": "prompt"}),
            "embed": write_output(root / "embed", "embed", embed_rows())}
    pages = {k: open(write_report(url)).read() for k, url in made.items()}
    return made, pages


def _first(df: pl.DataFrame) -> pl.DataFrame:
    return df.filter(pl.col("sample_index").fill_null(0) == 0) if "sample_index" in df.columns else df


def _cell(value) -> str:
    return f'<td class="n">{value}</td>'


def _pct(values, q):
    return float(np.percentile(np.asarray(values, dtype=float), q))   # linear, as jobrunner.stats.percentile


def test_summary_latency_and_token_figures_from_the_parts(outputs):
    made, pages = outputs
    for kind, url in made.items():
        df = _first(parts(url))
        fig = report_figures(url)
        s, page = fig["summary"], pages[kind]
        ok = df.filter(pl.col("error").is_null())
        reused = df["reused"].fill_null(False)
        computed = df.filter(~reused & (pl.col("error").is_null() | (pl.col("prompt_tokens") > 0)))
        assert (s["rows"], s["rows_ok"], s["rows_failed"]) == (len(df), len(ok), len(df) - len(ok))
        assert s["prompt_tokens"] == df["prompt_tokens"].sum()
        assert s["cached_tokens"] == computed["cached_tokens"].sum()
        assert s["cache_hit_rate"] == pytest.approx(computed["cached_tokens"].sum() / computed["prompt_tokens"].sum())
        stats = json.load(open(f"{url}/_stats.json"))
        assert (s["rows"], s["prompt_tokens"]) == (stats["rows"], stats["prompt_tokens"])      # the summary agrees
        assert f"{s['rows']:,}" in page and f"{len(ok):,} ok, {len(df) - len(ok):,} failed" in page
        assert pct(s["cache_hit_rate"]) in page and seconds(stats["wall_s"]) in page
        timed = ok.filter(~pl.col("reused").fill_null(False))
        for name in ("queue", "prefill", "decode"):
            d = fig["latency"][name]
            values = timed[f"{name}_s"].to_list()
            assert d["rows"] == len(values)
            for q in (50, 95, 99):
                assert d[f"p{q}"] == pytest.approx(_pct(values, q))
                assert _cell(seconds(_pct(values, q))) in page
            assert sum(d["hist"]["counts"]) == len(values)
            assert d["hist"]["counts"] == np.histogram(values, bins=d["hist"]["edges"])[0].tolist()
        prompt = fig["tokens"]["prompt"]
        assert prompt["p50"] == pytest.approx(_pct(ok["prompt_tokens"].to_list(), 50))
        assert _cell(num(prompt["mean"])) in page


def test_classify_metrics_calibration_and_labels_from_the_parts(outputs):
    made, pages = outputs
    df = parts(made["classify"]).filter(pl.col("error").is_null())
    page, k = pages["classify"], report_figures(made["classify"])["by_kind"]
    pred, ref = df["label"].str.to_lowercase().to_list(), df["input_label"].to_list()
    for label in LABELS:
        tp = sum(p == label and r == label for p, r in zip(pred, ref))
        fp = sum(p == label and r != label for p, r in zip(pred, ref))
        fn = sum(p != label and r == label for p, r in zip(pred, ref))
        precision, recall = tp / (tp + fp) if tp + fp else 0.0, tp / (tp + fn) if tp + fn else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        got = k["metrics"]["per_label"][label]
        assert (got["precision"], got["recall"], got["f1"], got["support"]) == pytest.approx(
            (precision, recall, f1, tp + fn))
        assert f"<td>{label}</td>{_cell(num(precision, 3))}{_cell(num(recall, 3))}{_cell(num(f1, 3))}" in page
    cm = k["metrics"]["confusion_matrix"]
    assert cm["labels"] == sorted(LABELS)
    assert cm["counts"] == [[sum(r == a and p == b for p, r in zip(pred, ref)) for b in cm["labels"]]
                            for a in cm["labels"]]
    accuracy = np.mean([p == r for p, r in zip(pred, ref)])
    assert k["metrics"]["accuracy"] == pytest.approx(accuracy) and f"<b>{num(accuracy, 3)}</b>" in page
    stats = json.load(open(f"{made['classify']}/_stats.json"))
    assert k["metrics"] == stats["metrics"]        # the summary's own accumulator agrees
    # reliability: ten equal confidence bins, ECE = sum n_b / N |accuracy_b - confidence_b|
    conf = df["confidence"].to_numpy()
    right = np.array([p == r for p, r in zip(pred, ref)])
    bins = np.minimum((conf * 10).astype(int), 9)
    ece = sum((bins == b).sum() / len(conf) * abs(right[bins == b].mean() - conf[bins == b].mean())
              for b in range(10) if (bins == b).any())
    assert k["reliability"]["ece"] == pytest.approx(ece)
    assert f"expected calibration error {num(ece, 3)}" in page
    for b in k["reliability"]["bins"]:
        assert b["rows"] == (bins == b["bin"]).sum()
    assert k["labels"] == dict(sorted(((lab, pred.count(lab)) for lab in set(pred)), key=lambda kv: (-kv[1], kv[0])))
    assert k["reference_labels"] == {lab: ref.count(lab) for lab in sorted(LABELS)}


def test_generate_score_and_embed_figures_from_the_parts(outputs):
    made, pages = outputs
    g = parts(made["generate"])
    k = report_figures(made["generate"])["by_kind"]
    reasons = g["finish_reason"].fill_null("(none)").value_counts()
    assert k["finish_reasons"] == dict(reasons.iter_rows())
    for reason, n in k["finish_reasons"].items():
        assert f"<td>finish reason: {reason}</td>{_cell(num(n))}" in pages["generate"]
    valid = g["schema_valid"].drop_nulls()
    assert k["schema_valid"] == {"true": valid.sum(), "false": len(valid) - valid.sum()}
    lengths = g.filter(pl.col("error").is_null())["completion_tokens"].to_list()
    assert k["completion_tokens"]["p95"] == pytest.approx(_pct(lengths, 95))
    assert k["accuracy"]["accuracy"] == pytest.approx(g["correct"].drop_nulls().mean())

    s = parts(made["score"]).filter(pl.col("error").is_null())
    k = report_figures(made["score"])["by_kind"]
    overall = math.exp(-s["logprob"].sum() / s["scored_tokens"].sum())
    assert k["overall_perplexity"] == pytest.approx(overall)
    assert f"<b>{num(overall, 4)}</b>" in pages["score"]
    assert k["perplexity"]["p50"] == pytest.approx(_pct(s["perplexity"].to_list(), 50))
    assert sum(k["perplexity"]["hist"]["counts"]) == len(s)

    e = parts(made["embed"]).filter(pl.col("error").is_null())
    k = report_figures(made["embed"])["by_kind"]
    norms = np.linalg.norm(np.array(e["embedding"].to_list()), axis=1)
    assert k["dimensions"] == {4: len(e)}
    assert k["norm"]["mean"] == pytest.approx(norms.mean(), rel=1e-6)
    assert k["norm"]["p99"] == pytest.approx(_pct(norms, 99), rel=1e-6)


def test_failed_rows_runs_progress_and_configuration(outputs):
    made, pages = outputs
    df = parts(made["classify"])
    fig = report_figures(made["classify"])
    failed = df.filter(pl.col("error").is_not_null())
    f = fig["failures"]
    assert f["rows"] == len(failed) and f["first"] == failed.select("id", "error").to_dicts()
    by_message = failed.group_by("error").agg(pl.len()).sort(["len", "error"], descending=[True, False])
    assert [(g["error"], g["rows"]) for g in f["groups"]] == list(by_message.iter_rows())
    assert "template: column &#x27;text&#x27; is missing" in pages["classify"]
    assert [r["rows"] for r in fig["runs"]] == [20, 20]
    # the parts' times: two runs, rows written so far in each (a part of 4 rows, first samples only)
    runs = [p["run"] for p in fig["progress"]]
    assert runs.count(0) == 1 + 5 and runs.count(1) == 1 + 5
    assert [p["rows"] for p in fig["progress"] if p["run"] == 1][-1] == 20
    assert [p["seconds"] for p in fig["progress"] if p["run"] == 1][1] == pytest.approx(1.0)
    assert fig["config"]["job"]["reference_column"] == "label"
    assert "<td>reference_column</td><td><pre>label</pre></td>" in pages["classify"]
    assert "tiny (/models/tiny)" in pages["classify"]


def test_the_page_fetches_nothing(outputs):
    _, pages = outputs
    for page in pages.values():
        assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", page, re.I)
        assert not re.search(r"<script|<link|<iframe|<img|<object|<embed|@import", page, re.I)
        # the inline SVGs' own references (clip paths, reused paths) are the only ones
        assert all(h.startswith(("#", "data:image/png;base64,")) for h in re.findall(r'href="([^"]*)"', page))
        assert all(u.startswith("#") for u in re.findall(r"url\(\s*['\"]?([^)'\"]*)", page))
        ids = re.findall(r'\sid="([^"]+)"', page)
        assert len(ids) == len(set(ids))            # inline SVGs' ids do not clash
        assert page.count("<svg") >= 4


def test_report_command_default_path_any_url_and_the_output_stays_ours(outputs, tmp_path):
    made, _ = outputs
    url = made["generate"]
    r = CliRunner().invoke(main, ["report", url])
    assert r.exit_code == 0 and r.output.strip() == f"{url}/report.html"
    check_output(url, json.load(open(f"{url}/_manifest.json"))["config"], overwrite=True)  # report.html is ours
    r = CliRunner().invoke(main, ["report", url, "-o", "memory://pages/nightly.html"])
    assert r.exit_code == 0, r.output
    import fsspec
    assert fsspec.filesystem("memory").cat("/pages/nightly.html").startswith(b"<!DOCTYPE html>")
    # an output on another filesystem: its parts are copied to local disk and scanned there
    fs, local = fsspec.filesystem("memory"), fsspec.filesystem("file")
    for name in local.ls(url, detail=False):
        fs.pipe(f"/outs/gen/{name.rsplit('/', 1)[1]}", local.cat(name))
    assert report_figures("memory://outs/gen")["summary"] == report_figures(url)["summary"]
    r = CliRunner().invoke(main, ["report", str(tmp_path / "nothing")])
    assert r.exit_code == 2 and "no jobrunner output" in r.output


def test_report_without_matplotlib_says_how_to_install_it(outputs, monkeypatch):
    made, _ = outputs
    monkeypatch.setitem(sys.modules, "matplotlib", None)       # import matplotlib raises ImportError
    r = CliRunner().invoke(main, ["report", made["score"], "-o", "/nonexistent/x.html"])
    assert r.exit_code == 2 and "pip install 'jobrunner[report]'" in r.output


def test_stats_points_at_report(outputs):
    made, _ = outputs
    r = CliRunner().invoke(main, ["stats", made["score"]])
    assert r.exit_code == 0 and f"jobrunner report {made['score']}" in r.output


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed (apt-get install "
                                                             "chromium): the page is not rendered in a browser")
def test_a_headless_browser_renders_the_page(outputs, tmp_path):
    made, _ = outputs
    shot = tmp_path / "report.png"
    subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1200,2000", f"file://{made['classify']}/report.html"],
                   capture_output=True, timeout=120, check=False)
    assert shot.is_file() and shot.stat().st_size > 20_000
    from PIL import Image
    with Image.open(shot) as im:
        assert im.size == (1200, 2000)
        colours = im.convert("RGB").resize((120, 200)).getcolors(maxcolors=100_000)
        assert len(colours) > 50            # text, cards and plots, not a blank page


def test_the_memory_benchmark_writes_an_output_the_report_reads(tmp_path):
    """benchmarks/report_memory.py's synthetic output, small: laid out as the writer does, read back whole."""
    from benchmarks.report_memory import write_output as synthetic
    url = str(tmp_path / "bench")
    synthetic(url, 2500, 0.0, 1)
    fig = report_figures(url)
    df = parts(url)
    assert fig["summary"]["rows"] == 2500 and fig["summary"]["rows_failed"] == df["error"].is_not_null().sum()
    assert fig["by_kind"]["metrics"]["evaluated_rows"] == df["label"].is_not_null().sum()
