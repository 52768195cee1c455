"""The Python API (jobrunner.api.submit, jobrunner.api.session): submit over a file with the CLI's options and errors,
generate over rows in memory (nothing on disk, rows back in input order), once or on an engine session."""
import json
import os
import subprocess
import sys

import fsspec
import polars as pl
import pytest

import jobrunner
from jobrunner.api import submit as api
from jobrunner.output import read_results

SMALL = dict(device="cpu", kv_cache_memory="16MB", max_tokens=3)


@pytest.fixture
def model(tiny_hf_model_dir):
    return str(tiny_hf_model_dir("llama"))


def memory_roots() -> set[str]:
    return {p for p in fsspec.filesystem("memory").ls("/", detail=False) if "jobrunner-generate" in p}


def test_import_is_cheap():
    code = "import sys, jobrunner; assert 'torch' not in sys.modules and 'polars' not in sys.modules, sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert {"submit", "generate", "JobResult", "JobConfigError"} <= set(dir(jobrunner))
    assert jobrunner.JobConfigError is jobrunner.config.job.JobConfigError
    with pytest.raises(AttributeError):
        jobrunner.no_such_name


def test_generate_returns_one_row_per_input_row_in_order_and_touches_no_disk(model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rows = [{"id": "c", "prompt": "The quick brown fox", "topic": "animals"},
            {"id": "a", "prompt": "Hello world!", "topic": "greetings"},
            {"id": "b", "prompt": "Numbers 0123", "topic": "maths"}]
    df = jobrunner.generate(rows, model=model, **SMALL)
    assert isinstance(df, pl.DataFrame)
    assert df["id"].to_list() == ["c", "a", "b"] and df["topic"].to_list() == ["animals", "greetings", "maths"]
    assert df["error"].null_count() == 3 and all(n <= 3 for n in df["completion_tokens"])
    assert df["finish_reason"].to_list()[0] in ("stop", "length")
    assert os.listdir(tmp_path) == [] and memory_roots() == set()

    # A polars DataFrame without ids: row numbers, in order.
    table = pl.DataFrame({"prompt": ["one", "two", "three", "four"], "n_words": [1, 1, 1, 1]})
    df = jobrunner.generate(table, model=model, **SMALL)
    assert df["id"].to_list() == ["0", "1", "2", "3"] and df["prompt"].to_list() == table["prompt"].to_list()
    assert os.listdir(tmp_path) == [] and memory_roots() == set()


def test_generate_keeps_input_order_when_ids_repeat(model):
    """A repeated id's error row takes the repeat's place, not the first row's (issue 41, item 5)."""
    rows = [{"id": i, "prompt": f"row {n}", "n": n} for n, i in enumerate(["z", "a", "z", "m", "z"])]
    df = jobrunner.generate(rows, model=model, max_error_rate=1.0, **SMALL)
    assert df["id"].to_list() == ["z", "a", "z", "m", "z"]
    assert df["n"].to_list() == [0, 1, 2, 3, 4]
    errors = df["error"].to_list()
    assert errors[0] is None and errors[1] is None and errors[3] is None
    assert all(e.startswith("duplicate id 'z'") for e in (errors[2], errors[4]))


def test_generate_closes_the_engine_it_loads(model, monkeypatch):
    from jobrunner.engine import Engine
    closed, close = [], Engine.close
    monkeypatch.setattr(Engine, "close", lambda self: (closed.append(self), close(self))[-1])
    jobrunner.generate([{"prompt": "Hello"}], model=model, **SMALL)
    jobrunner.generate([{"prompt": "Hello"}], model=model, **SMALL)
    assert len(closed) == 2 and closed[0] is not closed[1]


def test_an_engine_session_serves_many_calls_on_one_engine(model, monkeypatch, tmp_path):
    from jobrunner.engine import Engine
    loaded, init = [], Engine.__init__
    monkeypatch.setattr(Engine, "__init__", lambda self, *a, **k: (loaded.append(self), init(self, *a, **k))[-1])
    rows = [{"id": "b", "prompt": "The quick brown fox"}, {"id": "a", "prompt": "Hello world!"}]
    with jobrunner.open_engine(model=model, **SMALL) as llm:
        first = llm.generate(rows)
        assert first["id"].to_list() == ["b", "a"] and all(n <= 3 for n in first["completion_tokens"])
        shorter = llm.generate(rows, max_tokens=1)                    # a call's own options win
        assert shorter["completion_tokens"].to_list() == [1, 1]
        labels = llm.generate(rows, kind="classify", labels="yes,no")
        assert set(labels["label"]) <= {"yes", "no"}
        with pytest.raises(jobrunner.JobConfigError, match="another engine than this session's"):
            llm.generate(rows, kv_cache_memory="8MB")
        assert len(loaded) == 1
    with pytest.raises(jobrunner.JobConfigError, match="closed"):
        llm.generate(rows)
    with pytest.raises(jobrunner.JobConfigError, match="no output option"):
        jobrunner.open_engine(model=model, output=str(tmp_path / "out"))


def test_generate_returns_the_rows_submit_writes(model, tmp_path):
    """The in-memory results (output.RowSink) are the parts' rows, column for column and type for type."""
    rows = [{"id": i, "prompt": p, "n": i * 1.5} for i, p in enumerate(["The quick brown fox", "Hello", "0123"])]
    ds = tmp_path / "d.jsonl"
    ds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for options in ({"temperature": 0.8, "n": 2, "seed": 1, "logprobs": True}, {"kind": "embed"},
                    {"kind": "classify", "labels": "yes,no"}):
        got = jobrunner.generate(rows, model=model, **SMALL, **options)
        result = jobrunner.submit(str(ds), str(tmp_path / "out"), model=model, overwrite=True, **SMALL, **options)
        want = pl.from_arrow(read_results(result.output))
        timings = ["queue_s", "prefill_s", "decode_s"]
        keys = ["id"] + (["sample_index"] if "sample_index" in want.columns else [])
        assert got.drop(timings).equals(want.sort(keys).drop(timings)), options
        assert got.schema == want.schema


def test_generate_error_rows_samples_and_failures(model, caplog):
    rows = [{"id": 1, "prompt": "Hello world!"}, {"id": 2, "prompt": None}, {"id": 3, "prompt": "fox"}]
    df = jobrunner.generate(rows, model=model, temperature=0.8, n=2, seed=1, **SMALL)
    # the rows are in memory: the warning names no output directory (there is none)
    assert "1 of 3 rows failed; their errors are in the `error` column of the results" in caplog.text
    assert "memory://" not in caplog.text
    assert df["id"].to_list() == [1, 1, 2, 3, 3]       # ids keep the input's type (issue 28)
    assert df["sample_index"].to_list()[:2] == [0, 1] and df["sample_index"].to_list()[3:] == [0, 1]
    assert df["error"].to_list()[2] is not None and df["error"].to_list()[0] is None
    with pytest.raises(api.JobFailedError, match="1 of 3 rows failed") as e:
        jobrunner.generate(rows, model=model, max_error_rate=0.1, **SMALL)
    assert e.value.result.exit_code == 3 and memory_roots() == set()


@pytest.mark.parametrize("rows,options,message", [
    ([{"prompt": "x"}], {"output": "out"}, "no output option"),
    ([{"prompt": "x"}], {"data_parallel": 2}, "data_parallel must be 1"),
    ([{"prompt": "x"}], {"max_tokenz": 3}, "unknown option max_tokenz"),
    (["a prompt"], {}, r"rows\[0\] is a str"),
    ([{"prompt": object()}], {}, r"rows\[0\]: .*not JSON serializable"),
    ("prompts.jsonl", {}, "list of dicts or a polars"),
    ([{"text": "x"}], {}, "^prompt_column 'prompt' is not a column of the rows; its columns are: text$"),
])
def test_generate_refuses_what_it_cannot_run(rows, options, message):
    with pytest.raises(jobrunner.JobConfigError, match=message):
        jobrunner.generate(rows, model="dummy:nothing-loads-before-the-checks", **options)
    assert memory_roots() == set()


def test_submit_runs_a_jsonl_like_the_cli(model, tmp_path):
    ds = tmp_path / "d.jsonl"
    ds.write_text("".join(json.dumps({"id": f"r{i}", "q": f"question {i}"}) + "\n" for i in range(3)))
    toml = tmp_path / "job.toml"
    toml.write_text('template = "Q: {q}\\nA:"\nmax_tokens = 50\nstop = "\\n"\n')
    result = jobrunner.submit(str(ds), config=str(toml), model=model, **SMALL)   # keywords win over the file
    assert isinstance(result, jobrunner.JobResult)
    assert result.exit_code == 0 and result.output == f"{ds}.results"
    assert result.stats["rows"] == result.stats["rows_ok"] == 3 and result.stats["completion_tokens"] <= 9
    manifest = json.loads((tmp_path / "d.jsonl.results" / "_manifest.json").read_text())
    assert manifest["config"]["template"] == "Q: {q}\nA:" and manifest["config"]["stop"] == ["\n"]
    assert manifest["config"]["max_tokens"] == 3
    assert sorted(read_results(result.output).column("id").to_pylist()) == ["r0", "r1", "r2"]
    out = tmp_path / "out"
    again = jobrunner.submit(str(ds), str(out), model=model, template="Q: {q}", labels="yes, no", kind="classify")
    assert again.exit_code == 0 and again.output == str(out) and again.stats["rows"] == 3


@pytest.mark.parametrize("options,message", [
    ({"max_tokenz": 3}, "unknown option max_tokenz"),
    ({"max_tokens": "six"}, "max_tokens must be an integer"),
    ({"temperature": -1}, "^temperature must be >= 0"),       # its keyword names, not the CLI's flags
    ({"kind": "classify"}, "classify needs exactly one of labels a,b,c or labels_column"),
    ({"kv_cache_memory": "lots"}, "cannot read size"),
    ({"config": "/nonexistent/job.toml"}, "cannot read config"),
])
def test_submit_bad_option_raises_before_anything_runs(tmp_path, options, message):
    ds = tmp_path / "d.jsonl"
    ds.write_text('{"id": "a", "prompt": "hi"}\n')
    with pytest.raises(jobrunner.JobConfigError, match=message):
        jobrunner.submit(str(ds), model="dummy:nothing-loads-before-the-checks", **options)
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl"]


def test_submit_storage_failure_is_an_output_storage_error(tmp_path):
    ds = tmp_path / "d.jsonl"
    ds.write_text('{"id": "a", "prompt": "hi"}\n')
    with pytest.raises(jobrunner.OutputStorageError, match="/proc/nope/out") as e:
        jobrunner.submit(str(ds), "/proc/nope/out", model="dummy:nothing-loads-before-the-checks")
    assert isinstance(e.value, OSError)
