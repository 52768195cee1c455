import errno
import json
import math
import os
import random
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem
import polars as pl
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobrunner.openai.batch import write_openai_batch_output
from jobrunner.output import values as V
from jobrunner.output import EXTRA_JSON, FIXED_COLUMNS, OutputError, ResultWriter, fingerprint, iter_result_parts, mark_complete, prepare_output, read_results, read_stats, stored_values

CONFIG = {"model": "smollm2-135m-instruct", "max_tokens": 16, "temperature": 0.0,
          "sampling": {"seed": 1, "stop": ["\n"]}}


def manifest(**changes):
    return {"config": {**CONFIG, **changes}, "dataset": "data.jsonl", "kind": "generate"}


def result(i, **extra):
    return {"id": f"r{i}", "output": f"out {i}", "finish_reason": "stop", "prompt_tokens": 10,
            "cached_tokens": 2, "completion_tokens": 3, "queue_s": 0.01, "prefill_s": 0.02,
            "decode_s": 0.03, "error": None, **extra}


@pytest.fixture
def mem():
    fs = fsspec.filesystem("memory")
    root = f"/out-{uuid.uuid4().hex}"
    yield fs, f"memory://{root}", root
    if fs.exists(root):
        fs.rm(root, recursive=True)


def names(path):
    return sorted(p.name for p in path.iterdir())


def ids_of(url):
    return read_results(url).column("id").to_pylist()


def done(w):
    """A writer's done ids as a set of str, checked against every id these tests use."""
    s = {f"r{i}" for i in range(1000) if f"r{i}" in w.done_ids}
    assert len(s) == len(w.done_ids)
    return s


# ---------------------------------------------------------------- parts and manifest


def test_parts_manifest_and_atomic_names(tmp_path, monkeypatch):
    out = tmp_path / "out"
    moves = []
    real_mv = LocalFileSystem.mv

    def spy(self, a, b, **kw):
        moves.append((a.rsplit("/", 1)[1], b.rsplit("/", 1)[1]))
        return real_mv(self, a, b, **kw)

    monkeypatch.setattr(LocalFileSystem, "mv", spy)
    w = ResultWriter(str(out), manifest(), part_rows=10)
    m = json.loads((out / "_manifest.json").read_text())
    assert m["format"] == "jobrunner-output" and m["parts"] == [] and m["complete"] is False
    assert m["fingerprint"] == fingerprint(manifest()["config"]) and m["dataset"] == "data.jsonl"
    for i in range(25):
        w.write([result(i)])
    assert names(out) == ["_manifest.json", "part-00000.parquet", "part-00001.parquet"]
    assert w.parts == ["part-00000.parquet", "part-00001.parquet"]
    # 5 rows still buffered: not in a part yet; done_ids holds only what was found at open
    assert ids_of(str(out)) == [f"r{i}" for i in range(20)]
    assert len(w.done_ids) == 0
    w.close({"rows": 25, "latency": {"p50": 0.1}, "device": "cpu", "cost_usd": None})
    assert names(out) == ["_manifest.json", "_stats.json", "_stats.parquet",
                          "part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    m = json.loads((out / "_manifest.json").read_text())
    assert m["complete"] is True and len(m["parts"]) == 3
    # every visible file appeared by renaming a hidden temporary
    assert moves and all(a.startswith("_tmp-") for a, _ in moves)
    assert {b for _, b in moves} >= {"part-00000.parquet", "_manifest.json", "_stats.json"}
    t = read_results(str(out))
    assert t.column("id").to_pylist() == [f"r{i}" for i in range(25)]
    assert t.schema.names[:len(FIXED_COLUMNS)] == list(FIXED_COLUMNS)
    assert t.schema.field("prompt_tokens").type == pa.int64()
    assert t.schema.field("decode_s").type == pa.float64()
    assert read_stats(str(out)) == {"rows": 25, "latency": {"p50": 0.1}, "device": "cpu",
                                    "cost_usd": None}
    s = pl.read_parquet(out / "_stats.parquet")
    assert s.height == 1 and s["rows"][0] == 25 and json.loads(s["latency"][0]) == {"p50": 0.1}


def test_mark_complete_reads_no_part(tmp_path, monkeypatch):
    """Issue 16 (4): marking a job complete lists the directory; it never opens a part."""
    out = tmp_path / "out"
    for prefix in ("part-r0", "part-r1"):             # two data-parallel workers, closed with stats=None
        w = ResultWriter(str(out), manifest(), part_rows=2, part_prefix=prefix)
        w.write([result(i) for i in range(3)])
        w.close()
    (out / "part-r2-00000.parquet").write_bytes(b"damaged: only a listing can pass it")
    opened = []
    real_open = LocalFileSystem.open

    def spy(self, path, *a, **kw):
        opened.append(path.rsplit("/", 1)[1])
        return real_open(self, path, *a, **kw)

    monkeypatch.setattr(LocalFileSystem, "open", spy)
    m = mark_complete(str(out), {"rows": 6}, prepare_output(str(out), {**manifest(), "model_source": "dummy:x"}))
    assert not [n for n in opened if n.startswith("part")]
    on_disk = json.loads((out / "_manifest.json").read_text())
    assert on_disk == m and m["complete"] is True and m["model_source"] == "dummy:x"
    assert m["parts"] == sorted(n for n in names(out) if n.startswith("part"))
    assert read_stats(str(out)) == {"rows": 6}
    mark_complete(str(out), {"rows": 7})              # no manifest given: the one on disk
    assert json.loads((out / "_manifest.json").read_text())["complete"] is True
    with pytest.raises(OutputError, match="no jobrunner output"):
        mark_complete(str(tmp_path / "nope"), {"rows": 0})


def test_one_write_call_stays_in_one_part(mem):
    _, url, _ = mem
    w = ResultWriter(url, manifest(), part_rows=4)
    w.write([result(0, sample_index=0), result(0, sample_index=1), result(0, sample_index=2)])
    w.write([result(1, sample_index=s) for s in range(3)])  # 6 >= 4: flushed together
    assert len(w.parts) == 1
    w.write([result(2, sample_index=0)])
    w.close()
    assert len(w.parts) == 2
    t = read_results(url)
    assert t.column("sample_index").to_pylist() == [0, 1, 2, 0, 1, 2, 0]
    assert t.schema.field("sample_index").type == pa.int64()


def test_a_part_is_flushed_by_time_as_well_as_by_rows(mem):
    """Issue 15 (5): rows that finished flush_seconds ago are in a part at the next write() or
    maybe_flush(), so a kill loses at most flush_seconds of work, however slowly rows come."""
    fs, url, root = mem
    now = [0.0]
    w = ResultWriter(url, manifest(), part_rows=1000, flush_seconds=5.0)
    w.clock = lambda: now[0]

    def parts():
        return sorted(p.rsplit("/", 1)[1] for p in fs.ls(root, detail=False) if p.rsplit("/", 1)[1].startswith("part-"))

    w.write([result(0)])
    now[0] = 4.9
    w.maybe_flush()
    assert parts() == []
    now[0] = 5.0
    w.maybe_flush()
    assert parts() == ["part-00000.parquet"] and ids_of(url) == ["r0"]
    now[0] = 6.0
    w.write([result(1)])                 # the oldest buffered row is now r1, from t=6
    now[0] = 10.9
    w.write([result(2)])
    assert len(parts()) == 1
    now[0] = 11.0
    w.write([result(3)])                 # write() checks the time too
    assert len(parts()) == 2 and ids_of(url) == ["r0", "r1", "r2", "r3"]
    now[0] = 100.0
    w.maybe_flush()                      # nothing buffered: no empty part
    assert len(parts()) == 2


def test_flush_seconds_is_an_option_that_changes_no_output():
    from jobrunner.config.job import job_config, JobConfigError
    assert job_config("x").output.flush_seconds == 60.0
    assert job_config("x", flush_seconds=5).fingerprint_fields() == job_config("x").fingerprint_fields()  # resumable
    with pytest.raises(JobConfigError, match="--flush-seconds"):
        job_config("x", flush_seconds=0)


def test_first_part_waits_for_a_row_without_error(mem):
    """The first part pins the schema: error rows alone (no job columns yet) are not flushed by time."""
    _, url, _ = mem
    now = [0.0]
    w = ResultWriter(url, manifest(), part_rows=1000, flush_seconds=1.0)
    w.clock = lambda: now[0]
    w.write([result(0, error="prompt too long", output=None)])
    now[0] = 50.0
    w.maybe_flush()
    assert w.parts == []
    w.write([result(1, label="pos", confidence=0.9)])   # waited since t=0: flushed at once
    assert len(w.parts) == 1
    t = read_results(url)
    assert t.column("label").to_pylist() == [None, "pos"] and t.schema.field("confidence").type == pa.float64()
    with pytest.raises(ValueError, match="flush_seconds"):
        ResultWriter(url, manifest(), flush_seconds=0)


def test_stored_values_put_back_what_went_to_extra_json(mem):
    _, url, _ = mem
    w = ResultWriter(url, manifest(), part_rows=2)
    w.write([result(0, gold=4, meta={"a": 1}), result(1, gold=5, meta=None)])   # gold: int, meta: json
    w.write([result(2, gold="five", meta=[1, 2], late=True), result(3, gold=None, meta=None)])
    w.close()
    tables = list(iter_result_parts(url, lambda names: ["id", "gold", "meta", "late", EXTRA_JSON]))
    assert [t.column_names for t in tables] == [["id", "gold", "meta", EXTRA_JSON]] * 2   # "late" is in no schema
    second = tables[1]
    assert stored_values(second, "gold") == ["five", None]          # a misfit, put back from extra_json
    assert stored_values(second, "meta") == [[1, 2], None]          # JSON kind, decoded
    assert stored_values(second, "late") == [True, None]            # a column the pinned schema lacks
    assert stored_values(tables[0], "gold") == [4, 5]
    only = list(iter_result_parts(url, ["gold", "nope"]))
    assert [t.column_names for t in only] == [["gold"], ["gold"]]


def test_context_manager_flushes_on_error(mem):
    _, url, _ = mem
    with pytest.raises(RuntimeError):
        with ResultWriter(url, manifest()) as w:
            w.write([result(0)])
            raise RuntimeError("interrupted")
    assert ids_of(url) == ["r0"]


# ---------------------------------------------------------------- resume


def test_resume_skips_done_ids(tmp_path):
    out = str(tmp_path / "out")
    w = ResultWriter(out, manifest(), part_rows=10)
    for i in range(25):
        w.write([result(i)])
    del w  # "killed": the 5 buffered rows are lost, the 2 parts are safe
    w = ResultWriter(out, manifest(), part_rows=10)
    assert done(w) == {f"r{i}" for i in range(20)}
    w.write([result(i) for i in range(25) if f"r{i}" not in w.done_ids])
    w.close({"rows": 25})
    assert sorted(ids_of(out)) == sorted(f"r{i}" for i in range(25))
    assert w.parts[-1] == "part-00002.parquet"  # numbering continues


def test_stale_temp_files_are_removed_and_ignored(tmp_path):
    out = tmp_path / "out"
    w = ResultWriter(str(out), manifest(), part_rows=2)
    w.write([result(0), result(1)])
    (out / "_tmp-part-00001.parquet.abc123").write_bytes(b"half a file")
    (out / "_tmp-part-r1-00000.parquet.abc123").write_bytes(b"another writer's")
    w = ResultWriter(str(out), manifest(), part_rows=2)
    assert not (out / "_tmp-part-00001.parquet.abc123").exists()
    assert (out / "_tmp-part-r1-00000.parquet.abc123").exists()  # not ours to delete
    assert done(w) == {"r0", "r1"}


def test_truncated_part_is_set_aside_and_redone(tmp_path, caplog):
    out = tmp_path / "out"
    w = ResultWriter(str(out), manifest(), part_rows=3)
    w.write([result(i) for i in range(3)])
    w.write([result(i) for i in range(3, 6)])
    w.write([result(i) for i in range(6, 9)])
    p = out / "part-00001.parquet"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])  # a full disk cut it short
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # a log line in our words, not a Python warning
        w = ResultWriter(str(out), manifest(), part_rows=3)
    assert "part part-00001.parquet is damaged; set aside as _corrupt-part-00001.parquet" in caplog.text
    assert done(w) == {"r0", "r1", "r2", "r6", "r7", "r8"}
    assert w.corrupt == ["_corrupt-part-00001.parquet"]
    assert (out / "_corrupt-part-00001.parquet").exists() and not p.exists()
    w.write([result(i) for i in range(9) if f"r{i}" not in w.done_ids])
    w.close()
    assert w.parts[-1] == "part-00003.parquet"  # never reuses the damaged part's number
    assert sorted(ids_of(str(out))) == [f"r{i}" for i in range(9)]  # each exactly once
    # readers skip the set-aside file
    assert pl.read_parquet(out / "part*.parquet").height == 9
    assert pads.dataset(str(out), format="parquet").count_rows() == 9


def test_garbage_part_is_set_aside(mem, caplog):
    fs, url, root = mem
    w = ResultWriter(url, manifest(), part_rows=1)
    w.write([result(0)])
    fs.pipe(f"{root}/part-00005.parquet", b"not parquet")
    fs.pipe(f"{root}/_corrupt-part-00005.parquet", b"an earlier damaged one")
    w = ResultWriter(url, manifest(), part_rows=1)
    assert "is damaged; set aside as _corrupt-1-part-00005.parquet" in caplog.text
    assert done(w) == {"r0"}
    assert fs.exists(f"{root}/_corrupt-1-part-00005.parquet")
    w.write([result(1)])
    assert w.parts[-1] == "part-00006.parquet"


# ---------------------------------------------------------------- configuration checks


def test_fingerprint_mismatch_is_refused_with_explanation(tmp_path):
    out = str(tmp_path / "out")
    ResultWriter(out, manifest()).close()
    with pytest.raises(OutputError) as e:
        ResultWriter(out, manifest(max_tokens=32, sampling={"seed": 2, "stop": ["\n"]}))
    msg = str(e.value)
    assert "max_tokens: 16 (existing) -> 32 (now)" in msg
    assert "sampling.seed: 1 (existing) -> 2 (now)" in msg
    assert "--overwrite" in msg and "model" not in msg
    # the fingerprint covers only "config": other manifest keys may change on resume
    ResultWriter(out, {**manifest(), "dataset": "moved.jsonl"})
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})


def test_overwrite_replaces_our_output(tmp_path):
    out = tmp_path / "out"
    w = ResultWriter(str(out), manifest(), part_rows=1)
    w.write([result(0)])
    w.close({"rows": 1})
    w = ResultWriter(str(out), manifest(max_tokens=99), overwrite=True)
    assert done(w) == set()
    assert names(out) == ["_manifest.json"]
    assert json.loads((out / "_manifest.json").read_text())["config"]["max_tokens"] == 99


def test_overwrite_with_same_config_starts_afresh(tmp_path):
    out = str(tmp_path / "out")
    w = ResultWriter(out, manifest())
    w.write([result(0)])
    w.close({"rows": 1})
    assert done(ResultWriter(out, manifest())) == {"r0"}  # resume
    assert done(ResultWriter(out, manifest(), overwrite=True)) == set()  # e.g. new data, same job
    assert ids_of(out) == []


def test_killed_during_first_manifest_write(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "_tmp-_manifest.json.0123abcd").write_text('{"form')
    ResultWriter(str(out), manifest()).close()
    assert names(out) == ["_manifest.json"]


def test_overwrite_never_deletes_a_foreign_directory(tmp_path):
    home = tmp_path / "precious"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    for overwrite in (False, True):
        with pytest.raises(OutputError, match="not a jobrunner output"):
            ResultWriter(str(home), manifest(), overwrite=overwrite)
    (home / "_manifest.json").write_text('{"something": "else"}')
    with pytest.raises(OutputError, match="not a jobrunner manifest"):
        ResultWriter(str(home), manifest(), overwrite=True)
    assert (home / "thesis.tex").read_text() == "years of work"
    # a jobrunner output's parent is left alone too
    ResultWriter(str(tmp_path / "sub" / "out"), manifest()).close()
    ResultWriter(str(tmp_path / "sub" / "out"), manifest(max_tokens=1), overwrite=True)
    assert (home / "thesis.tex").exists()


def test_output_path_checks(tmp_path):
    (tmp_path / "empty").mkdir()
    ResultWriter(str(tmp_path / "empty"), manifest()).close()  # an empty dir is fine
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="is a file"):
        ResultWriter(str(tmp_path / "file"), manifest())
    with pytest.raises(ValueError, match="config"):
        ResultWriter(str(tmp_path / "o2"), {"no": "config"})
    for bad in ("../x", "part/../../x", "results", "part-", ""):
        with pytest.raises(ValueError, match="part_prefix"):
            ResultWriter(str(tmp_path / "o3"), manifest(), part_prefix=bad)


# ---------------------------------------------------------------- schema across parts


def test_mixed_extra_column_types_read_together(tmp_path):
    out = tmp_path / "out"
    w = ResultWriter(str(out), manifest(), part_rows=2)
    # part 0 pins: year int, title string, meta json (nested), empty json (all null), score float
    w.write([result(0, year=2020, title="a", meta={"k": [1]}, empty=None, score=1),
             result(1, year=2021, title="b", meta=None, empty=None, score=0.5)])
    # part 1: other types for the same columns, a new column, and a missing one
    w.write([result(2, year="MMXXII", title=5, meta="plain", empty={"x": 1}, new_col=True),
             result(3, year=None, title=None, meta=[1, 2], empty="s", score=float("inf"))])
    w.write([result(4, label="pos", label_probs={"pos": 0.9, "neg": 0.1})])
    w.close({"rows": 5})
    lazy = pl.read_parquet(out / "part*.parquet")
    arrow = pads.dataset(str(out), format="parquet").to_table()
    assert lazy.height == 5 and arrow.num_rows == 5
    assert lazy.schema["year"] == pl.Int64 and lazy.schema["title"] == pl.String
    assert lazy.schema["score"] == pl.Float64 and lazy.schema["meta"] == pl.String
    assert lazy["year"].to_list() == [2020, 2021, None, None, None]
    assert lazy["score"][3] == math.inf
    assert [json.loads(x) if x else None for x in lazy["meta"]] == [{"k": [1]}, None, "plain",
                                                                   [1, 2], None]
    assert [json.loads(x) if x else None for x in lazy["empty"]] == [None, None, {"x": 1}, "s",
                                                                     None]
    # values that did not fit the pinned schema are kept in extra_json, never dropped
    extra = [json.loads(x) if x else None for x in lazy[EXTRA_JSON]]
    assert extra[2] == {"year": "MMXXII", "title": 5, "new_col": True}
    assert extra[4] == {"label": "pos", "label_probs": {"pos": 0.9, "neg": 0.1}}
    assert extra[0] is None and extra[3] is None
    kinds = json.loads(pq.read_schema(out / "part-00000.parquet").metadata[b"jobrunner.kinds"])
    assert kinds["meta"] == "json" and kinds["year"] == "int" and kinds["score"] == "float"


def test_classification_columns(mem):
    _, url, _ = mem
    w = ResultWriter(url, manifest(), part_rows=2)
    w.write([result(0, label="pos", label_probs={"pos": 0.75, "neg": 0.25},
                    label_logprobs={"pos": -0.5, "neg": -1.5}),
             result(1, label=None, label_probs=None, error="prompt too long")])
    w.write([result(2, label="neg", label_probs=[{"label": "neg", "prob": 0.6},
                                                 {"label": "pos", "prob": 0.4}],
                    label_logprobs=[{"label": "neg", "logprob": -0.2}, {"label": "pos", "logprob": -0.9}])])
    w.close()
    t = read_results(url)
    assert t.schema.field("label_probs").type == V.LABEL_PROBS
    assert t.column("label_probs").to_pylist() == [
        [{"label": "pos", "prob": 0.75}, {"label": "neg", "prob": 0.25}], None,
        [{"label": "neg", "prob": 0.6}, {"label": "pos", "prob": 0.4}]]
    # issue 15: label_logprobs is a struct list like label_probs, not a JSON text
    assert t.schema.field("label_logprobs").type == V.LABEL_LOGPROBS
    assert t.column("label_logprobs").to_pylist() == [
        [{"label": "pos", "logprob": -0.5}, {"label": "neg", "logprob": -1.5}], None,
        [{"label": "neg", "logprob": -0.2}, {"label": "pos", "logprob": -0.9}]]
    assert t.column(EXTRA_JSON).null_count == 3
    df = pl.from_arrow(t)
    probs = df.select("id", "label_probs").explode("label_probs").unnest("label_probs")
    assert probs.columns == ["id", "label", "prob"] and probs.height == 5
    logprobs = df.select("id", "label_logprobs").explode("label_logprobs").unnest("label_logprobs")
    assert logprobs.columns == ["id", "label", "logprob"] and logprobs.height == 5


def test_memory_output_and_shared_directory(mem):
    fs, url, root = mem
    w0 = ResultWriter(url, manifest(), part_rows=2, part_prefix="part-r0")
    w1 = ResultWriter(url, manifest(), part_rows=2, part_prefix="part-r1")
    w0.write([result(0, src="a"), result(1, src="b")])
    w1.write([result(2, src=3), result(3, src="d")])  # schema pinned by w0's part: 3 -> extra_json
    w0.close()
    w1.close()
    assert sorted(fs.ls(root, detail=False)) == [f"{root}/_manifest.json",
                                                 f"{root}/part-r0-00000.parquet",
                                                 f"{root}/part-r1-00000.parquet"]
    m = json.loads(fs.cat(f"{root}/_manifest.json"))
    assert m["parts"] == ["part-r0-00000.parquet", "part-r1-00000.parquet"]
    # a resumed or third process sees every writer's rows as done
    w = ResultWriter(url, manifest())
    assert done(w) == {"r0", "r1", "r2", "r3"}
    t = read_results(url)
    assert t.column("src").to_pylist() == ["a", "b", None, "d"]
    assert json.loads(t.column(EXTRA_JSON)[2].as_py()) == {"src": 3}


def test_storage_fault_keeps_rows_and_resumes(mem, monkeypatch):
    fs, url, _ = mem
    w = ResultWriter(url, manifest(), part_rows=2)
    w.write([result(0), result(1)])
    real_open = type(fs).open

    def full_disk(self, path, mode="rb", **kw):
        if "w" in mode and "_tmp-part" in path:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(self, path, mode, **kw)

    monkeypatch.setattr(type(fs), "open", full_disk)
    with pytest.raises(OutputError, match="No space left on device$"):
        w.write([result(2), result(3)])
    monkeypatch.setattr(type(fs), "open", real_open)
    assert ids_of(url) == ["r0", "r1"]
    assert not [p for p in fs.ls(mem[2], detail=False) if "_tmp-" in p]  # temp cleaned up
    w.flush()  # the rows were kept: retry succeeds
    assert sorted(ids_of(url)) == ["r0", "r1", "r2", "r3"]


def test_read_stats_before_close(mem):
    fs, url, root = mem
    w = ResultWriter(url, manifest())
    w.write([result(0)])
    assert read_stats(url) is None      # an output no run has written stats into: jobrunner.output.summary reads its parts
    w.flush()
    w.write_stats({"rows": 1, "interrupted": True})  # partial stats: not complete
    assert read_stats(url) == {"rows": 1, "interrupted": True}
    assert json.loads(fs.cat(f"{root}/_manifest.json"))["complete"] is False
    with pytest.raises(OutputError, match="not found"):
        read_results(url + "-missing")
    with pytest.raises(OutputError, match="no jobrunner output at"):
        read_stats(url + "-missing")    # issue 15 (12): not "not finished" for a directory that does not exist
    fs.pipe(f"{root}-other/notes.txt", b"x")
    with pytest.raises(OutputError, match="no jobrunner output at"):
        read_stats(url + "-other")


def test_write_rows_need_ids(mem):
    w = ResultWriter(mem[1], manifest())
    with pytest.raises(ValueError, match="id"):
        w.write([{"output": "x"}])
    w.write([{"id": 7, "output": "x"}])  # non-string ids are stored as strings
    w.close()
    assert ids_of(mem[1]) == ["7"]


# ---------------------------------------------------------------- OpenAI batch output


def test_openai_batch_output(mem):
    fs, url, root = mem
    w = ResultWriter(url, manifest(), part_rows=3)
    w.write([result(0)])
    w.write([result(1, sample_index=0, output="a"), result(1, sample_index=1, output="b")])
    w.write([{**result(2), "output": None, "finish_reason": "error", "error": "prompt too long"}])
    w.close({"rows": 3})
    assert write_openai_batch_output(url) == {"results.openai.jsonl": 2, "errors.openai.jsonl": 1}
    path, errors = f"{root}/results.openai.jsonl", f"{root}/errors.openai.jsonl"
    lines = [json.loads(x) for x in fs.cat(path).decode().splitlines() + fs.cat(errors).decode().splitlines()]
    assert [x["custom_id"] for x in lines] == ["r0", "r1", "r2"]
    ok = lines[0]
    assert ok["error"] is None and ok["response"]["status_code"] == 200
    body = ok["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == CONFIG["model"]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "out 0"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                             "prompt_tokens_details": {"cached_tokens": 2},
                             "completion_tokens_details": {"reasoning_tokens": 0}}
    assert [c["message"]["content"] for c in lines[1]["response"]["body"]["choices"]] == ["a", "b"]
    assert lines[1]["response"]["body"]["usage"]["completion_tokens"] == 6
    assert lines[2]["response"] is None and lines[2]["error"]["message"] == "prompt too long"
    assert lines[2]["error"]["code"] == "row_error" and lines[2]["error"]["param"] is None
    # from explicit rows too; ids stable across runs
    write_openai_batch_output(url, [result(9)], model="m")
    (again,) = [json.loads(x) for x in fs.cat(path).decode().splitlines()]
    assert again["custom_id"] == "r9" and again["response"]["body"]["model"] == "m"
    assert again["id"].startswith("batch_req_")


# ---------------------------------------------------------------- property test

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=3)
                           | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=8)
keys = st.sampled_from(["output", "error", "prompt_tokens", "queue_s", "label", "label_probs",
                        "label_logprobs", "sample_index", "extra_json", "x", "y", ""]) | st.text(max_size=6)
rows_st = st.lists(st.tuples(st.text(max_size=8), st.dictionaries(keys, json_values, max_size=6)),
                   min_size=1, max_size=12)


def _reconstruct(row: dict, kinds: dict) -> dict:
    """An output row back to the input dict (None-valued keys dropped)."""
    out = {}
    for k, v in row.items():
        if k == EXTRA_JSON or v is None:
            continue
        if kinds.get(k) == "json":
            v = json.loads(v)
        out[k] = v
    out.update(json.loads(row[EXTRA_JSON]) if row[EXTRA_JSON] else {})
    return {k: v for k, v in out.items() if v is not None}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=rows_st, part_rows=st.integers(1, 5))
def test_arbitrary_rows_round_trip(rows, part_rows):
    url = f"memory://prop-{uuid.uuid4().hex}"
    try:
        w = ResultWriter(url, manifest(), part_rows=part_rows)
        inputs = [{**d, "id": rid} for rid, d in rows]
        for r in inputs:
            w.write([r])
        w.close({"rows": len(inputs), "odd": {"nested": [None, "é"]}})
        t = read_results(url)
        assert t.column("id").to_pylist() == [r["id"] for r in inputs]
        kinds = json.loads(t.schema.metadata[b"jobrunner.kinds"])
        for given_row, got in zip(inputs, t.to_pylist()):
            want = json.loads(V.to_json({k: v for k, v in given_row.items() if v is not None}))
            for col, field in V._LABEL_LISTS.items():      # dict -> [{label, prob}] / [{label, logprob}]
                if kinds.get(col) == col and V._label_list(want.get(col), field) is not None:
                    want[col] = V._label_list(want[col], field)
            assert _reconstruct(got, kinds) == want
        done_ids = ResultWriter(url, manifest()).done_ids
        assert len(done_ids) == len({r["id"] for r in inputs}) and all(r["id"] in done_ids for r in inputs)
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists(url[len("memory://"):]):
            fs.rm(url[len("memory://"):], recursive=True)


def test_non_finite_and_surrogate_values_do_not_crash(mem):
    _, url, _ = mem
    w = ResultWriter(url, manifest(), part_rows=10)
    w.write([result(0, odd="bad \udc80 surrogate", f=float("nan"), big=2**80,
                    obj=object(), when=__import__("datetime").date(2024, 1, 2), raw=b"\xff")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w.close()
    (row,) = read_results(url).to_pylist()
    assert row["odd"] == "bad ? surrogate"
    assert math.isnan(row["f"])
    assert json.loads(row["big"]) == 2**80 and json.loads(row["when"]) == "2024-01-02"


CHILD = """
import sys
from jobrunner.output import ResultWriter
out, n = sys.argv[1], int(sys.argv[2])
w = ResultWriter(out, {"config": {"model": "m"}}, part_rows=5)
for i in range(n):
    if f"r{i}" not in w.done_ids:
        w.write([{"id": f"r{i}", "output": "x" * (i % 13), "prompt_tokens": i}])
w.close({"rows": n})
"""


def test_kill_9_then_resume_every_row_exactly_once(tmp_path):
    out, n = str(tmp_path / "out"), 400
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    rng = random.Random(0)
    for target in (10, 40):  # kill once that many parts exist, at a random moment after
        p = subprocess.Popen([sys.executable, "-c", CHILD, out, str(n)], env=env)
        deadline = time.time() + 60
        while time.time() < deadline and p.poll() is None and (
                not os.path.isdir(out) or sum(f.startswith("part-") for f in os.listdir(out)) < target):
            time.sleep(0.002)
        time.sleep(rng.uniform(0, 0.01))
        p.kill()
        p.wait()
    # the kills landed mid-job: some parts written, the job not finished
    assert any(f.startswith("part-") for f in os.listdir(out))
    assert not os.path.exists(os.path.join(out, "_stats.json"))
    subprocess.run([sys.executable, "-c", CHILD, out, str(n)], env=env, check=True, timeout=120)
    ids = ids_of(out)
    assert sorted(ids) == sorted(f"r{i}" for i in range(n))  # none lost, none twice
    assert not [f for f in os.listdir(out) if f.startswith(("_tmp-", "_corrupt-"))]
    assert json.loads((tmp_path / "out" / "_manifest.json").read_text())["complete"] is True


def test_kill_9_of_a_job_keeps_rows_flushed_by_time(tiny_hf_model_dir, tmp_path):
    """Issue 15 (5): with --part-rows far above the job's size, a kill -9 kept no row; rows finished
    more than --flush-seconds before the kill are now in a part, and `jobrunner stats` summarizes them."""
    rows = [{"id": f"k{i:03d}", "prompt": f"Count from {i} onwards."} for i in range(100)]
    ds = tmp_path / "k.jsonl"
    ds.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "jobrunner.cli.main", "submit", str(ds), "-m", str(tiny_hf_model_dir("llama")),
           "-o", str(out), "--device", "cpu", "--max-tokens", "16", "--ignore-eos", "--max-num-seqs", "1",
           "--part-rows", "10000", "--flush-seconds", "0.2"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None and not (
            out.is_dir() and any(n.startswith("part-") for n in os.listdir(out))):
        time.sleep(0.02)
    assert p.poll() is None, p.communicate()[1]          # killed mid-job, not after it ended
    p.kill()
    p.communicate()
    kept = ids_of(str(out))
    assert 0 < len(kept) < len(rows) and not (out / "_stats.json").exists()
    from click.testing import CliRunner

    from jobrunner.cli.main import main
    r = CliRunner().invoke(main, ["stats", str(out), "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["partial"] is True and s["rows"] == len(kept) and s["runs_recorded"] == 1    # the killed run, from its parts
