"""Real-world JSON schemas under --json-schema-mode strict and validate (issue 29, item 9).

    python -m benchmarks.schema_bench                          # default model, 128 tokens a schema, CPU
    python -m benchmarks.schema_bench -m dummy:llama --max-tokens 64 --json

The schemas are a sample of JSONSchemaBench (benchmarks/data/jsonschemabench/README.md). For each
category: how many compile in strict mode (our path) and with llguidance's own defaults (strict
must refuse nothing those compile), how many compile in validate mode, and, from one job in
validate mode (one row a schema, `--schema-column`), how many outputs stopped, how many say
schema_valid, and how many were cut by --max-tokens. Every output that says schema_valid true is
checked again here with jsonschema's Draft 2020-12 validator and its format checker; a
disagreement is reported (`recheck_failures`) and makes the exit status 1.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "jsonschemabench"


def sample() -> list[tuple[str, str, str]]:
    """(category, file name, schema text), by category and file name."""
    return [(p.parent.name, p.name, p.read_text()) for p in sorted(DATA.glob("*/*.json"))]


def llguidance_compiles(text: str) -> bool:
    """llguidance with its own defaults, no options of ours."""
    import llguidance
    try:
        return not llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(json.loads(text)))
    except ValueError:
        return False


def recheck(schema: dict, output: str) -> bool:
    import jsonschema
    v = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    try:
        return v.is_valid(json.loads(output))
    except Exception:       # noqa: BLE001 - a schema this validator cannot use
        return False


def main(argv: list[str] | None = None) -> int:
    from jobrunner.engine.sample.constraints import check_constraint
    from jobrunner.engine.api.request import Constraint
    from jobrunner.api.submit import submit
    from jobrunner.output import read_results
    from jobrunner.jobs.schema_check import with_mode

    ap = argparse.ArgumentParser(prog="python -m benchmarks.schema_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON line too")
    args = ap.parse_args(argv)

    schemas = sample()
    table: dict[str, dict] = defaultdict(lambda: defaultdict(int))
    refusals = {}
    for cat, name, text in schemas:
        t = table[cat]
        t["schemas"] += 1
        strict = check_constraint(Constraint("json_schema", text))
        t["strict_compiled"] += strict is None
        t["llguidance_compiled"] += llguidance_compiles(text)
        t["strict_refused_but_llguidance_compiles"] += strict is not None and llguidance_compiles(text)
        validate = check_constraint(Constraint("json_schema", with_mode(text, "validate")))
        t["validate_compiled"] += validate is None
        if validate is not None:
            refusals[f"{cat}/{name}"] = validate
        if strict is not None:
            refusals.setdefault(f"{cat}/{name} (strict)", strict)

    with tempfile.TemporaryDirectory() as tmp:
        ds = Path(tmp) / "schemas.jsonl"
        ds.write_text("\n".join(json.dumps({"id": f"{c}/{n}", "schema": s, "prompt": (
            "Write one JSON object, on one line, that is valid under this JSON schema:\n" + s)})
            for c, n, s in schemas))
        submit(str(ds), str(Path(tmp) / "out"), model=args.model, schema_column="schema",
               json_schema_mode="validate", max_tokens=args.max_tokens, temperature=0.0)
        rows = read_results(str(Path(tmp) / "out")).to_pylist()

    texts = {f"{c}/{n}": s for c, n, s in schemas}
    failures = []
    for row in rows:
        t = table[row["id"].split("/")[0]]
        if row["error"] is not None:
            t["error_rows"] += 1
            continue
        t["stopped"] += row["finish_reason"] == "stop"
        t["truncated"] += row["finish_reason"] == "length"
        t["schema_valid"] += bool(row["schema_valid"])
        if row["schema_valid"] and not recheck(json.loads(texts[row["id"]]), row["output"]):
            failures.append(row["id"])
    keys = dict.fromkeys(k for t in table.values() for k in t)      # every counter any category touched
    total = {k: sum(t[k] for t in table.values()) for k in keys}
    r = {"model": args.model, "max_tokens": args.max_tokens, "by_category": {k: dict(v) for k, v in table.items()},
         "total": total, "validate_compiled_share": total["validate_compiled"] / total["schemas"],
         "recheck_failures": failures, "refusals": refusals}
    cols = ("schemas", "llguidance_compiled", "strict_compiled", "validate_compiled", "stopped", "schema_valid",
            "truncated", "error_rows")
    print("| category | " + " | ".join(cols) + " |")
    print("|:--|" + "--:|" * len(cols))
    for cat, t in [*sorted(table.items()), ("total", total)]:
        print(f"| {cat} | " + " | ".join(str(t.get(c, 0)) for c in cols) + " |")
    for k, v in refusals.items():
        print(f"  refused {k}: {v}")
    print(f"schema_valid rechecked with Draft 2020-12 + format checker: {len(failures)} disagree {failures}")
    if args.json:
        print(json.dumps(r))
    return 1 if failures or total["strict_refused_but_llguidance_compiles"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
