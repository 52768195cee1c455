import bz2
import gzip
import json
import tracemalloc
import uuid

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.dataset import counting, files
from jobrunner.dataset import DatasetError, count_rows, dataset_columns, detect_format, list_files, read_rows


@pytest.fixture
def mem():
    """A fresh memory:// folder; yields (fs, url)."""
    fs = fsspec.filesystem("memory")
    root = f"/ds-{uuid.uuid4().hex}"
    fs.makedirs(root, exist_ok=True)
    yield fs, f"memory://{root}"
    if fs.exists(root):
        fs.rm(root, recursive=True)


def all_rows(url, **kw):
    return [r for batch in read_rows(url, **kw) for r in batch]


def jsonl(records):
    return "".join(json.dumps(r) + "\n" for r in records).encode()


RECORDS = [{"id": f"r{i}", "prompt": f"say {i}", "n": i} for i in range(5)]


def check_records(rows):
    assert [r.index for r in rows] == list(range(5))
    assert [r.id for r in rows] == [f"r{i}" for i in range(5)]
    assert all(r.error is None for r in rows)
    assert rows[3].data["prompt"] == "say 3"


# ---------------------------------------------------------------- formats


def test_parquet_local(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS), p)
    assert detect_format(str(p)) == "parquet"
    rows = all_rows(str(p))
    check_records(rows)
    assert rows[2].data == {"id": "r2", "prompt": "say 2", "n": 2}
    assert count_rows(str(p)) == 5
    assert dataset_columns(str(p)) == ["id", "prompt", "n"]
    assert all_rows(f"file://{p}")[4].id == "r4"


def test_parquet_memory_and_int_ids(mem):
    fs, url = mem
    with fs.open(f"{url}/d.pq", "wb") as f:
        pq.write_table(pa.table({"id": [10, 11, None], "prompt": ["a", "b", "c"]}), f)
    rows = all_rows(f"{url}/d.pq")
    assert [r.id for r in rows[:2]] == ["10", "11"]
    # a null id in a dataset with ids: error row whose id can't collide with a real one
    # issue 28 (16): it keeps its other input columns; its id value is its key (no Int64 holds it)
    assert rows[2].data == {"id": None, "prompt": "c"} and rows[2].id == "row-2" == rows[2].id_value
    assert [r.id_value for r in rows[:2]] == [10, 11]      # the id as the input types it
    assert "row 3" in rows[2].error and "id" in rows[2].error
    assert count_rows(f"{url}/d.pq") == 3


def test_jsonl_local_and_memory(tmp_path, mem):
    p = tmp_path / "d.jsonl"
    p.write_bytes(jsonl(RECORDS))
    check_records(all_rows(str(p)))
    assert detect_format(str(p)) == "jsonl"
    assert count_rows(str(p)) == 5
    fs, url = mem
    fs.pipe(f"{url}/d.ndjson", jsonl(RECORDS))
    check_records(all_rows(f"{url}/d.ndjson"))
    assert dataset_columns(f"{url}/d.ndjson") == ["id", "prompt", "n"]


def test_jsonl_without_id_column_uses_row_numbers(mem):
    fs, url = mem
    fs.pipe(f"{url}/d.jsonl", b'{"prompt": "a"}\n\n{"prompt": "b"}\n{bad\n')
    rows = all_rows(f"{url}/d.jsonl")
    assert [r.id for r in rows] == ["0", "1", "2"]  # blank lines are not rows
    assert rows[2].error.startswith("line 4: invalid JSON")
    assert [r.id for r in all_rows(f"{url}/d.jsonl", id_column=None)] == ["0", "1", "2"]


def test_csv_all_strings_and_bad_lines(tmp_path):
    p = tmp_path / "d.csv"
    p.write_bytes(b'id,prompt,n\n1,"multi\nline, quoted",7\n2,short\n3,"bad \xff utf8",9\n'
                  b'\n4,ok,"x"\n')
    rows = all_rows(str(p))
    assert detect_format(str(p)) == "csv"
    assert dataset_columns(str(p)) == ["id", "prompt", "n"]
    assert rows[0].data == {"id": "1", "prompt": "multi\nline, quoted", "n": "7"}
    assert rows[1].data is None and rows[1].error == \
        "line 4: expected 3 fields (as in the header), got 2"
    assert rows[1].id == "row-1"
    assert rows[2].data is None and rows[2].error.startswith("line 5: invalid UTF-8")
    assert rows[2].id == "3"  # the id cell was intact
    assert rows[3].data == {"id": "4", "prompt": "ok", "n": "x"}
    assert [r.index for r in rows] == [0, 1, 2, 3]


def test_tsv_and_bom(tmp_path):
    p = tmp_path / "d.tsv"
    p.write_bytes("\ufeffid\tprompt\na\thello, world\n".encode())
    assert detect_format(str(p)) == "csv"
    rows = all_rows(str(p))
    assert rows[0].data == {"id": "a", "prompt": "hello, world"}
    q = tmp_path / "b.jsonl"
    q.write_bytes(b'\xef\xbb\xbf{"id": "x"}\n')
    assert all_rows(str(q))[0].id == "x"


def test_csv_delimiter_sniffed_from_the_header_or_given(tmp_path):
    """A semicolon CSV (a spreadsheet's export in many locales) reads as it is; a comma inside a quoted
    header cell doesn't fool the sniffing; an explicit delimiter wins (issue 41, item 7)."""
    semi = tmp_path / "semi.csv"
    semi.write_text('id;prompt;category\n1;"hello, world";a\n2;bye;b\n')
    assert dataset_columns(str(semi)) == ["id", "prompt", "category"]
    assert [r.data for r in all_rows(str(semi))][0] == {"id": "1", "prompt": "hello, world", "category": "a"}
    quoted = tmp_path / "quoted.csv"
    quoted.write_text('"id";"prompt, long";"x"\n1;hi;y\n')
    assert dataset_columns(str(quoted)) == ["id", "prompt, long", "x"]
    pipes = tmp_path / "pipes.csv"
    pipes.write_text("id|prompt\n1|a;b\n")
    assert all_rows(str(pipes))[0].data == {"id": "1", "prompt": "a;b"}
    forced = all_rows(str(pipes), csv_delimiter=";")[0]           # the header is then 1 field, the row 2
    assert forced.data is None and "expected 1 fields" in forced.error
    plain = tmp_path / "plain.csv"
    plain.write_text("id,prompt\n1,a;b\n")
    assert all_rows(str(plain))[0].data == {"id": "1", "prompt": "a;b"}


def test_gzip_jsonl(tmp_path):
    p = tmp_path / "d.jsonl.gz"
    p.write_bytes(gzip.compress(jsonl(RECORDS)))
    assert detect_format(str(p)) == "jsonl"
    check_records(all_rows(str(p)))


def test_gzip_csv_memory(mem):
    fs, url = mem
    fs.pipe(f"{url}/d.csv.gz", gzip.compress(b"id,prompt\na,b\n"))
    assert all_rows(f"{url}/d.csv.gz")[0].data == {"id": "a", "prompt": "b"}


@pytest.mark.parametrize("zstandard", [True, False])
def test_zstd_jsonl(tmp_path, mem, monkeypatch, zstandard):
    # with the zstandard package through fsspec, else through pyarrow's codec
    if not zstandard:
        monkeypatch.setattr(fsspec, "available_compressions", lambda: ["gzip"])
    elif "zstd" not in fsspec.available_compressions():
        pytest.skip("zstandard is not installed")
    data = pa.Codec("zstd").compress(jsonl(RECORDS), asbytes=True)
    p = tmp_path / "d.jsonl.zst"
    p.write_bytes(data)
    check_records(all_rows(str(p)))
    fs, url = mem
    fs.pipe(f"{url}/d.jsonl.zst", data)
    check_records(all_rows(f"{url}/d.jsonl.zst"))


def test_bz2_jsonl(tmp_path):
    p = tmp_path / "d.jsonl.bz2"
    p.write_bytes(bz2.compress(jsonl(RECORDS)))
    check_records(all_rows(str(p)))


def test_truncated_gzip_is_a_dataset_error(tmp_path):
    p = tmp_path / "d.jsonl.gz"
    p.write_bytes(gzip.compress(jsonl(RECORDS * 100))[:-30])
    with pytest.raises(DatasetError, match="cannot read"):
        all_rows(str(p))


def test_directory_of_parts(tmp_path):
    d = tmp_path / "ds"
    (d / "sub").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(RECORDS[:2]), d / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(RECORDS[2:4]), d / "part-1.parquet")
    pq.write_table(pa.Table.from_pylist(RECORDS[4:]), d / "sub" / "part-2.parquet")
    (d / "_SUCCESS").write_bytes(b"")
    (d / ".part-0.parquet.crc").write_bytes(b"junk")
    (d / "_tmp").mkdir()
    (d / "_tmp" / "x.parquet").write_bytes(b"junk")
    assert [f.rsplit("/", 1)[1] for f in list_files(str(d))] == \
        ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
    check_records(all_rows(str(d)))
    assert count_rows(str(d)) == 5
    assert detect_format(str(d)) == "parquet"


def test_directory_jsonl_errors_name_the_file(mem):
    fs, url = mem
    fs.pipe(f"{url}/ds/a.jsonl", b'{"id": "1"}\n')
    fs.pipe(f"{url}/ds/b.jsonl", b'{"id": "2"}\nnot json\n')
    rows = all_rows(f"{url}/ds")
    assert [r.index for r in rows] == [0, 1, 2]
    assert rows[2].error.startswith("b.jsonl line 2: invalid JSON")


def test_glob(tmp_path):
    for i in range(3):
        (tmp_path / f"x{i}.jsonl").write_bytes(jsonl([RECORDS[i]]))
    (tmp_path / "other.csv").write_bytes(b"id\nz\n")
    rows = all_rows(str(tmp_path / "x*.jsonl"))
    assert [r.id for r in rows] == ["r0", "r1", "r2"]
    assert len(list_files(str(tmp_path / "*.jsonl"))) == 3


def test_memory_glob_and_dir(mem):
    fs, url = mem
    for i in range(2):
        fs.pipe(f"{url}/g/p{i}.jsonl", jsonl([RECORDS[i]]))
    assert [r.id for r in all_rows(f"{url}/g/*.jsonl")] == ["r0", "r1"]
    assert [r.id for r in all_rows(f"{url}/g")] == ["r0", "r1"]
    assert all(u.startswith("memory://") for u in list_files(f"{url}/g"))


# ---------------------------------------------------------------- bad rows


def test_malformed_jsonl_lines_become_error_rows(mem):
    fs, url = mem
    fs.pipe(f"{url}/d.jsonl", b'{"id": "a", "prompt": "ok"}\n'
                              b'{"id": "b", "prompt": \n'
                              b'[1, 2]\n'
                              b'"just a string"\n'
                              b'{"id": "c", "prompt": "caf\xe9"}\n'
                              b'{"prompt": "no id"}\n'
                              b'{"id": null}\n'
                              b'\xff\xfe garbage\n'
                              b'{"id": "d", "prompt": "last, no newline"}')
    rows = all_rows(f"{url}/d.jsonl")
    assert [r.index for r in rows] == list(range(9))
    errs = [(r.id, r.error) for r in rows if r.error]
    assert rows[0].data == {"id": "a", "prompt": "ok"} and rows[8].id == "d"
    assert errs[0][0] == "row-1" and errs[0][1].startswith("line 2: invalid JSON")
    assert errs[1] == ("row-2", "line 3: expected a JSON object, got list")
    assert errs[2] == ("row-3", "line 4: expected a JSON object, got str")
    assert errs[3][0] == "c" and errs[3][1].startswith("line 5: invalid UTF-8")  # id recovered
    assert errs[4] == ("row-5", "line 6: missing or null id column 'id'")
    assert errs[5] == ("row-6", "line 7: missing or null id column 'id'")
    assert errs[6][0] == "row-7" and errs[6][1].startswith("line 8: invalid UTF-8")
    assert rows[5].data == {"prompt": "no id"} and rows[6].data == {"id": None}     # parsed: kept (issue 28)
    assert all(r.data is None for r in rows if r.error and r.index not in (5, 6))


def test_deeply_nested_json_line_is_an_error_row(mem):
    fs, url = mem
    fs.pipe(f"{url}/d.jsonl", b'{"id": "x", "v": ' + b"[" * 100000 + b"]" * 100000 + b"}\n")
    (row,) = all_rows(f"{url}/d.jsonl")
    assert row.error and "line 1" in row.error


def test_duplicate_ids_are_passed_through(mem):
    fs, url = mem
    fs.pipe(f"{url}/d.jsonl", jsonl([{"id": "x"}, {"id": "x"}]))
    assert [r.id for r in all_rows(f"{url}/d.jsonl")] == ["x", "x"]


# ---------------------------------------------------------------- OpenAI batch


def openai_record(cid, **body):
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"hi {cid}"}],
            **body}
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}


def test_openai_batch_detection_and_parsing(mem):
    fs, url = mem
    recs = [openai_record("req-1", max_tokens=5, temperature=0.7, top_p=0.9, seed=3, stop=["\n"]),
            openai_record("req-2", n=2),
            {"custom_id": "req-3", "method": "POST", "url": "/v1/chat/completions"},
            {"method": "POST", "body": {"messages": []}},
            openai_record("req-5") | {"url": "/v1/moderations"},
            {"custom_id": "req-6", "url": "/v1/completions", "body": {"prompt": "p", "max_tokens": 2}}]
    fs.pipe(f"{url}/batch.jsonl", jsonl(recs))
    u = f"{url}/batch.jsonl"
    assert detect_format(u) == "openai-batch"
    assert detect_format(u, "jsonl") == "jsonl"
    assert dataset_columns(u) == ["messages", "params", "model"]
    rows = all_rows(u)
    assert [r.id for r in rows] == ["req-1", "req-2", "req-3", "row-3", "req-5", "req-6"]
    assert rows[0].data == {"messages": [{"role": "user", "content": "hi req-1"}],
                            "params": {"max_tokens": 5, "temperature": 0.7, "top_p": 0.9,
                                       "seed": 3, "stop": ["\n"]},
                            "model": "gpt-4o-mini", "line": 1}      # line: the error file's error.line
    assert rows[1].data["params"] == {"n": 2}
    assert rows[2].data is None and "without a body" in rows[2].error
    assert rows[3].data is None and "line 4" in rows[3].error and "custom_id" in rows[3].error
    assert rows[4].data is None and "unsupported endpoint" in rows[4].error
    assert rows[5].data["prompt"] == "p" and rows[5].data["params"] == {"max_tokens": 2}


def test_openai_batch_explicit_format_and_gzip(tmp_path):
    p = tmp_path / "requests.jsonl.gz"
    p.write_bytes(gzip.compress(jsonl([openai_record("a"), openai_record("b")])))
    assert detect_format(str(p)) == "openai-batch"
    assert [r.id for r in all_rows(str(p), fmt="openai-batch")] == ["a", "b"]
    # the id column option does not apply: custom_id is the id
    assert [r.id for r in all_rows(str(p), id_column="custom_id")] == ["a", "b"]


# ---------------------------------------------------------------- streaming


def test_bounded_batches_all_formats(tmp_path, monkeypatch):
    n, batch = 5000, 128
    recs = [{"id": str(i), "prompt": "x" * (i % 50)} for i in range(n)]
    (tmp_path / "d.jsonl").write_bytes(jsonl(recs))
    (tmp_path / "d.csv").write_text("id,prompt\n" + "".join(f"{r['id']},{r['prompt']}\n" for r in recs))
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "d.parquet", row_group_size=2000)
    # parquet must stream record batches, never read the whole table
    monkeypatch.setattr(pq, "read_table", lambda *a, **k: pytest.fail("read_table used"))
    for name in ("d.jsonl", "d.csv", "d.parquet"):
        sizes, ids = [], []
        for b in read_rows(str(tmp_path / name), batch_rows=batch):
            sizes.append(len(b))
            ids.extend(r.id for r in b)
        assert max(sizes) <= batch and all(s == batch for s in sizes[:-1]), name
        assert ids == [str(i) for i in range(n)], name


def test_jsonl_reading_memory_is_bounded(tmp_path):
    # ~12 MB file; peak Python allocations while streaming stay far below its size
    line = json.dumps({"id": "x", "prompt": "y" * 1000}) + "\n"
    p = tmp_path / "big.jsonl"
    p.write_text(line * 12000)
    tracemalloc.start()
    try:
        count = 0
        for b in read_rows(str(p), batch_rows=64):
            count += len(b)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 12000
    assert peak < 4_000_000, peak


def test_columns_selection(tmp_path):
    recs = [{"id": "a", "prompt": "p", "big": "z" * 10}]
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_bytes(jsonl(recs))
    (tmp_path / "d.csv").write_text("id,prompt,big\na,p,zz\n")
    for name in ("d.parquet", "d.jsonl", "d.csv"):
        (row,) = all_rows(str(tmp_path / name), columns=["prompt"])
        assert row.data == {"id": "a", "prompt": "p"}, name


# ---------------------------------------------------------------- configuration errors


def test_missing_dataset(tmp_path, mem):
    with pytest.raises(DatasetError, match="dataset not found"):
        all_rows(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DatasetError, match="dataset not found"):
        detect_format(f"{mem[1]}/nope.parquet")
    with pytest.raises(DatasetError, match="dataset not found"):
        list_files(str(tmp_path / "*.csv"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "_SUCCESS").write_bytes(b"")
    with pytest.raises(DatasetError, match="no data files"):
        list_files(str(tmp_path / "empty"))
    # an explicit format still checks existence
    with pytest.raises(DatasetError, match="dataset not found"):
        all_rows(str(tmp_path / "nope.bin"), fmt="jsonl")


@pytest.mark.parametrize("name,fmt", [
    ("a.parquet", "parquet"), ("a.pq", "parquet"), ("a.jsonl", "jsonl"), ("a.json", "jsonl"),
    ("a.ndjson", "jsonl"), ("a.jsonl.gz", "jsonl"), ("a.csv", "csv"), ("a.csv.zst", "csv"),
    ("a.TSV", "csv"), ("A.JSONL.GZ", "jsonl"),
])
def test_detect_format_from_extension(tmp_path, name, fmt):
    (tmp_path / name).write_bytes(b"")
    assert detect_format(str(tmp_path / name)) == fmt


def test_format_errors(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(DatasetError, match="--format"):
        detect_format(str(tmp_path / "a.txt"))
    assert detect_format(str(tmp_path / "a.txt"), "jsonl") == "jsonl"
    assert detect_format(str(tmp_path / "a.txt"), "json") == "jsonl"
    with pytest.raises(DatasetError, match="unknown format"):
        detect_format(str(tmp_path / "a.txt"), "xml")
    (tmp_path / "mix").mkdir()
    (tmp_path / "mix" / "a.csv").write_text("id\n1\n")
    (tmp_path / "mix" / "b.jsonl").write_text("{}\n")
    with pytest.raises(DatasetError, match="mixed formats"):
        detect_format(str(tmp_path / "mix"))


def test_json_array_file_is_refused(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('[\n {"id": 1},\n {"id": 2}\n]\n')
    with pytest.raises(DatasetError, match="JSON array"):
        all_rows(str(p))


def test_csv_header_problems(tmp_path):
    (tmp_path / "dup.csv").write_text("a,a\n1,2\n")
    with pytest.raises(DatasetError, match="repeats column names"):
        all_rows(str(tmp_path / "dup.csv"))
    (tmp_path / "empty.csv").write_text("")
    assert all_rows(str(tmp_path / "empty.csv")) == []
    assert dataset_columns(str(tmp_path / "empty.csv")) == []


def test_corrupt_or_compressed_parquet(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DatasetError, match="cannot read parquet"):
        all_rows(str(tmp_path / "bad.parquet"))
    (tmp_path / "c.parquet.gz").write_bytes(gzip.compress(b"x"))
    with pytest.raises(DatasetError, match="compressed parquet"):
        all_rows(str(tmp_path / "c.parquet.gz"))


def test_iter_lines_handles_long_lines_across_chunks(monkeypatch):
    import io
    monkeypatch.setattr(files, "_CHUNK", 7)
    data = b"a" * 30 + b"\n" + b"bc\n\n" + b"d" * 15
    assert list(files.iter_lines(io.BytesIO(data))) == [b"a" * 30 + b"\n", b"bc\n", b"\n", b"d" * 15]


# ---------------------------------------------------------------- count_rows (the progress bar's total)


def counted_and_read(url, **kw):
    return count_rows(url, **kw), len(all_rows(url, **kw))


@pytest.mark.parametrize("data", [
    b'{"id": 1}\n{"id": 2}\n{"id": 3}\n',
    b'{"id": 1}\n{"id": 2}\n{"id": 3}',                       # no final newline
    b'\xef\xbb\xbf{"id": 1}\n\n  \n{"id": 2}\r\n\r\n{"id": 3}\n\n',  # BOM, blank lines
    b'{"id": 1}\nnot json\n{"id": "\xff"}\n[1, 2]\n',             # error rows are rows
    b"", b"\n\n",
])
def test_count_rows_jsonl_matches_the_rows_read(tmp_path, monkeypatch, data):
    monkeypatch.setattr(counting, "_COUNT_CHUNK", 4)          # lines across chunk ends
    p = tmp_path / "d.jsonl"
    p.write_bytes(data)
    n, read = counted_and_read(str(p))
    assert n == read


@pytest.mark.parametrize("data", [
    b"id,text\n1,a\n2,b\n3,c\n",
    b"id,text\n1,a\n2,b\n3,c",                                # no final newline
    b"\n\nid,text\r\n1,a\r\n\r\n2,b\n\n3,c\n\n",                # blank lines before and between
    b"id,text\n1,a,extra\n2\n3,\xff\n",                         # error rows are rows
    b'id,text\n1,"a\nb"\n2,"x, ""quoted""\n\nmore"\n3,c\n',       # newlines inside quoted cells
    b'id,text\n1,a\n2,b\n3,"c\nd"\n',                            # the quote comes after the first chunks
    b"id,text\n", b"",
])
def test_count_rows_csv_matches_the_rows_read(tmp_path, monkeypatch, data):
    monkeypatch.setattr(counting, "_COUNT_CHUNK", 5)
    p = tmp_path / "d.csv"
    p.write_bytes(data)
    n, read = counted_and_read(str(p))
    assert n == read


def test_count_rows_quoted_newlines_are_one_row(tmp_path):
    p = tmp_path / "q.csv"
    p.write_bytes(b'id,text\n1,"line one\nline two\nline three"\n2,plain\n')
    assert count_rows(str(p)) == 2


def test_count_rows_text_formats_compressed_dirs_and_openai(tmp_path, mem):
    d = tmp_path / "parts"
    d.mkdir()
    (d / "a.jsonl.gz").write_bytes(gzip.compress(jsonl(RECORDS)))
    (d / "b.jsonl.gz").write_bytes(gzip.compress(jsonl(RECORDS[:2])))
    assert count_rows(str(d)) == 7
    fs, url = mem
    fs.pipe(f"{url}/d.tsv", b"id\ttext\n1\ta\n2\tb\n")
    assert count_rows(f"{url}/d.tsv") == 2
    batch = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "hi"}]}} for i in range(3)]
    fs.pipe(f"{url}/batch.jsonl", jsonl(batch))
    assert detect_format(f"{url}/batch.jsonl") == "openai-batch"
    assert count_rows(f"{url}/batch.jsonl") == 3


def test_count_rows_gives_up_on_huge_text_datasets(tmp_path, monkeypatch):
    p = tmp_path / "d.jsonl"
    p.write_bytes(jsonl(RECORDS))
    monkeypatch.setattr(counting, "COUNT_MAX_BYTES", 10)
    assert count_rows(str(p)) is None


def test_json_array_is_refused_when_columns_are_listed(tmp_path):
    """Pre-flight (dataset_columns) finds it, so the CLI says so before a model loads."""
    p = tmp_path / "a.json"
    p.write_text('[\n {"id": 1, "prompt": "x"}\n]\n')
    with pytest.raises(DatasetError, match="JSON array"):
        dataset_columns(str(p))


def test_missing_fsspec_backend_says_what_to_install():
    pytest.importorskip("fsspec")
    try:
        import s3fs  # noqa: F401
        pytest.skip("s3fs is installed")
    except ImportError:
        pass
    with pytest.raises(DatasetError, match=r"jobrunner\[s3\]"):
        list_files("s3://bucket/data.jsonl")
