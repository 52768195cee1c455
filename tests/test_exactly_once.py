"""Exactly once with repeated ids (issue 58): a duplicate's error row never makes its id done, so a resume
after a kill at any moment writes what the uninterrupted run writes; a finished output with duplicates
loads no model on a rerun; `compare` joins one row per id and gates the rows missing from the candidate."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
from click.testing import CliRunner

import jobrunner
from jobrunner.cli.main import main
from jobrunner.config.job import job_config
from jobrunner.pipeline import build
from jobrunner.pipeline.build import open_job
from jobrunner.output import ResultWriter, read_results, read_stats
from jobrunner.output.done import DoneRows, Occurrences, duplicate_error
from tests.report_helpers import classify_rows, write_output

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = f"dummy:{ROOT}/benchmarks/configs/tiny-llama.json"
TINY_OPTS = ["-m", TINY, "--kv-cache-memory", "4MB", "--no-chat"]
CLASSIFY = {"reference_column": "input_label", "labels": ["positive", "negative", "neutral"], "match": "normalized"}


def _dataset(path, ids: list[str]) -> str:
    path.write_text("".join(json.dumps({"id": i, "prompt": f"Say the number {i} in words."}) + "\n" for i in ids))
    return str(path)


def _rows(output: str) -> list[tuple[str, str | None]]:
    """(id, error) of every output row, sorted."""
    rows = read_results(output).select(["id", "error"]).to_pylist()
    return sorted(((r["id"], r["error"]) for r in rows), key=lambda r: (r[0], r[1] or ""))


def _expected(ids: list[str]) -> list[tuple[str, str | None]]:
    """What an uninterrupted run writes: each id's own row, and an error row for each later occurrence."""
    seen: Counter = Counter()
    rows = []
    for i in ids:
        rows.append((i, duplicate_error(i) if seen[i] else None))
        seen[i] += 1
    return sorted(rows, key=lambda r: (r[0], r[1] or ""))


# Every id repeated (and one thrice): every duplicate's error row is written at intake, before any row is
# computed, and is in the first part (--flush-seconds 0.2: written well before a 400-token row is done), so a
# kill right after it leaves ids whose own row is not written.
REPEATED = [str(i) for i in range(8)] + [str(i) for i in range(8)] + ["5"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_a_kill_right_after_the_first_part_loses_no_row_of_a_repeated_id(tmp_path, sig):
    ds, out = _dataset(tmp_path / "d.jsonl", REPEATED), str(tmp_path / "out")
    cmd = [sys.executable, "-m", "jobrunner.cli.main", "submit", ds, "-o", out, *TINY_OPTS, "--max-tokens", "400",
           "--ignore-eos", "--max-num-seqs", "2", "--flush-seconds", "0.2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and not os.path.exists(f"{out}/part-00000.parquet"):
        time.sleep(0.01)
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == (-signal.SIGKILL if sig == signal.SIGKILL else 130)
    killed = _rows(out)
    own = {i for i, error in killed if error is None}
    assert len([1 for _, error in killed if error]) == 9        # every duplicate's error row, in the first part
    assert len(own) < 8, "the kill came after every row was computed: nothing left to test"
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    assert _rows(out) == _expected(REPEATED)        # each id's own row once, each duplicate's error row once
    stats = read_stats(out)
    assert stats["rows"] == len(REPEATED) and stats["rows_failed"] == 9
    assert stats["duplicate_ids"] == 9      # counted from the parts: the killed run recorded none
    assert stats["runs"][-1]["rows_skipped_done"] == len(killed)


def test_a_rerun_of_a_finished_output_with_duplicates_loads_no_model(tmp_path, monkeypatch):
    ds, out = _dataset(tmp_path / "d.jsonl", ["a", "b", "a", "c"]), str(tmp_path / "out")
    args = ["submit", ds, "-o", out, *TINY_OPTS, "--max-tokens", "2"]
    assert CliRunner().invoke(main, args).exit_code == 0
    runs = len(read_stats(out)["runs"])

    def no_model(*a, **k):
        raise AssertionError("a finished output loaded the model")
    monkeypatch.setattr(build, "load_engine", no_model)
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0, again.output
    assert len(read_stats(out)["runs"]) == runs         # no empty run appended
    assert _rows(out) == _expected(["a", "b", "a", "c"])


@pytest.fixture(scope="module")
def tiny_engine():
    return build.load_engine(job_config("unused", model=TINY, kv_cache_memory=4 * 10**6))


@pytest.mark.parametrize("written, computed", [
    ([("a", "dup")], ["a", "b"]),               # killed after the first part: the duplicate's row only
    ([("a", None), ("b", None)], []),           # killed before the duplicate was read: its row only is left
    ([("a", "dup"), ("a", None)], ["b"]),
    ([("b", None), ("a", "dup"), ("a", None)], []),
], ids=["duplicate-only", "own-rows-only", "a-whole", "b-and-a-whole"])
def test_a_resume_skips_each_occurrence_written_and_writes_each_other_once(tmp_path, tiny_engine, written, computed):
    """An output as a kill left it (its parts by hand), resumed: only the occurrences not in it are written."""
    ids = ["a", "b", "a"]
    ds, out = _dataset(tmp_path / "d.jsonl", ids), str(tmp_path / "out")

    def cfg():
        return job_config(ds, output=out, model=TINY, max_tokens=2, chat=False)
    first = open_job(cfg(), engine=tiny_engine)          # its manifest and declared schema; nothing run
    first.writer.write([{"id": i, "error": duplicate_error(i) if e else None, "output": None if e else "x"}
                        for i, e in written])
    first.writer.flush()
    res = open_job(cfg(), engine=tiny_engine).run()
    assert _rows(out) == _expected(ids)
    run = res.stats["runs"][-1]
    assert run["rows_skipped_done"] == len(written)
    assert run["rows"] == len(ids) - len(written) and run["rows_ok"] == len(computed)


def test_done_rows_key_duplicates_by_occurrence():
    import pyarrow as pa
    done = DoneRows()
    done.add(["x", "y", "x"], pa.array([duplicate_error("x"), None, "line 3: " + duplicate_error("x")]))
    done.add(["x", "z"], pa.array([None, "prompt too long"]))
    assert set(k for k in "xyz" if k in done.ids) == {"x", "y", "z"} and "z" in done.failed and "x" not in done.failed
    numbers = Occurrences().number(["x", "y", "x", "x", "x", "w"])
    assert numbers == [1, 1, 2, 3, 4, 1]
    assert done.contains(["x", "y", "x", "x", "x", "w"], numbers) == [True, True, True, True, False, False]
    only_dup = DoneRows()
    only_dup.add(["x"], pa.array([duplicate_error("x")]))
    assert only_dup.contains(["x", "x"], [1, 2]) == [False, True]       # the duplicate never makes x done


def _with_duplicates(rows: list[dict], ids: list[str], first: bool) -> list[dict]:
    """rows plus a duplicate's error row for each of ids, written before (first) or after the rows."""
    dups = [{**next(r for r in rows if r["id"] == i), "error": duplicate_error(i), "label": None, "output": None,
             "confidence": None, "correct": None, "finish_reason": "error"} for i in ids]
    return dups + rows if first else rows + dups


def test_a_self_compare_with_duplicates_changes_nothing(tmp_path):
    rows = classify_rows(40)
    base = write_output(tmp_path / "base", "classify", _with_duplicates(rows, ["r007", "r011"], first=True), CLASSIFY)
    cand = write_output(tmp_path / "cand", "classify", _with_duplicates(rows, ["r007", "r011"], first=False), CLASSIFY)
    for other in (base, cand):
        r = CliRunner().invoke(main, ["compare", base, other, "--max-changed-rate", "0"])
        assert r.exit_code == 0, r.output
        assert "duplicates  2 in base, 2 in the candidate" in r.output
    got = jobrunner.compare(base, cand)
    assert got["rows"]["common"] == 40 and got["rows"]["only_in_base"] == got["rows"]["only_in_candidate"] == 0
    assert got["rows"]["duplicates_in_base"] == got["rows"]["duplicates_in_candidate"] == 2
    assert got["changed"]["rows"] == 0 and got["changed"]["top"] == []


def test_the_missing_rate_gate(tmp_path):
    rows = classify_rows(40)        # rows 5, 16 and 27 are error rows
    base = write_output(tmp_path / "base", "classify", rows, CLASSIFY)
    few = write_output(tmp_path / "few", "classify", rows[:5], CLASSIFY)
    failed = write_output(tmp_path / "failed", "classify",
                          [{**r, "error": "prompt too long", "label": None, "output": None} for r in rows], CLASSIFY)
    got = jobrunner.compare(base, few, max_missing_rate=0.5)
    assert got["rows"]["missing_rate"] == 35 / 40 and got["exit_code"] == 3
    assert got["gates"][0] == {"gate": "max_missing_rate", "limit": 0.5, "value": 35 / 40, "crossed": True}
    cases = [(base, few, "0.9", 0), (base, few, "0.8", 3), (few, base, "0", 0),     # extra rows are not missing
             (base, failed, "0", 0)]         # error rows are present (the changed rate says they failed)
    for b, c, limit, code in cases:
        r = CliRunner().invoke(main, ["compare", b, c, "--max-missing-rate", limit])
        assert r.exit_code == code, (b, c, limit, r.output)
        assert ("max_missing_rate" in r.output) and (("CROSSED" in r.output) == (code == 3))
