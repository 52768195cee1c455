"""Issue 28: every row that ends in finish_reason "error" says why and counts as failed, a
constraint that can match nothing exits 2 before any work; a row is an input row for the warning
and the summary alike (OpenAI lines with n > 1 count their prompt once); rows reused from the
result cache or dedup are reported apart from computed rows. Tiny models."""
import json
import logging
import re

import pytest
from click.testing import CliRunner

pytest.importorskip("llguidance")

from jobrunner.cli.main import main  # noqa: E402
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
    from jobrunner.engine.sample.constraints import ConstraintError, Grammars
    from jobrunner.engine.api.request import Constraint
    from jobrunner.engine.load.tokenizer import Tokenizer
    grammars = Grammars(Tokenizer(make_tiny_tokenizer(), eos_token_ids=(2,)), (2,), TINY_MODEL_VOCAB)
    assert grammars.compile(Constraint("regex", "(yes|no)")) is not None
    with pytest.raises(ConstraintError, match="can match no text"):
        grammars.compile(Constraint("regex", r"(yes|no)[^\s\S]"))


# ---------------------------------------------------------------- items 9 and 11: one definition of a row


def test_openai_lines_with_n_count_one_row_and_one_prompt(tmp_path, tiny, caplog):
    def line(cid, **body):
        return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
                "body": {"model": "m", "prompt": f"The quick brown fox {cid}", "max_tokens": 3, **body}}
    ds = jsonl(tmp_path / "b.jsonl", [line("two", n=2, temperature=1.0, seed=1), line("one"),
                                      line("bad", tools=[{"type": "function", "function": {"name": "f"}}])])
    out = str(tmp_path / "out")
    with caplog.at_level(logging.WARNING, logger="jobrunner"):
        r = CliRunner().invoke(main, ["submit", ds, *tiny, "--format", "openai-batch", "--any-model", "-o", out])
    assert r.exit_code == 0, r.output
    rows = read_results(out).to_pylist()
    assert sorted(row["id"] for row in rows) == ["bad", "one", "two", "two"]
    prompt = {row["id"]: row["prompt_tokens"] for row in rows}         # a line's samples share its prompt
    s = read_stats(out)
    assert s["rows"] == 3 and s["rows_failed"] == 1
    assert s["prompt_tokens"] == sum(prompt.values()) == s["runs"][-1]["prompt_tokens"]
    assert s["completion_tokens"] == sum(row["completion_tokens"] or 0 for row in rows)
    assert "1 of 3 rows failed" in caplog.text and re.search(r"^rows +3: 2 ok, 1 failed", r.output, re.M)


# ---------------------------------------------------------------- item 10: reused rows apart


@pytest.fixture(scope="module")
def cache_engine(tmp_path_factory):
    from jobrunner.pipeline.build import load_engine
    from jobrunner.config.job import job_config
    from tests.cache_helpers import tiny_model
    return load_engine(job_config("unused", model=tiny_model(tmp_path_factory.mktemp("m")), device="cpu"))


def test_reused_rows_carry_no_timings_and_stay_out_of_throughput_and_latency(cache_engine, tmp_path):
    from tests.cache_helpers import prompts, run_job, write_jsonl
    p = prompts(2)
    ds = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": p[0]}, {"id": "copy", "prompt": p[0]},
                                            {"id": "c", "prompt": p[1]}])
    cache = str(tmp_path / "cache")
    first = run_job(cache_engine, ds, str(tmp_path / "o1"), cache=cache)
    rows = {r["id"]: r for r in read_results(first.output).to_pylist()}
    timing = ("cached_tokens", "queue_s", "prefill_s", "decode_s")
    assert rows["copy"]["reused"] and all(rows["copy"][k] is None for k in timing), rows["copy"]
    assert not rows["a"]["reused"] and all(rows["a"][k] is not None for k in timing)
    assert rows["copy"]["prompt_tokens"] == rows["a"]["prompt_tokens"]         # the output's tokens stay
    s = first.stats
    assert s["rows"] == 3 and s["rows_computed"] == 2
    assert s["computed_prompt_tokens"] == rows["a"]["prompt_tokens"] + rows["c"]["prompt_tokens"]
    assert s["prompt_tokens"] == s["computed_prompt_tokens"] + rows["copy"]["prompt_tokens"]

    again = run_job(cache_engine, ds, str(tmp_path / "o2"), cache=cache)      # every row reused
    s = again.stats
    assert s["rows"] == 3 and s["rows_from_cache"] == 2 and s["rows_reused"] == 1 and s["rows_computed"] == 0
    assert s["prefill_tokens_per_s"] == s["decode_tokens_per_s"] == s["rows_per_s"] == 0
    assert s["cache_hit_rate"] == 0.0 and s["cached_tokens"] == 0
    assert all(s[f"{k}_s_p{q}"] is None for k in ("queue", "prefill", "decode") for q in (50, 95, 99))
    assert s["prompt_tokens"] == first.stats["prompt_tokens"] and s["tokens_saved"] > 0
    rows = read_results(again.output).to_pylist()
    assert all(r["reused"] and r["prefill_s"] is None for r in rows)


# ------------------------------------------------------------- issue 41, item 9: counts that agree

def test_validate_submit_stats_and_a_resumed_progress_count_the_same_failed_rows(tmp_path, tiny, caplog):
    """Duplicate ids fail in validate as in submit; error rows the engine never saw are not computed
    (stats --all); a resumed run's progress counts the earlier failed rows it skips."""
    rows = [{"id": str(i), "prompt": f"row {i} says"} for i in range(6)]
    rows += [{"id": "1", "prompt": "again"}, {"id": "2", "prompt": "again"}, {"id": "x", "prompt": None}]
    ds = jsonl(tmp_path / "d.jsonl", rows)
    out = str(tmp_path / "out")
    v = CliRunner().invoke(main, ["validate", ds, *tiny])
    assert v.exit_code == 0, v.output
    assert re.search(r"rows_with_errors\s+3\b", v.output) and re.search(r"duplicate_ids\s+2\b", v.output), v.output
    assert "duplicate id: an earlier row has the same id" in v.output and "prompt column" in v.output
    r = CliRunner().invoke(main, ["submit", ds, *tiny, "--max-tokens", "2", "-o", out])
    assert r.exit_code == 0, r.output
    s = read_stats(out)
    assert s["rows_failed"] == 3 and s["rows_computed"] == 6, s
    st = CliRunner().invoke(main, ["stats", "--all", out])
    assert re.search(r"rows_computed\s+6\b", st.output), st.output
    # the same job resumed with more rows: its progress line starts from the 3 failed rows already written
    more = jsonl(tmp_path / "d.jsonl", rows + [{"id": "new", "prompt": "a new row"}])
    import jobrunner.pipeline.progress as progress
    with caplog.at_level(logging.INFO, logger="jobrunner"):
        old, progress.LOG_EVERY_S = progress.LOG_EVERY_S, 0.0
        try:
            r = CliRunner().invoke(main, ["submit", more, *tiny, "--max-tokens", "2", "-o", out])
        finally:
            progress.LOG_EVERY_S = old
    assert r.exit_code == 0, r.output
    lines = re.findall(r"(\d+)/10 rows \([\d.]+%\),(?: \d+ in flight,)? (\d+) failed", caplog.text)
    assert lines and all(int(f) >= 3 for _, f in lines), caplog.text
