"""Issue 28 (1, 2, 16): every part of a job has one schema, declared before any row is written
(whatever order rows finish in, failed rows first), with the kind's columns and the input's types;
the id keeps its input type, so `input.join(output, on="id")` works; a null id keeps its row's columns."""
from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from jobrunner.config.job import job_config
from jobrunner.pipeline.exit_codes import EXIT_OK
from jobrunner.pipeline.build import open_job
from jobrunner.output import EXTRA_JSON, ResultWriter, read_results
from jobrunner.output import values as V
from jobrunner.output.parts import RUN_METADATA
from jobrunner.output.schema import declared_schema
from jobrunner.jobs import KINDS

MANIFEST = {"config": {"model": "m", "kind": "classify"}}


def part_schema(out) -> pa.Schema:
    """The one schema every part of `out` has (checked), after reading the parts together."""
    parts = sorted(Path(out).glob("part-*.parquet"))
    assert len(parts) >= 2
    # every part's schema is the first's, its metadata included, but for its run's time record (RUN_METADATA:
    # the writing run's time so far, which grows part by part)
    schemas = [_without_run_record(pq.read_schema(p)) for p in parts]
    assert all(s.equals(schemas[0], check_metadata=True) for s in schemas), [s.names for s in schemas]
    rows = sum(pq.read_metadata(p).num_rows for p in parts)
    assert pl.read_parquet(f"{out}/part-*.parquet").height == rows
    assert pads.dataset(str(out), format="parquet").to_table().num_rows == rows
    return schemas[0]


def _without_run_record(schema: pa.Schema) -> pa.Schema:
    meta = {k: v for k, v in (schema.metadata or {}).items() if k != RUN_METADATA}
    return schema.with_metadata(meta)


def error_row(i, **cols):
    return {"id": i, "output": None, "finish_reason": "error", "prompt_tokens": 0, "cached_tokens": 0,
            "completion_tokens": 0, "queue_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "error": "bad", **cols}


def ok_row(i, **cols):
    return {**error_row(i), "output": "yes", "finish_reason": "stop", "error": None, **cols}


# ---------------------------------------------------------------- the writer, given a declared schema


def test_a_declared_schema_is_every_parts_even_when_failed_rows_come_first(tmp_path):
    schema = declared_schema(pa.int64(), {"tags": pa.list_(pa.string()), "n": pa.int64(), "meta": None},
                             KINDS["classify"].result_columns)
    w = ResultWriter(str(tmp_path / "out"), MANIFEST, part_rows=1, schema=schema)
    w.write([error_row(1, tags=["a"], n=1, reused=False)])     # the first part: a failed row only
    w.write([error_row(2, tags=None, n=None)])
    w.write([ok_row(3, tags=["b", "c"], n=3, meta={"k": 1}, label="yes", label_probs={"yes": 0.7, "no": 0.3},
                    confidence=0.7, reused=True)])
    w.write([ok_row(4, tags=[1.5], n="four", label="no", confidence=0.6)])     # misfits: to extra_json
    w.close()
    got = part_schema(tmp_path / "out")
    assert got.names[:10] == list(V.FIXED_COLUMNS)
    assert set(KINDS["classify"].result_columns) <= set(got.names)
    assert got.field("id").type == pa.int64() and got.field("tags").type == pa.list_(pa.string())
    assert got.field("label_probs").type == V.LABEL_PROBS and got.field("confidence").type == pa.float64()
    assert got.field("correct").type == pa.bool_() and got.field("reused").type == pa.bool_()
    df = pl.read_parquet(f"{tmp_path}/out/part-*.parquet")
    assert df["label"].to_list() == [None, None, "yes", "no"] and df["confidence"].to_list()[2:] == [0.7, 0.6]
    assert df["tags"].to_list() == [["a"], None, ["b", "c"], None]
    assert json.loads(df[EXTRA_JSON][3]) == {"tags": [1.5], "n": "four"}     # nothing lost
    assert json.loads(df["meta"][2]) == {"k": 1}
    resumed = ResultWriter(str(tmp_path / "out"), MANIFEST, schema=schema)
    assert all(str(i) in resumed.done_ids for i in range(1, 5)) and len(resumed.done_ids) == 4


def test_an_id_its_column_cannot_hold_keeps_its_key_in_extra_json_and_resumes(tmp_path):
    schema = declared_schema(pa.int64(), {}, {})
    w = ResultWriter(str(tmp_path / "out"), MANIFEST, part_rows=1, schema=schema)
    w.write([error_row("row-0")])           # a lost id's key: no Int64
    w.write([ok_row(7)])
    w.close()
    df = pl.read_parquet(f"{tmp_path}/out/part-*.parquet")
    assert df["id"].to_list() == [None, 7] and json.loads(df[EXTRA_JSON][0]) == {"id": "row-0"}
    resumed = ResultWriter(str(tmp_path / "out"), MANIFEST)
    assert "row-0" in resumed.done_ids and "7" in resumed.done_ids and not resumed.corrupt


def test_an_output_written_without_a_declared_schema_resumes_with_its_own(tmp_path):
    """Outputs of the previous code pinned their schema from the first part: a resumed job keeps it."""
    out = str(tmp_path / "out")
    old = ResultWriter(out, MANIFEST, part_rows=1)
    old.write([{**error_row("a"), "prompt": "x"}])        # pinned: no label column
    del old
    schema = declared_schema(pa.string(), {"prompt": pa.string()}, KINDS["classify"].result_columns)
    w = ResultWriter(out, MANIFEST, part_rows=1, schema=schema)
    assert set(w.done_ids.contains_many(["a", "b"])) == {True, False}
    w.write([ok_row("b", prompt="y", label="yes")])
    w.close()
    part_schema(out)
    assert json.loads(read_results(out).column(EXTRA_JSON)[1].as_py())["label"] == "yes"


# ---------------------------------------------------------------- jobs of every kind


@pytest.fixture(scope="module")
def engines(tiny_hf_model_dir):
    from jobrunner.pipeline.build import load_engine
    made = {}

    def get(arch):
        if arch not in made:
            model = str(tiny_hf_model_dir(arch))
            made[arch] = model, load_engine(job_config("unused", model=model, device="cpu"))
        return made[arch]
    yield get
    for _, engine in made.values():
        engine.close()


def run_job(engines, arch, dataset, out, **kw):
    model, engine = engines(arch)
    job = open_job(job_config(str(dataset), model=model, output=str(out), device="cpu", **kw), engine=engine)
    return job.run()


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
KIND_CASES = {
    "generate": ("llama", dict(max_tokens=2)),
    "classify": ("llama", dict(kind="classify", labels=("yes", "no"))),
    "score": ("llama", dict(kind="score", score_column="cont")),
    "embed": ("qwen3", dict(kind="embed")),
    "generate-schema-column": ("llama", dict(max_tokens=3, schema_column="schema")),
}


@pytest.mark.parametrize("part_rows", [1, 2])
@pytest.mark.parametrize("case", sorted(KIND_CASES))
def test_every_part_of_every_kind_has_the_kinds_columns_when_failed_rows_finish_first(
        engines, tmp_path, case, part_rows):
    if case == "generate-schema-column":
        pytest.importorskip("llguidance")
    arch, options = KIND_CASES[case]
    rows = [{"id": f"bad{i}", "prompt": "", "cont": " x", "schema": None} for i in range(3)]   # fail at once
    rows += [{"id": f"ok{i}", "prompt": f"row {i} says", "cont": " more words", "schema": SCHEMA} for i in range(3)]
    ds = tmp_path / "d.jsonl"
    ds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = run_job(engines, arch, ds, tmp_path / "out", part_rows=part_rows, **options)
    assert res.exit_code == EXIT_OK and res.stats["rows_failed"] == 3
    schema = part_schema(tmp_path / "out")
    kind = KINDS[options.get("kind", "generate")]
    assert set(kind.result_columns) | {"reused", "prompt", "cont"} <= set(schema.names)
    kinds = V.kinds_of(schema)
    for name, k in kind.result_columns.items():
        assert kinds[name] == (V.vector_kind(64) if k == "vector" else k), name
    df = pl.read_parquet(f"{tmp_path}/out/part-*.parquet").sort("id")
    ok = df.filter(pl.col("error").is_null())
    assert ok.height == 3 and df[EXTRA_JSON].null_count() == 6       # every value in its column
    column = {"classify": "label", "score": "logprob", "embed": "embedding",
              "generate-schema-column": "constrained_incomplete", "generate": "output"}[case]
    assert ok[column].null_count() == 0 and df.filter(pl.col("error").is_not_null())[column].null_count() == 3
    if case == "embed":
        assert schema.field("embedding").type == pa.list_(pa.float32(), 64)


# ---------------------------------------------------------------- input types round trip


def test_parquet_types_survive_and_the_output_joins_the_input_on_id(engines, tmp_path):
    point = pa.struct([("x", pa.int32()), ("label", pa.string())])
    table = pa.table({
        "id": pa.array([10, 11, 12, None], pa.int64()),
        "prompt": ["say a", "say b", "", "say d"],
        "tags": pa.array([["a", "b"], [], None, ["z"]], pa.list_(pa.string())),
        "day": pa.array([dt.date(2024, 1, 2), None, dt.date(1999, 12, 31), dt.date(2000, 2, 29)], pa.date32()),
        "at": pa.array([dt.datetime(2024, 5, 1, 12, tzinfo=dt.timezone.utc)] * 4, pa.timestamp("us", tz="UTC")),
        "point": pa.array([{"x": 1, "label": "p"}, None, {"x": 3, "label": None}, {"x": 4, "label": "q"}], point),
        "nested": pa.array([[{"a": [1, 2]}], [], None, [{"a": None}]], pa.list_(pa.struct([("a", pa.list_(pa.int64()))]))),
        "price": pa.array([Decimal("1.50"), None, Decimal("0.01"), Decimal("9.99")], pa.decimal128(6, 2)),
        "small": pa.array([1, 2, 3, 4], pa.int8()),
    })
    pq.write_table(table, tmp_path / "in.parquet")
    out = tmp_path / "out"
    res = run_job(engines, "llama", tmp_path / "in.parquet", out, max_tokens=2, part_rows=1)
    assert res.exit_code == EXIT_OK and res.stats["rows_failed"] == 2
    schema = part_schema(out)
    for field in table.schema:
        assert schema.field(field.name).type == field.type, field.name
    inp, got = pl.read_parquet(tmp_path / "in.parquet"), pl.read_parquet(f"{out}/part-*.parquet")
    joined = inp.join(got, on="id")
    assert sorted(joined["id"]) == [10, 11, 12]
    for c in ("tags", "day", "at", "point", "nested", "price", "small"):
        assert joined[c].to_list() == joined[f"{c}_right"].to_list(), c
    lost = got.filter(pl.col("id").is_null())          # issue 28 (16): a null id keeps its other columns
    assert lost["prompt"].to_list() == ["say d"] and lost["tags"].to_list() == [["z"]]
    assert "null id" in lost["error"][0] and json.loads(lost[EXTRA_JSON][0]) == {"id": "row-3"}
    again = run_job(engines, "llama", tmp_path / "in.parquet", out, max_tokens=2, part_rows=1)
    assert again.exit_code == EXIT_OK and again.stats["rows"] == 4      # resumed: nothing written twice
    assert pl.read_parquet(f"{out}/part-*.parquet").height == 4


def test_jsonl_ids_keep_their_type_and_never_collide(engines, tmp_path, monkeypatch):
    monkeypatch.setattr("jobrunner.dataset.jsonl._SNIFF_LINES", 1)    # types from the first record only
    rows = [{"id": 1, "prompt": "say a", "n": 1, "x": 0.5, "flag": True, "tags": ["a"], "word": "w"},
            {"id": "1", "prompt": "say b", "n": 2},             # another type than the ids': an error row
            {"id": [1], "prompt": "say c"}, {"id": {}, "prompt": "say d"},     # no scalar: error rows
            {"id": None, "prompt": "say e", "n": 5},
            {"id": 2, "prompt": "say f", "n": "six", "x": 3, "flag": None, "tags": None, "word": 7}]
    ds = tmp_path / "d.jsonl"
    ds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    res = run_job(engines, "llama", ds, out, max_tokens=2, part_rows=2)
    assert res.exit_code == EXIT_OK and res.stats["rows"] == 6 and res.stats["rows_failed"] == 4
    schema = part_schema(out)
    types = {f.name: f.type for f in schema}
    assert types["id"] == pa.int64() and types["n"] == pa.int64() and types["x"] == pa.float64()
    assert types["flag"] == pa.bool_() and types["word"] == pa.string() and types["tags"] == pa.string()
    got = pl.read_parquet(f"{out}/part-*.parquet")
    assert pl.DataFrame({"id": [1, 2]}).join(got, on="id").height == 2        # Int64 both sides
    errors = dict(zip(got["prompt"], got["error"]))
    assert "'1' is a string, but this dataset's first id is an integer" in errors["say b"]
    assert "is a list, not a scalar" in errors["say c"] and "is an object, not a scalar" in errors["say d"]
    assert "null id" in errors["say e"] and got.filter(pl.col("prompt") == "say e")["n"].to_list() == [5]
    two = got.filter(pl.col("id") == 2)
    assert json.loads(two[EXTRA_JSON][0]) == {"n": "six", "word": 7} and two["x"].to_list() == [3.0]
    assert json.loads(got.filter(pl.col("id") == 1)["tags"][0]) == ["a"]     # nested: JSON text


def test_csv_cells_stay_strings_and_join_on_their_id(engines, tmp_path):
    ds = tmp_path / "d.csv"
    ds.write_text("id,prompt,n\n007,say a,1\n8,say b,2\n,say c,3\n")
    out = tmp_path / "out"
    res = run_job(engines, "llama", ds, out, max_tokens=2, part_rows=1)
    assert res.exit_code == EXIT_OK
    schema = part_schema(out)
    assert schema.field("id").type == pa.string() and schema.field("n").type == pa.string()
    inp = pl.read_csv(ds, infer_schema=False)
    joined = inp.join(pl.read_parquet(f"{out}/part-*.parquet"), on="id")
    assert sorted(joined["id"]) == ["007", "8"] and joined["n"].to_list() == joined["n_right"].to_list()
