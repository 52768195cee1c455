"""The report page of one output: report_figures' dict laid out as HTML, with its plots inline.

Order (what a reader wants first): did it work (the status and the summary cards), how good was it
(the kind's figures), how fast (latency, tokens, progress), what failed, and how it was configured."""
from __future__ import annotations

import time

from jobrunner.report import plots
from jobrunner.report.html import cards, document, esc, figures, num, pct, section, seconds, table, usd, value_text

__all__ = ["render"]


def render(fig: dict) -> str:
    s = fig["summary"]
    body = [_summary(fig)]
    kind = _by_kind(fig)
    if kind:
        body.append(section(f"Results: {fig['kind']}", kind, "kind"))
    body.append(section("Latency", _latency(fig), "latency"))
    body.append(section("Tokens and throughput", _tokens(fig), "tokens"))
    body.append(section(f"Failed rows ({s['rows_failed']:,})", _failures(fig["failures"]), "failures"))
    body.append(section("Configuration", _configuration(fig["config"]), "config"))
    made = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return document(f"jobrunner report: {fig['output']}", f"{fig['kind']} job \u00b7 page made {made}",
                    "".join(body), _status(fig))


def _status(fig: dict) -> tuple[str, str]:
    s = fig["summary"]
    if fig["partial"]:
        return "partial: no run finished", "warn"
    if s.get("interrupted"):
        return "interrupted: run the job again to resume", "warn"
    if s["rows"] and s["rows_failed"] == s["rows"]:
        return "every row failed", "bad"
    done = "complete" if fig["complete"] else "not complete"
    if s["rows_failed"]:
        return f"{done}, {s['rows_failed']:,} rows failed", "warn"
    return done, "ok" if fig["complete"] else "warn"


def _summary(fig: dict) -> str:
    s = fig["summary"]
    items = [("rows", f"{s['rows']:,}", f"{s['rows_ok']:,} ok, {s['rows_failed']:,} failed")]
    m = s.get("metrics") or {}
    for key in ("accuracy", "macro_f1", "perplexity"):
        if m.get(key) is not None:
            items.append((key.replace("_", "-"), num(m[key], 3), f"over {m['evaluated_rows']:,} rows"
                          if m.get("evaluated_rows") else ""))
    items.append(("tokens", f"{s['prompt_tokens'] + s['completion_tokens']:,}",
                  f"{s['prompt_tokens']:,} prompt, {s['completion_tokens']:,} completion"))
    optimum = s.get("optimum_cache_hit_rate")       # the output's plan only (output/summary.output_plan)
    if optimum is not None:
        block = (s.get("block_optimum_cached_tokens") or 0) / s["planned_prompt_tokens"]
        over = "the dataset's" if s.get("optimum_exact") else "each planning window's"
        optimum = f"{over} optimum: {pct(block)} in full KV blocks, {pct(optimum)} token by token"
    items.append(("cache hits", pct(s["cache_hit_rate"]), optimum or "of prompt tokens"))
    if s.get("draft_tokens"):       # --speculative
        items.append(("drafts accepted", pct(s["acceptance_rate"]),
                      f"{s['accepted_tokens']:,} of {s['draft_tokens']:,} drafted tokens"))
    if s.get("wall_s") is not None:
        runs = s.get("runs_recorded") or 1
        items.append(("wall time", seconds(s["wall_s"]), f"over {runs} runs" if runs > 1 else
                      f"plus {seconds(s['model_load_s'])} loading" if s.get("model_load_s") else ""))
    if s.get("decode_tokens_per_s") is not None and not s["completion_tokens"]:       # classify, score, embed
        items.append(("throughput", f"{num(s.get('rows_per_s'), 3)} rows/s",
                      f"{num(s.get('prefill_tokens_per_s'), 3)} prompt tok/s"))
    elif s.get("decode_tokens_per_s") is not None:
        items.append(("throughput", f"{num(s['decode_tokens_per_s'], 3)} tok/s",
                      f"completion; {num(s.get('prefill_tokens_per_s'), 3)} prompt tok/s, "
                      f"{num(s.get('rows_per_s'), 3)} rows/s"))
    if s.get("cost_usd") is not None:
        items.append(("cost", usd(s["cost_usd"]), f"{usd(s.get('cost_per_million_tokens'))} per million tokens"))
    elif s.get("wall_s") is not None:
        items.append(("cost", "not priced", "give --device-hourly-cost"))
    if s.get("rows_reused") or s.get("rows_from_cache"):
        items.append(("reused", f"{(s.get('rows_reused') or 0) + (s.get('rows_from_cache') or 0):,}",
                      f"{s.get('rows_from_cache') or 0:,} from the cache, {s.get('tokens_saved') or 0:,} tokens saved"))
    if s.get("device"):
        devices = s.get("devices") or 1
        quant = s.get("quantization")
        items.append(("device", str(s["device"]) + (f" \u00d7 {devices}" if devices > 1 else ""),
                      f"{quant} weights" if quant not in (None, "none") else ""))
    return cards(items)


def _by_kind(fig: dict) -> str:
    k = fig["by_kind"]
    if fig["kind"] == "classify":
        return _classify(k)
    if fig["kind"] in ("generate", "tokens"):
        return _generate(k)
    if fig["kind"] == "score":
        return _score(k)
    if fig["kind"] == "embed":
        return _embed(k)
    return ""


def _classify(k: dict) -> str:
    out = []
    m = k.get("metrics")
    if m:
        rows = [[name, num(v["precision"], 3), num(v["recall"], 3), num(v["f1"], 3), num(v["support"])]
                for name, v in m["per_label"].items()]
        out.append(f"<p>Accuracy <b>{num(m['accuracy'], 3)}</b>, macro-F1 <b>{num(m['macro_f1'], 3)}</b> over "
                   f"{m['evaluated_rows']:,} rows with a reference.</p>")
        out.append(table(["label", "precision", "recall", "F1", "support"], rows, {1, 2, 3, 4}))
        svgs = [plots.confusion(m["confusion_matrix"])]
        if k.get("reliability"):
            svgs.append(plots.reliability(k["reliability"]))
        svgs.append(plots.paired_bars(k["predicted_labels"], k["reference_labels"], ("predicted", "reference"),
                                      "Labels: predicted against the reference"))
        out.append(figures(svgs))
        if k.get("reliability"):
            out.append(_reliability_table(k["reliability"]))
    else:
        out.append("<p class=\"note\">No reference column: give the job --reference-column for precision, "
                   "recall, the confusion matrix and calibration.</p>")
    svgs = [plots.bars(k["labels"], "Predicted labels")]
    if k.get("confidence"):
        svgs.append(plots.histogram(k["confidence"], "Confidence", "confidence of the predicted label"))
    out.append(figures(svgs))
    return "".join(out)


def _reliability_table(rel: dict) -> str:
    rows = [[f"{b['low']:.1f}\u2013{b['high']:.1f}", num(b["rows"]), num(b["confidence"], 3), num(b["accuracy"], 3)]
            for b in rel["bins"] if b["rows"]]
    return (f"<h3>Calibration: expected calibration error {num(rel['ece'], 3)}</h3>"
            + table(["confidence", "rows", "mean confidence", "accuracy"], rows, {1, 2, 3}))


def _generate(k: dict) -> str:
    out = []
    if k.get("accuracy"):
        a = k["accuracy"]
        out.append(f"<p>Accuracy <b>{num(a['accuracy'], 3)}</b> over {a['evaluated_rows']:,} outputs with a "
                   "reference.</p>")
    rows = [["finish reason: " + r, num(n)] for r, n in k["finish_reasons"].items()]
    for name, label in (("schema_valid", "valid under the JSON schema"),
                        ("constrained_incomplete", "constrained, cut by max_tokens")):
        if k.get(name):
            rows.append([f"{label}: yes", num(k[name]["true"])])
            rows.append([f"{label}: no", num(k[name]["false"])])
    if k.get("truncated_rows"):
        rows.append(["prompts truncated", num(k["truncated_rows"])])
    out.append(table(["", "rows"], rows, {1}))
    svgs = []
    if k.get("completion_tokens"):
        svgs.append(plots.histogram(k["completion_tokens"], "Completion length", "completion tokens"))
    svgs.append(plots.bars(k["finish_reasons"], "Finish reasons"))
    out.append(figures(svgs))
    return "".join(out)


def _score(k: dict) -> str:
    out = []
    if k.get("overall_perplexity") is not None:
        out.append(f"<p>Perplexity <b>{num(k['overall_perplexity'], 4)}</b> over {k['scored_tokens']:,} scored "
                   f"tokens (mean log-probability {num(k['mean_logprob'], 4)}).</p>")
    if k.get("perplexity"):
        out.append(_distribution_table({"perplexity per row": k["perplexity"]}))
        out.append(figures([plots.histogram(k["perplexity"], "Perplexity per row", "perplexity (log scale)")]))
    return "".join(out)


def _embed(k: dict) -> str:
    if not k:
        return ""
    out = [table(["dimensions", "rows"], [[num(d), num(n)] for d, n in k["dimensions"].items()], {0, 1})]
    if k.get("norm"):
        out.append(_distribution_table({"L2 norm": k["norm"]}))
        out.append(figures([plots.histogram(k["norm"], "Embedding norms", "L2 norm")]))
    return "".join(out)


def _distribution_table(dists: dict, fmt=num) -> str:
    rows = [[name, num(d["rows"]), fmt(d["mean"]), fmt(d["p50"]), fmt(d["p95"]), fmt(d["p99"]), fmt(d["max"])]
            for name, d in dists.items() if d]
    return table(["", "rows", "mean", "p50", "p95", "p99", "max"], rows, {1, 2, 3, 4, 5, 6})


def _latency(fig: dict) -> str:
    lat = {f"{k} latency": v for k, v in fig["latency"].items()}
    if not any(lat.values()):
        return "<p class=\"note\">No row was computed (every row failed or was reused).</p>"
    return (_distribution_table(lat, seconds)
            + "<p class=\"note\">Over the rows computed without an error (reused rows took no time); "
              "exact percentiles over every row.</p>"
            + figures([plots.histogram(d, name.capitalize(), "seconds") for name, d in lat.items() if d]))


def _tokens(fig: dict) -> str:
    t = {f"{k} tokens": v for k, v in fig["tokens"].items()}
    out = [_distribution_table(t)]
    runs = fig["runs"]
    if runs:
        rows = [[str(i + 1), r.get("started_at") or "\u2013", num(r.get("rows")), seconds(r.get("wall_s")),
                 num(r.get("rows_per_s"), 3), num(r.get("decode_tokens_per_s"), 3),
                 num(r.get("prefill_tokens_per_s"), 3), "yes" if r.get("interrupted") else ""]
                for i, r in enumerate(runs)]
        out.append("<h3>Runs</h3>" + table(["run", "started", "rows", "wall", "rows/s", "completion tok/s",
                                            "prompt tok/s", "interrupted"], rows, {2, 3, 4, 5, 6}))
    svgs = [plots.histogram(d, name.capitalize() + " per row", "tokens") for name, d in t.items()
            if d and d["max"]]
    if fig["progress"]:
        svgs.append(plots.progress(fig["progress"], runs))
    out.append(figures(svgs))
    return "".join(out)


def _failures(f: dict) -> str:
    if not f["rows"]:
        return "<p>No row failed.</p>"
    groups = [[("pre", g["error"]), num(g["rows"]), ", ".join(g["ids"])] for g in f["groups"]]
    more = f["messages"] - len(f["groups"])
    out = [f"<h3>By message ({f['messages']:,} distinct)</h3>",
           table(["error", "rows", "first ids"], groups, {1}),
           f"<p class=\"note\">and {more:,} more messages</p>" if more > 0 else "",
           f"<h3>The first {len(f['first'])} failed rows</h3>",
           table(["id", "error"], [[r["id"], ("pre", r["error"])] for r in f["first"]])]
    return "".join(out)


def _configuration(c: dict) -> str:
    job = c.get("job") or {}
    rows = [[k, ("pre", value_text(v))] for k, v in job.items()]
    rows += [[k, ("pre", value_text(v))] for k, v in c.items() if k != "job"]
    if not rows:
        return "<p class=\"note\">The output has no manifest.</p>"
    return table(["option", "value"], rows) + f"<p class=\"note\">From {esc('_manifest.json')}.</p>"
