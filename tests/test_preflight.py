"""Issue 28's checks before any work: a mistyped column option, a CSV with an unclosed quote, an
empty dataset under --fail-on-empty and --n > 1 at a greedy default exit 2 before the model loads
and write nothing; a rerun with nothing left loads no model; classify's label delimiter; messages
with text parts; the progress line's tokens/s during a prefill; the Hub's offline hint."""
import json
import logging
import os
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from jobrunner.pipeline import checks, build
from jobrunner.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["-m", f"dummy:{ROOT}/benchmarks/configs/tiny-llama.json", "--kv-cache-memory", "4MB", "--no-chat"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def no_model(monkeypatch):
    def load_engine(cfg, resolved=None):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(build, "load_engine", load_engine)


def invoke(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exc_info
    return r


# --- 6: every column option given must name a column -------------------------------------------

@pytest.mark.parametrize("argv,option", [
    (["--id-column", "nope"], "--id-column 'nope'"),
    (["--id-column", "id"], "--id-column 'id'"),            # given at its default: still checked
    (["--prompt-column", "nope", "--template", "{text}"], "--prompt-column 'nope'"),   # given, though unused
    (["--reference-column", "nope"], "--reference-column 'nope'"),
    (["--messages-column", "nope"], "--messages-column 'nope'"),
])
@pytest.mark.parametrize("command", ["submit", "validate"])
def test_a_column_option_given_must_name_a_column(tmp_path, no_model, command, argv, option):
    ds = write_jsonl(tmp_path / "d.jsonl", [{"key": "a", "prompt": "hi", "text": "t"}])
    r = invoke(command, ds, *argv, *TINY)
    assert r.exit_code == 2, r.output
    assert option in r.output and "its columns are: key, prompt, text" in r.output
    assert not (tmp_path / "d.jsonl.results").exists()


def test_a_column_option_from_toml_is_checked_too(tmp_path, no_model):
    ds = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "hi"}])
    (tmp_path / "job.toml").write_text('id_column = "row_id"\n')
    r = invoke("submit", ds, "--config", tmp_path / "job.toml", *TINY)
    assert r.exit_code == 2 and "--id-column 'row_id'" in r.output, r.output


def test_the_default_id_column_may_be_absent(tmp_path):
    from jobrunner.api.submit import build_config
    ds = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    cfg = build_config(ds, {})
    named = checks.named_columns(cfg.options(), cfg.given, cfg.kind.name, cfg.prompt.template)
    assert named == {"prompt_column": "prompt"}           # the default id column is not named: it may be absent
    assert checks.check_dataset(cfg.input, named)[1] == ["prompt"]     # rows are numbered


# --- 7: an unclosed CSV quote ------------------------------------------------------------------

@pytest.mark.parametrize("command", ["submit", "validate"])
def test_an_unclosed_csv_quote_stops_naming_its_line(tmp_path, no_model, command):
    ds = tmp_path / "d.csv"
    ds.write_text('id,prompt\n1,"unclosed quote\n2,fine\n')
    r = invoke(command, ds, *TINY)
    assert r.exit_code == 2 and "line 2: a quoted field opens here and is never closed" in r.output, r.output
    assert not (tmp_path / "d.csv.results").exists()


def test_a_csv_delimiter_option_and_a_hint_when_the_header_is_one_column(tmp_path, no_model):
    """--csv-delimiter reads a file sniffing would misread; a header read as one column that holds a
    delimiter says which option to pass (issue 41, item 7)."""
    ds = tmp_path / "odd.csv"
    ds.write_text("id:prompt\n1:hi\n")
    r = invoke("validate", ds, *TINY)
    assert r.exit_code == 2 and "'prompt' is not a column" in r.output and "--csv-delimiter" not in r.output
    assert invoke("validate", ds, "--csv-delimiter", ":", *TINY).exit_code == 0
    semi = tmp_path / "semi.csv"
    semi.write_text("id;prompt\n1;hi\n")
    r = invoke("validate", semi, "--csv-delimiter", ",", *TINY)
    assert r.exit_code == 2 and "pass --csv-delimiter ';'" in r.output, r.output
    r = invoke("validate", semi, "--csv-delimiter", ";;", *TINY)
    assert r.exit_code == 2 and "--csv-delimiter must be one character" in r.output, r.output


def test_a_quoted_field_over_too_many_lines_stops(tmp_path, no_model):
    ds = tmp_path / "d.csv"
    ds.write_text('id,prompt\n1,"a\nb\nc\nd"\n2,x\n')
    r = invoke("validate", ds, "--csv-max-lines", "3", *TINY)
    assert r.exit_code == 2 and "line 2" in r.output and "more than --csv-max-lines 3" in r.output, r.output


def test_multi_line_cells_within_the_limit_are_rows():
    from jobrunner.dataset.csv_reader import check_quotes
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
        f.write('id,prompt\n1,"a\nb"\n2,"say ""hi"""\n')
    check_quotes(f.name, 2)
    os.unlink(f.name)


# --- 13: found before the model loads, nothing written ---------------------------------------

def test_fail_on_empty_exits_2_before_the_model_and_writes_nothing(tmp_path, no_model):
    ds = tmp_path / "empty.jsonl"
    ds.write_text("")
    r = invoke("submit", ds, "--fail-on-empty", *TINY)
    assert r.exit_code == 2 and "has no rows" in r.output, r.output
    assert not (tmp_path / "empty.jsonl.results").exists()


def test_n_over_1_at_the_checkpoints_greedy_default_exits_before_the_model(tmp_path, no_model):
    ds = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "hi"}])
    r = invoke("submit", ds, "--n", "3", *TINY)        # a dummy model: no generation_config.json, greedy
    assert r.exit_code == 2 and "--n 3 with temperature 0" in r.output, r.output
    assert not (tmp_path / "d.jsonl.results").exists()


def test_n_over_1_with_a_checkpoint_that_samples_is_fine(tmp_path):
    from jobrunner.pipeline.resolve import check_sampling
    from jobrunner.config.job import job_config
    cfg_dir = tmp_path / "m"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(open(f"{ROOT}/benchmarks/configs/tiny-llama.json").read())
    (cfg_dir / "generation_config.json").write_text('{"temperature": 0.7}')
    model = f"dummy:{cfg_dir}/config.json"      # resolved: its own path
    check_sampling(job_config("d.jsonl", model=model, n=3), model)
    (cfg_dir / "generation_config.json").write_text('{"temperature": 0.0}')
    with pytest.raises(checks.JobConfigError, match="temperature 0"):
        check_sampling(job_config("d.jsonl", model=model, n=3), model)


# --- 16: a rerun with nothing left to do -----------------------------------------------------

def test_a_rerun_with_nothing_left_loads_no_model(tmp_path, monkeypatch):
    ds = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "hi"}, {"id": "b", "prompt": "yo"}])
    first = invoke("submit", ds, "--max-tokens", "2", *TINY)
    assert first.exit_code == 0, first.output

    def load_engine(cfg, resolved=None):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(build, "load_engine", load_engine)
    again = invoke("submit", ds, "--max-tokens", "2", *TINY)
    assert again.exit_code == 0 and "rows         2: 2 ok" in again.output, again.output
    # one more row: the model is needed again
    write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "hi"}, {"id": "b", "prompt": "yo"},
                                       {"id": "c", "prompt": "hey"}])
    more = CliRunner().invoke(main, ["submit", ds, "--max-tokens", "2", *TINY])
    assert "the model was loaded" in str(more.exception), more.output


# --- 8: classify's label delimiter ---------------------------------------------------------------

class _Tok:
    """A tokenizer of one token per character (what a label encodes to is visible)."""
    has_chat_template = False

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _classify(**options):
    from jobrunner.config.job import job_config
    from jobrunner.jobs import make_job
    cfg = job_config("d.jsonl", kind="classify", labels=("positive", "negative"), **options)
    return make_job(cfg.job_spec(), _Tok())


@pytest.mark.parametrize("prompt,options,first", [
    ("Sentiment:", {}, " positive"),                      # a space, as lm-eval's target_delimiter
    ("Sentiment: ", {}, "positive"),                      # the prompt ends in whitespace already
    ("Sentiment:\n", {}, "positive"),
    ("Sentiment:", {"label_delimiter": ""}, "positive"),
    ("Sentiment:", {"label_delimiter": " => "}, " => positive"),
    ("Sentiment:", {"chat": True}, "positive"),           # the assistant's reply: no delimiter
    ("Sentiment:", {"messages_column": "m"}, "positive"),
])
def test_classify_puts_the_delimiter_between_prompt_and_label(prompt, options, first):
    job = _classify(**options)
    req, _ = job.request("r", [ord(c) for c in prompt], {})
    assert "".join(chr(i) for i in req.candidates[0]) == first


def test_the_label_delimiter_is_in_a_classify_jobs_fingerprint_only():
    from jobrunner.config.job import job_config
    a = job_config("d", kind="classify", labels=("a", "b")).fingerprint_fields()
    b = job_config("d", kind="classify", labels=("a", "b"), label_delimiter="").fingerprint_fields()
    assert a != b and a["label_delimiter"] == " "
    assert "label_delimiter" not in job_config("d").fingerprint_fields()     # generate outputs still resume


def test_label_delimiter_is_in_help():
    r = invoke("submit", "--help")
    assert "--label-delimiter" in r.output and "--csv-max-lines" in r.output


# --- 16: messages with text content parts ------------------------------------------------------

def test_messages_column_accepts_text_parts():
    from jobrunner.jobs.base import _check_messages
    from jobrunner.jobs import RowError
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert _check_messages(parts) == [{"role": "user", "content": "a\nb"}]
    with pytest.raises(RowError, match="image_url"):
        _check_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


# --- 16: the progress line while a long prompt is prefilled ------------------------------------

def test_progress_counts_tokens_computed_before_any_row_ends(monkeypatch, caplog):
    from jobrunner.pipeline import progress
    from jobrunner.common.run_stats import JobStats
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    counters = SimpleNamespace(tokens_computed=100)
    p = progress.Progress(total=1, counters=lambda: counters)     # the engine's counters(): a snapshot
    p.bar = None
    counters.tokens_computed += 5000          # a prefill chunk ran; no row finished
    with caplog.at_level(logging.INFO, logger="jobrunner"):
        p.update(JobStats())
    line = caplog.records[-1].getMessage()
    assert "0/1 rows" in line and " 0 tokens/s" not in line, line


# --- 16: models pull offline hint ----------------------------------------------------------------

def test_hub_hint_names_hf_hub_offline_only_when_it_is_set(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from jobrunner.engine.api.errors import ModelError
    from jobrunner.models import hub

    def unreachable(*a, **k):
        raise LocalEntryNotFoundError("cannot reach the Hub")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ModelError) as e:
        hub.fetch("tiny-org/absent")
    assert "HF_HUB_OFFLINE" not in str(e.value) and "connection" in str(e.value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="unset HF_HUB_OFFLINE"):
        hub.fetch("tiny-org/absent")


# --- 15: the API's own words -----------------------------------------------------------------

def test_generate_speaks_of_its_arguments_and_rows():
    import jobrunner
    model = "dummy:nothing-loads-before-the-checks"
    with pytest.raises(jobrunner.JobConfigError) as e:
        jobrunner.generate([{"id": "a", "prompt": "x"}], model=model, id_column="nope")
    assert str(e.value) == "id_column 'nope' is not a column of the rows; its columns are: id, prompt"
    with pytest.raises(jobrunner.JobConfigError) as e:
        jobrunner.generate([{"prompt": "x"}], model=model, max_tokenz=1)
    listed = str(e.value).split("the options are ")[1].split(", ")
    assert "max_tokens" in listed and "output" not in listed and "format" not in listed
    with pytest.raises(jobrunner.JobConfigError) as e:
        jobrunner.generate([], model=model, fail_on_empty=True)
    assert "memory://" not in str(e.value) and "--" not in str(e.value)


def test_the_pandas_extra_exists():
    import tomllib
    with open(f"{ROOT}/pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert any(dep.startswith("pandas") for dep in extras["pandas"])
