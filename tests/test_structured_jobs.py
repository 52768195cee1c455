"""Structured output as a job: the options (and TOML), a schema per row, OpenAI response_format,
exit 2 for a bad option, error rows for bad row schemas, constrained_incomplete in the summary;
and every constraint kind on the default model."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from click.testing import CliRunner

pytest.importorskip("llguidance")

from jobrunner.cli.main import main  # noqa: E402
from jobrunner.output import read_results  # noqa: E402
from tests.cli_helpers import jsonl, submit

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture
def tiny(tiny_hf_model_dir):
    return ["-m", str(tiny_hf_model_dir("llama")), "--no-chat", "--temperature", "1", "--seed", "3"]


@pytest.fixture
def prompts(tmp_path):
    return jsonl(tmp_path / "d.jsonl", [{"id": str(i), "prompt": f"row {i} says"} for i in range(4)])


def test_choice_option_and_toml(tmp_path, tiny, prompts):
    r, rows = submit(tmp_path, prompts, *tiny, "--choice", "yes,no,maybe", "--max-tokens", "8")
    assert r.exit_code == 0, r.output
    assert {row["output"] for row in rows} <= {"yes", "no", "maybe"}
    assert all(row["finish_reason"] == "stop" and row["constrained_incomplete"] is False for row in rows)
    toml = tmp_path / "job.toml"
    toml.write_text('regex = "[0-9]{2}-[a-z]{1,3}"\nmax_tokens = 12\n')
    r, rows = submit(tmp_path, prompts, *tiny, "--config", str(toml), out="out2")
    assert r.exit_code == 0, r.output
    stopped = [row["output"] for row in rows if row["finish_reason"] == "stop"]
    assert stopped and all(re.fullmatch("[0-9]{2}-[a-z]{1,3}", t) for t in stopped)


def test_json_schema_file_and_incomplete_count(tmp_path, tiny, prompts):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    r, rows = submit(tmp_path, prompts, *tiny, "--json-schema", str(schema), "--max-tokens", "24")
    assert r.exit_code == 0, r.output
    stopped = [row for row in rows if row["finish_reason"] == "stop"]
    assert stopped
    for row in stopped:
        jsonschema.validate(json.loads(row["output"]), SCHEMA)
    r, rows = submit(tmp_path, prompts, *tiny, "--json-schema", json.dumps(SCHEMA), "--max-tokens", "2", out="cut")
    assert r.exit_code == 0 and all(row["constrained_incomplete"] for row in rows)
    stats = json.loads((tmp_path / "cut" / "_stats.json").read_text())
    assert stats["constrained_incomplete"] == 4
    assert "4 constrained outputs cut by --max-tokens" in r.output


def test_schema_column_bad_rows_are_errors(tmp_path, tiny):
    good = json.dumps(SCHEMA)
    ds = jsonl(tmp_path / "d.jsonl", [
        {"id": "a", "prompt": "x", "schema": good}, {"id": "b", "prompt": "y", "schema": "{broken"},
        {"id": "c", "prompt": "z", "schema": json.dumps({"type": "nonsense"})}, {"id": "d", "prompt": "w"},
        {"id": "e", "prompt": "v", "schema": good}])
    r, rows = submit(tmp_path, ds, *tiny, "--schema-column", "schema", "--max-tokens", "4")
    assert r.exit_code == 0, r.output
    by_id = {row["id"]: row for row in rows}
    assert set(by_id) == {"a", "b", "c", "d", "e"}
    assert by_id["b"]["error"] and by_id["c"]["error"] and "schema" in by_id["d"]["error"]
    assert by_id["a"]["error"] is None and by_id["e"]["error"] is None


@pytest.mark.parametrize("args,message", [
    (["--json-schema", '{"type": "objectx"}'], "--json-schema"),
    (["--json-schema", "/no/such/schema.json"], "cannot read"),
    (["--regex", "a(b"], "--regex"),
    (["--grammar", "MISSING"], "--grammar"),
    (["--json", "--regex", "a"], "contradict"),
    (["--choice", "a,a"], "duplicates"),
    (["--choice", "a", "--kind", "score", "--score-column", "prompt"], "--kind generate"),
    (["--json", "--grammar-timeout", "0"], "--grammar-timeout"),
])
def test_bad_options_exit_2_before_any_work(tmp_path, tiny, prompts, args, message):
    r, _ = submit(tmp_path, prompts, *tiny, *args)
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("part*"))


def test_grammar_file_and_timeout_option(tmp_path, tiny, prompts, monkeypatch):
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "{" /[a-z]{1,4}/ "}"\n')
    r, rows = submit(tmp_path, prompts, *tiny, "--grammar", str(grammar), "--max-tokens", "12")
    assert r.exit_code == 0, r.output
    stopped = [row["output"] for row in rows if row["finish_reason"] == "stop"]
    assert stopped and all(re.fullmatch(r"\{[a-z]{1,4}\}", t) for t in stopped)
    import jobrunner.engine as ec             # the public name jobrunner calls
    slow = ec.check_constraint

    def never_done(c):
        import time
        time.sleep(3)
        return slow(c)
    monkeypatch.setattr(ec, "check_constraint", never_done)
    r, _ = submit(tmp_path, prompts, *tiny, "--grammar", str(grammar), "--grammar-timeout", "0.2", out="t")
    assert r.exit_code == 2 and "did not compile within 0.2 s" in r.output


def test_openai_response_format(tmp_path, tiny):
    def line(cid, rf):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi " + cid}], "max_tokens": 40}
        if rf is not None:
            body["response_format"] = rf
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}
    ds = jsonl(tmp_path / "b.jsonl", [
        line("schema", {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}),
        line("object", {"type": "json_object"}), line("text", {"type": "text"}),
        line("bad", {"type": "xml"}), line("noschema", {"type": "json_schema", "json_schema": {"name": "x"}})])
    r = CliRunner().invoke(main, ["submit", ds, "-o", str(tmp_path / "out"), "-m", tiny[1], "--temperature", "1",
                                  "--seed", "5", "--output-format", "openai-batch",
                                  "--served-model-name", "m"])
    assert r.exit_code == 0, r.output
    by_id = {row["id"]: row for row in read_results(str(tmp_path / "out")).to_pylist()}
    assert "response_format" in by_id["bad"]["error"] and "schema" in by_id["noschema"]["error"]
    assert by_id["text"]["error"] is None and by_id["text"].get("constrained_incomplete") is None
    if by_id["schema"]["finish_reason"] == "stop":
        jsonschema.validate(json.loads(by_id["schema"]["output"]), SCHEMA)
    if by_id["object"]["finish_reason"] == "stop":
        assert isinstance(json.loads(by_id["object"]["output"]), dict)
    assert by_id["schema"]["constrained_incomplete"] is not None
    lines = [json.loads(x) for x in (tmp_path / "out" / "results.openai.jsonl").read_text().splitlines()]
    lines += [json.loads(x) for x in (tmp_path / "out" / "errors.openai.jsonl").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == sorted(["schema", "object", "text", "bad", "noschema"])


# ----------------------------------------------------------------------------- the default model

@pytest.mark.slow
@pytest.mark.default_model
def test_every_constraint_kind_on_the_default_model(default_gguf_path):
    """Chat prompts that invite each kind, one engine; every row that stops is valid, and most stop."""
    from jobrunner.engine.config.engine_config import EngineConfig
    from jobrunner.engine.core.engine import Engine
    from jobrunner.engine.api.request import Constraint, Request, SamplingParams

    engine = Engine(EngineConfig(model=str(default_gguf_path), kv_cache_memory=64 * 2**20))
    tok = engine.tokenizer
    people = ["Ada Lovelace, 36, London", "Alan Turing, 41, Manchester"]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "age": {"type": "integer"}, "city": {"type": "string",
                                                                                    "maxLength": 20}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    cities = ["London", "Manchester", "Paris"]
    kinds = {
        Constraint("json_schema", json.dumps(schema)): lambda t: jsonschema.validate(json.loads(t), schema),
        Constraint("json"): lambda t: isinstance(json.loads(t), dict) or pytest.fail(t),
        Constraint("regex", r"[A-Z][a-z]+ is [0-9]{1,3}"):
            lambda t: re.fullmatch(r"[A-Z][a-z]+ is [0-9]{1,3}", t) or pytest.fail(t),
        Constraint("choice", json.dumps(cities)): lambda t: t in cities or pytest.fail(t),
        Constraint("grammar", 'root ::= "{" [a-zA-Z ]+ "}"'): lambda t: re.fullmatch(r"\{[a-zA-Z ]+\}", t) or pytest.fail(t),
    }
    reqs = []
    for k, c in enumerate(kinds):
        for i, p in enumerate(people):
            text = tok.apply_chat_template([{"role": "user", "content": f"Extract name, age and city: {p}"}])
            reqs.append(Request(f"{k}-{i}", tok.encode(text), SamplingParams(max_tokens=40), constraint=c))
    outs = engine.generate(reqs)
    for k, valid in enumerate(kinds.values()):
        mine = [o for o in outs if o.id.startswith(f"{k}-")]
        assert all(o.error is None for o in mine)
        stopped = [o.text for o in mine if o.finish_reason == "stop"]
        assert stopped, [o.text for o in mine]
        for text in stopped:
            valid(text)
