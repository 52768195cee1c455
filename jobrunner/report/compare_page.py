"""The comparison as a self-contained HTML page (tables only: it needs no plot library, so a
scheduler's gate never does), and as the lines `jobrunner compare` prints."""
from __future__ import annotations

from jobrunner.report.html import cards, document, esc, num, pct, section, table, value_text

__all__ = ["render", "lines"]


def _signed(v, digits: int = 3) -> str:
    return "\u2013" if v is None else f"{v:+.{digits}g}"


def _interval(ci) -> str:
    return "\u2013" if not ci else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"


def _verdict(r: dict) -> tuple[str, str]:
    crossed = [g["gate"] for g in r["gates"] if g["crossed"]]
    if crossed:
        return "gate crossed: " + ", ".join(crossed), "bad"
    return ("every gate passed", "ok") if r["gates"] else ("no gate asked", "ok")


def render(r: dict) -> str:
    rows, ch = r["rows"], r["changed"]
    items = [("common rows", num(rows["common"]), f"{rows['only_in_base']:,} only in base, "
                                                  f"{rows['only_in_candidate']:,} only in the candidate"),
             ("changed", pct(ch["rate"]), f"{ch['rows']:,} rows, {ch['status_changed']:,} ok on one side only")]
    acc = r["metrics"].get("accuracy")
    if acc:
        items.append(("accuracy", f"{num(acc['base'], 3)} \u2192 {num(acc['candidate'], 3)}",
                      f"{_signed(acc['delta'])}, 95% {_interval(acc.get('interval'))}"))
    cost = r["costs"].get("cost_per_row_usd")
    if cost and cost.get("relative") is not None:
        items.append(("cost per row", _signed(cost["relative"] * 100, 3) + "%", ""))
    body = [cards(items)]
    if r["gates"]:
        body.append(section("Gates", table(["gate", "limit", "value", "crossed"], [
            [g["gate"], num(g["limit"]), num(g["value"]), "yes" if g["crossed"] else "no"] for g in r["gates"]],
            {1, 2}), "gates"))
    body.append(section("Changed rows", _changed(r), "changed"))
    if r["metrics"]:
        body.append(section("Metrics (paired, over the common rows)", _metrics(r["metrics"]), "metrics"))
    body.append(section("Tokens, cost and throughput", _costs(r["costs"]), "costs"))
    diffs = [[d["key"], ("pre", value_text(d["base"])), ("pre", value_text(d["candidate"]))]
             for d in r["config_differences"]]
    body.append(section("Configuration differences",
                        table(["option", "base", "candidate"], diffs) if diffs else "<p>None.</p>", "config"))
    return document("jobrunner compare", f"base {r['base']} \u00b7 candidate {r['candidate']} \u00b7 {r['kind']}",
                    "".join(body), _verdict(r))


def _changed(r: dict) -> str:
    ch, rows = r["changed"], r["rows"]
    out = [f"<p>{ch['rows']:,} of {rows['common']:,} common rows changed ({pct(ch['rate'])}); "
           f"{rows['inputs_changed']:,} have different inputs.</p>"]
    if ch.get("transitions"):
        out.append("<h3>Label transitions</h3>" + table(["base", "candidate", "rows"], [
            [t["base"], t["candidate"], num(t["rows"])] for t in ch["transitions"]], {2}))
    if ch["top"]:
        out.append("<h3>Top changed rows</h3>" + table(["id", "base", "candidate"], [
            [t["id"], ("pre", t["base"]), ("pre", t["candidate"])] for t in ch["top"]]))
    for side in ("base", "candidate"):
        ids = rows[f"only_in_{side}_ids"]
        if ids:
            out.append(f"<p class=\"note\">Only in the {side}: {esc(', '.join(ids))}"
                       f"{' ...' if rows[f'only_in_{side}'] > len(ids) else ''}</p>")
    return "".join(out)


def _metrics(m: dict) -> str:
    rows = []
    for name in ("accuracy", "macro_f1", "perplexity"):
        d = m.get(name)
        if d:
            rows.append([name, num(d["base"], 4), num(d["candidate"], 4), _signed(d["delta"]),
                         _interval(d.get("interval"))])
    out = [table(["metric", "base", "candidate", "delta", "95% bootstrap interval"], rows, {1, 2, 3})]
    if m.get("mcnemar"):
        t = m["mcnemar"]
        out.append(f"<p>McNemar's exact test: {t['base_only_right']:,} rows right only in the base, "
                   f"{t['candidate_only_right']:,} only in the candidate; p = {num(t['p_value'], 3)}.</p>")
    if m.get("per_label"):
        out.append("<h3>Per label</h3>" + table(
            ["label", "precision", "recall", "F1", "F1 delta", "support"],
            [[k, f"{num(v['precision']['base'], 3)} \u2192 {num(v['precision']['candidate'], 3)}",
              f"{num(v['recall']['base'], 3)} \u2192 {num(v['recall']['candidate'], 3)}",
              f"{num(v['f1']['base'], 3)} \u2192 {num(v['f1']['candidate'], 3)}", _signed(v["f1"]["delta"]),
              num(v["support"]["base"])] for k, v in m["per_label"].items()], {4, 5}))
    return "".join(out)


def _costs(c: dict) -> str:
    rows = [[k, num(d["base"]), num(d["candidate"]), _signed(d["delta"]),
             "\u2013" if d["relative"] is None else f"{d['relative']:+.1%}"]
            for k, d in c.items() if k != "per_common_row"]
    rows += [[f"{k} per common row", num(d["base"]), num(d["candidate"]), _signed(d["delta"]),
              "\u2013" if d["relative"] is None else f"{d['relative']:+.1%}"]
             for k, d in (c.get("per_common_row") or {}).items()]
    return table(["figure", "base", "candidate", "delta", "relative"], rows, {1, 2, 3, 4})


def lines(r: dict) -> list[str]:
    """What `jobrunner compare` prints: about ten lines."""
    rows, ch = r["rows"], r["changed"]
    out = [("base", r["base"]), ("candidate", r["candidate"]),
           ("rows", f"{rows['common']:,} in common, {rows['only_in_base']:,} only in base, "
                    f"{rows['only_in_candidate']:,} only in the candidate"),
           ("changed", f"{ch['rows']:,} rows ({pct(ch['rate'])}), {ch['status_changed']:,} ok on one side only")]
    if r.get("determinism") is not None:     # both batch-invariant with the same settings
        d = r["determinism"]
        out.append(("determinism", f"{d['rows']:,} unchanged rows differ in a bit (both outputs --deterministic with "
                                   f"the same model and settings: a failure, not a change)"
                                   + (f": {', '.join(map(str, d['ids']))}" if d["ids"] else "")))
    if rows.get("duplicates_in_base") or rows.get("duplicates_in_candidate"):
        out.insert(3, ("duplicates", f"{rows['duplicates_in_base']:,} in base, {rows['duplicates_in_candidate']:,} in "
                                     f"the candidate: error rows of repeated ids, not compared"))
    m = r["metrics"]
    if m.get("accuracy"):
        a = m["accuracy"]
        out.append(("accuracy", f"{num(a['base'], 4)} -> {num(a['candidate'], 4)} ({_signed(a['delta'])}, 95% "
                                f"{_interval(a.get('interval'))}; McNemar p = {num(m['mcnemar']['p_value'], 3)})"))
    if m.get("macro_f1"):
        f = m["macro_f1"]
        out.append(("macro-F1", f"{num(f['base'], 4)} -> {num(f['candidate'], 4)} ({_signed(f['delta'])}, 95% "
                                f"{_interval(f.get('interval'))})"))
    if m.get("perplexity"):
        p = m["perplexity"]
        out.append(("perplexity", f"{num(p['base'], 5)} -> {num(p['candidate'], 5)} ({_signed(p['delta'])})"))
    c = r["costs"]
    for key, name in (("cost_per_row_usd", "cost/row"), ("decode_tokens_per_s", "tokens/s"),
                      ("rows_per_s", "rows/s")):
        d = c.get(key)
        if d and d["relative"] is not None:
            out.append((name, f"{num(d['base'])} -> {num(d['candidate'])} ({d['relative']:+.1%})"))
    if r["config_differences"]:
        shown = ", ".join(d["key"] for d in r["config_differences"][:6])
        more = len(r["config_differences"]) - 6
        out.append(("config", shown + (f" and {more} more" if more > 0 else "") + " differ"))
    for g in r["gates"]:
        out.append(("gate", f"{g['gate']} {num(g['value'])} against {num(g['limit'])}: "
                            f"{'CROSSED' if g['crossed'] else 'ok'}"))
    return [f"{k:11s} {v}" for k, v in out]
