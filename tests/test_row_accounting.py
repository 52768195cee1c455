"""Issue 28: every row that ends in finish_reason "error" says why and counts as failed, a
constraint that can match nothing exits 2 before any work; a row is an input row for the warning
and the summary alike (OpenAI lines with n > 1 count their prompt once); rows reused from the
result cache or dedup are reported apart from computed rows. Tiny models."""
import json
import logging
import os

import pytest
from click.testing import CliRunner

pytest.importorskip("llguidance")

from jobrunner.cli import main  # noqa: E402
from jobrunner.output import read_results, read_stats  # noqa: E402


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def tiny(tiny_hf_model_dir):
    return ["-m", str(tiny_hf_model_dir("llama")), "--no-chat", "--temperature", "1", "--seed", "3"]


@pytest.fixture
def prompts(tmp_path):
    return jsonl(tmp_path / "d.jsonl", [{"id": str(i), "prompt": f"row {i} says"} for i in range(3)])


# ---------------------------------------------------------------- item 5: impossible constraints


@pytest.mark.parametrize("args", [["--regex", r"[^\s\S]"], ["--regex", r"ab[^\s\S]c"],
                                  ["--json-schema", json.dumps({"type": "string", "pattern": r"^[^\s\S]$"})]])
def test_a_constraint_that_matches_nothing_exits_2_before_any_work(tmp_path, tiny, prompts, args):
    r = CliRunner().invoke(main, ["submit", prompts, *tiny, "-o", str(tmp_path / "out"), *args])
    assert r.exit_code == 2, r.output
    assert args[0] in r.output and "Traceback" not in r.output
    assert not (tmp_path / "out").exists()


def test_a_grammar_dead_after_its_first_token_fails_its_rows_with_a_message(tmp_path, tiny, prompts):
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "a" /[^\\s\\S]/\n')        # can start, never end
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["submit", prompts, *tiny, "-o", str(out), "--grammar", str(grammar),
                                  "--max-tokens", "6"])
    rows = read_results(str(out)).to_pylist()
    assert rows and all(row["finish_reason"] == "error" for row in rows), rows
    assert all(row["error"] and "constraint" in row["error"] for row in rows), rows
    assert r.exit_code == 3, r.output        # every row failed
    assert read_stats(str(out))["rows_failed"] == len(rows)


def test_the_engine_refuses_a_constraint_that_matches_nothing_for_its_tokenizer():
    """A row's constraint (--schema-column, OpenAI response_format) compiles in the engine: one that
    can match no text is that row's error, not a row generated to finish_reason "error"."""
    from conftest import TINY_MODEL_VOCAB, make_tiny_tokenizer
    from engine.constraints import ConstraintError, Grammars
    from engine.request import Constraint
    from engine.tokenizer import Tokenizer
    grammars = Grammars(Tokenizer(make_tiny_tokenizer(), eos_token_ids=(2,)), (2,), TINY_MODEL_VOCAB)
    assert grammars.compile(Constraint("regex", "(yes|no)")) is not None
    with pytest.raises(ConstraintError, match="can match no text"):
        grammars.compile(Constraint("regex", r"(yes|no)[^\s\S]"))
