"""JSON schemas beyond the grammar (issue 29, item 9): integer keywords written as decimals compile,
--json-schema-mode strict refuses what llguidance cannot enforce while validate compiles what it can,
every finished output under a schema is checked with jsonschema (schema_valid true/false, null
without a schema, false when cut), the summary counts the failures, and an OpenAI line picks its
own mode with "x-jobrunner-schema-mode"."""
from __future__ import annotations

import json

import jsonschema
import pytest

pytest.importorskip("llguidance")

from jobrunner.engine.sample.constraints import check_constraint, integer_keywords_as_ints  # noqa: E402
from jobrunner.engine.api.request import Constraint  # noqa: E402
from jobrunner.jobs.schema_check import SchemaCheck, with_mode  # noqa: E402
from tests.cli_helpers import jsonl, submit  # noqa: E402

GOOD = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}
# llguidance cannot enforce `not`: strict refuses it; validate ignores it, so every finished
# output ({"n": <integer>}) breaks it and must say schema_valid false
NEVER = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9,
                                                "not": {"type": "integer"}}},
         "required": ["n"], "additionalProperties": False}
# a oneOf that llguidance cannot prove disjoint (refused unless coerced to anyOf)
ONE_OF = {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 5}]}},
          "required": ["v"], "additionalProperties": False}


@pytest.fixture
def tiny(tiny_hf_model_dir):
    return ["-m", str(tiny_hf_model_dir("llama")), "--no-chat", "--temperature", "1", "--seed", "3"]


def test_integer_keywords_written_as_decimals_compile():
    schema = {"type": "object", "minProperties": 1.0, "properties": {
        "tags": {"type": "array", "items": {"type": "string", "minLength": 1.0, "maxLength": 8.0}, "maxItems": 2.0},
        "maxItems": {"const": {"maxItems": 2.0}}}, "required": ["tags", "maxItems"]}
    assert check_constraint(Constraint("json_schema", json.dumps(schema))) is None
    fixed = integer_keywords_as_ints(schema)
    tags = fixed["properties"]["tags"]
    assert type(tags["maxItems"]) is int and type(tags["items"]["maxLength"]) is int and fixed["minProperties"] == 1
    assert type(fixed["properties"]["maxItems"]["const"]["maxItems"]) is float    # an instance: left as written
    # 2.5 is not an integer: still refused, with llguidance's reason
    assert "maxItems" in check_constraint(Constraint("json_schema", json.dumps({"type": "array", "maxItems": 2.5})))


def test_validate_mode_compiles_what_strict_refuses():
    for schema, reason in ((NEVER, "not"), (ONE_OF, "oneOf"),
                           ({"type": "object", "dependencies": {"a": ["b"]}}, "dependencies")):
        text = json.dumps(schema)
        assert reason in check_constraint(Constraint("json_schema", text))
        assert check_constraint(Constraint("json_schema", with_mode(text, "validate"))) is None
        assert with_mode(text, "strict") == text


def test_schema_check():
    check, text = SchemaCheck(), json.dumps(GOOD)
    assert check.valid(text, '{"ok": true}', "stop") is True
    assert check.valid(text, '{"ok": 1}', "stop") is False
    assert check.valid(text, '{"ok": true}', "length") is False           # a cut output is never valid
    assert check.valid(text, '{"ok": tr', "stop") is False                 # not JSON
    date = json.dumps({"type": "string", "format": "date"})
    assert check.valid(date, '"2024-02-29"', "stop") and not check.valid(date, '"2024-13-45"', "stop")
    draft7 = json.dumps({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                         "dependencies": {"a": ["b"]}})
    assert check.valid(draft7, '{"b": 1}', "stop") and not check.valid(draft7, '{"a": 1}', "stop")


def test_strict_refuses_validate_checks_and_counts(tmp_path, tiny):
    ds = jsonl(tmp_path / "d.jsonl", [{"id": f"g{i}", "prompt": f"row {i}", "schema": json.dumps(GOOD)}
                                      for i in range(3)]
               + [{"id": f"n{i}", "prompt": f"row {i}", "schema": json.dumps(NEVER)} for i in range(3)])
    r, rows = submit(tmp_path, ds, *tiny, "--schema-column", "schema", "--max-tokens", "24")
    assert r.exit_code == 0, r.output
    by_id = {row["id"]: row for row in rows}
    assert all("not" in by_id[f"n{i}"]["error"] for i in range(3))             # strict: refused rows
    assert all(by_id[f"n{i}"].get("schema_valid") is None for i in range(3))
    r, rows = submit(tmp_path, ds, *tiny, "--schema-column", "schema", "--max-tokens", "24",
                     "--json-schema-mode", "validate", out="v")
    assert r.exit_code == 0, r.output
    by_id = {row["id"]: row for row in rows}
    assert all(row["error"] is None and isinstance(row["schema_valid"], bool) for row in rows)
    for row in rows:                # schema_valid true means jsonschema agrees (2020-12, format checker)
        schema = GOOD if row["id"].startswith("g") else NEVER
        ok = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).is_valid
        assert row["schema_valid"] == (row["finish_reason"] == "stop" and ok(json.loads(row["output"])))
    assert not any(by_id[f"n{i}"]["schema_valid"] for i in range(3))
    stats = json.loads((tmp_path / "v" / "_stats.json").read_text())
    valid = sum(row["schema_valid"] for row in rows)
    assert stats["schema_valid"] == valid and stats["schema_invalid"] == 6 - valid >= 3
    assert f"{6 - valid} of 6 outputs under a JSON schema do not validate" in r.output


def test_option_and_toml_and_bad_values(tmp_path, tiny):
    ds = jsonl(tmp_path / "d.jsonl", [{"id": str(i), "prompt": f"row {i}"} for i in range(2)])
    r, _ = submit(tmp_path, ds, *tiny, "--json-schema", json.dumps(ONE_OF))
    assert r.exit_code == 2 and "oneOf" in r.output
    toml = tmp_path / "job.toml"
    toml.write_text(f"json_schema = '{json.dumps(ONE_OF)}'\njson_schema_mode = \"validate\"\nmax_tokens = 2\n")
    r, rows = submit(tmp_path, ds, *tiny, "--config", str(toml), out="t")
    assert r.exit_code == 0, r.output
    assert all(row["finish_reason"] == "length" and row["schema_valid"] is False for row in rows)   # cut: invalid
    r, _ = submit(tmp_path, ds, *tiny, "--json-schema-mode", "loose", out="bad")
    assert r.exit_code == 2 and "loose" in r.output
    r, _ = submit(tmp_path, ds, *tiny, "--kind", "score", "--score-column", "prompt", "--json-schema-mode",
                  "validate", out="bad2")
    assert r.exit_code == 2 and "--json-schema-mode applies to --kind generate" in r.output


def test_openai_line_picks_its_mode(tmp_path, tiny):
    def line(cid, mode=None, schema=ONE_OF):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi " + cid}], "max_tokens": 24}
        if schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        if mode is not None:
            body["x-jobrunner-schema-mode"] = mode
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}
    ds = jsonl(tmp_path / "b.jsonl", [line("validate", "validate"), line("strict", "strict"), line("default"),
                                      line("bad", "lax"), line("plain", schema=None)])
    r, rows = submit(tmp_path, ds, "-m", tiny[1], "--temperature", "1", "--seed", "5", "--any-model", "--output-format",
                     "openai-batch")
    assert r.exit_code == 0, r.output
    by_id = {row["id"]: row for row in rows}
    assert by_id["validate"]["error"] is None and isinstance(by_id["validate"]["schema_valid"], bool)
    assert "oneOf" in by_id["strict"]["error"] and "oneOf" in by_id["default"]["error"]
    assert "x-jobrunner-schema-mode" in by_id["bad"]["error"]
    assert by_id["plain"]["error"] is None and by_id["plain"].get("schema_valid") is None   # no schema: null
