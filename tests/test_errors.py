"""User-facing failures: every bad invocation exits with its code and a message naming the problem,
never a traceback; the output directory is checked before the model loads; --overwrite deletes only
our own files; an empty dataset and failed rows are reported; a double Ctrl-C exits 130."""
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from jobrunner.pipeline import build
from jobrunner.cli.main import main
from jobrunner.config.job import job_config, JobConfigError
from jobrunner.pipeline.exit_codes import EXIT_OK
from jobrunner.pipeline.build import open_job
from jobrunner.output import OutputError, ResultWriter, check_output, prepare_output

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = f"dummy:{ROOT}/benchmarks/configs/tiny-llama.json"
TINY_OPTS = ["-m", TINY, "--kv-cache-memory", "4MB", "--no-chat"]


def has_s3fs() -> bool:
    try:
        import s3fs  # noqa: F401
    except ImportError:
        return False
    return True


def write_jsonl(path, rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return str(path)


def our_output(path, config=None):
    """A finished jobrunner output directory at path."""
    w = ResultWriter(str(path), {"config": config or {"max_tokens": 1}}, part_rows=1)
    w.write([{"id": "a", "output": "x", "error": None}])
    w.close({"rows": 1})
    return path


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: the checks must all come first."""
    def load_engine(cfg):
        raise AssertionError("the model was loaded before the failing check")
    monkeypatch.setattr(build, "load_engine", load_engine)


@pytest.fixture
def files(tmp_path):
    """Inputs for the bad invocations, by name."""
    good = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "hi", "text": "t"}])
    array = tmp_path / "arr.json"
    array.write_text('[\n{"id": "a", "prompt": "hi"},\n{"id": "b", "prompt": "yo"}\n]\n')
    toml = tmp_path / "bad.toml"
    toml.write_text("max_tokens = = 3\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    other = our_output(tmp_path / "other-job", {"something": "else"})
    return {"good": good, "array": str(array), "toml": str(toml), "file": str(a_file),
            "foreign": str(foreign), "other": str(other), "missing": str(tmp_path / "nope.jsonl")}


# (id, commands, argv with {placeholders} from `files`, exit code, text the message must hold)
BAD = [
    ("device-gpu", ("submit", "validate"), ["{good}", "--device", "gpu"], 2, "--device cuda"),
    ("json-array", ("submit", "validate"), ["{array}"], 2, "JSON array"),
    ("missing-dataset", ("submit", "validate"), ["{missing}"], 2, "dataset not found"),
    ("unknown-format", ("submit", "validate"), ["{good}", "--format", "xml"], 2, "--format"),
    ("bad-toml", ("submit", "validate"), ["{good}", "--config", "{toml}"], 2, "cannot read --config"),
    ("template-column", ("submit", "validate"), ["{good}", "--template", "Q: {{nope}}"], 2, "nope"),
    ("uncreatable-output", ("submit",), ["{good}", "-o", "/proc/nope/out"], 4, "/proc/nope/out"),
    ("output-is-a-file", ("submit",), ["{good}", "-o", "{file}"], 2, "is a file"),
    ("foreign-output", ("submit",), ["{good}", "-o", "{foreign}"], 2, "not a jobrunner output"),
    ("different-job", ("submit",), ["{good}", "-o", "{other}"], 2, "different job"),
    ("s3-output-no-s3fs", ("submit",), ["{good}", "-o", "s3://bucket/out"], 2, "jobrunner[s3]"),
    ("s3-dataset-no-s3fs", ("submit", "validate"), ["s3://bucket/d.jsonl"], 2, "jobrunner[s3]"),
]
CASES = [pytest.param(cmd, argv, code, text, id=f"{cmd}-{name}")
         for name, cmds, argv, code, text in BAD for cmd in cmds]


@pytest.mark.parametrize("command,argv,code,text", CASES)
def test_bad_invocations_exit_with_a_message_and_no_traceback(files, no_model, command, argv, code, text):
    if "s3://" in " ".join(argv) and has_s3fs():
        pytest.skip("s3fs is installed")
    args = [command] + [a.format(**files) for a in argv]
    r = CliRunner().invoke(main, args)
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exc_info
    assert r.exit_code == code, r.output
    assert text in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("command", ["submit", "validate"])
def test_unknown_model_name(files, command):
    r = CliRunner().invoke(main, [command, files["good"], "-m", "no-such-model"])
    assert r.exit_code == 2 and "no-such-model" in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_bad_invocation_in_a_real_process(files):
    """No traceback on the real stderr either (click's CliRunner captures, a process prints)."""
    for argv, code in ((["--device", "gpu"], 2), (["-o", "/proc/nope/out"], 4)):
        p = subprocess.run([sys.executable, "-m", "jobrunner.cli.main", "submit", files["good"], *argv],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == code and "error:" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_device_validation():
    for ok in ("auto", "cpu", "cuda", "cuda:0", "cuda:3"):
        job_config("d.jsonl", device=ok)
    for bad in ("gpu", "GPU", "cuda:x", "tpu", "cuda:"):
        with pytest.raises(JobConfigError, match="--device"):
            job_config("d.jsonl", device=bad)
    import torch
    if not torch.backends.mps.is_available():
        with pytest.raises(JobConfigError, match="mps"):
            job_config("d.jsonl", device="mps")


# ---------------------------------------------------------------- --overwrite and check_output


def test_overwrite_refuses_foreign_files_and_deletes_nothing(tmp_path):
    out = our_output(tmp_path / "out")
    (out / "notes.txt").write_text("mine")
    (out / "plots").mkdir()
    before = sorted(os.listdir(out))
    with pytest.raises(OutputError, match="notes.txt") as e:
        ResultWriter(str(out), {"config": {"max_tokens": 2}}, overwrite=True)
    assert "plots" in str(e.value) and "nothing was deleted" in str(e.value)
    assert sorted(os.listdir(out)) == before and (out / "notes.txt").read_text() == "mine"
    with pytest.raises(OutputError, match="notes.txt"):
        check_output(str(out), {"max_tokens": 2}, overwrite=True)
    # resuming the same job into it is fine: nothing is deleted then
    ResultWriter(str(out), {"config": {"max_tokens": 1}}).close()
    assert (out / "notes.txt").exists()


def test_overwrite_deletes_only_our_files_and_keeps_the_directory(tmp_path):
    out = our_output(tmp_path / "out")
    for name in ("_corrupt-part-00007.parquet", "_corrupt-1-part-r1-00002.parquet", "results.openai.jsonl",
                 "_tmp-part-00009.parquet.0a1b2c", "part-r1-00000.parquet"):
        (out / name).write_bytes(b"ours")
    inode = os.stat(out).st_ino
    w = ResultWriter(str(out), {"config": {"max_tokens": 2}}, overwrite=True)
    assert not w.done_ids
    assert os.listdir(out) == ["_manifest.json"] and os.stat(out).st_ino == inode


def error_of(fn, *args) -> str | None:
    try:
        fn(*args)
    except OutputError as e:
        return str(e)
    return None


@pytest.mark.parametrize("state", ["missing", "empty", "ours-same", "ours-other", "ours-plus-foreign",
                                   "foreign", "file", "first-manifest-temp"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_check_output_refuses_exactly_what_prepare_output_refuses(tmp_path, state, overwrite):
    out = tmp_path / "out"
    config = {"max_tokens": 1}
    if state == "empty":
        out.mkdir()
    elif state.startswith("ours"):
        our_output(out, config if state != "ours-other" else {"max_tokens": 9})
        if state == "ours-plus-foreign":
            (out / "notes.txt").write_text("x")
    elif state == "foreign":
        out.mkdir()
        (out / "thesis.tex").write_text("x")
    elif state == "file":
        out.write_text("x")
    elif state == "first-manifest-temp":
        out.mkdir()
        (out / "_tmp-_manifest.json.0123abcd").write_text('{"form')
    before = sorted(os.listdir(out)) if out.is_dir() else None
    checked = error_of(check_output, str(out), config, overwrite)
    after = sorted(os.listdir(out)) if out.is_dir() else None
    assert after == ([] if state == "missing" else before)      # read-only: at most it made the directory
    prepared = error_of(prepare_output, str(out), {"config": config}, overwrite)
    assert checked == prepared


def test_check_output_creates_the_directory_or_says_why_not(tmp_path):
    check_output(str(tmp_path / "a" / "b"), {"x": 1})
    assert (tmp_path / "a" / "b").is_dir() and os.listdir(tmp_path / "a" / "b") == []
    with pytest.raises(OSError, match="cannot create the output directory /proc/nope/out"):
        check_output("/proc/nope/out", {"x": 1})


def test_job_prepare_checks_the_output_before_loading_the_model(tmp_path, no_model):
    ds = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "hi"}])
    other = our_output(tmp_path / "other", {"something": "else"})
    with pytest.raises(JobConfigError, match="different job"):
        open_job(job_config(ds, output=str(other)))
    with pytest.raises(OSError, match="cannot create"):
        open_job(job_config(ds, output="/proc/nope/out"))


def test_data_parallel_preflight_checks_the_output_and_emptiness(tmp_path):
    from jobrunner.parallel import _preflight
    ds = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "hi"}])
    other = our_output(tmp_path / "other", {"something": "else"})
    with pytest.raises(JobConfigError, match="different job"):
        _preflight(job_config(ds, output=str(other)))
    _preflight(job_config(ds, output=str(tmp_path / "fresh")))
    assert (tmp_path / "fresh").is_dir()
    empty = write_jsonl(tmp_path / "e.jsonl", [], tail="\n")
    _preflight(job_config(empty, output=str(tmp_path / "e1")))     # a warning only
    with pytest.raises(JobConfigError, match="no rows"):
        _preflight(job_config(empty, output=str(tmp_path / "e2"), fail_on_empty=True))


# ---------------------------------------------------------------- empty datasets and failed rows


@pytest.fixture(scope="module")
def tiny_engine():
    return build.load_engine(job_config("unused", model=TINY, kv_cache_memory=4 * 10**6))


def run_job(engine, **kw):
    job = open_job(job_config(model=TINY, max_tokens=2, chat=False, **kw), engine=engine)
    return job.run()


def test_empty_dataset_warns_and_fail_on_empty_exits_2(tmp_path, tiny_engine, caplog):
    empty = write_jsonl(tmp_path / "e.jsonl", [])
    with caplog.at_level(logging.WARNING, logger="jobrunner"):
        res = run_job(tiny_engine, dataset=empty, output=str(tmp_path / "o1"))
    assert res.exit_code == EXIT_OK and "has no rows" in caplog.text
    with pytest.raises(JobConfigError, match="--fail-on-empty"):      # in prepare: exit 2, nothing written
        run_job(tiny_engine, dataset=empty, output=str(tmp_path / "o2"), fail_on_empty=True)
    assert not (tmp_path / "o2").exists()


def test_a_resumed_job_with_nothing_left_is_not_empty(tmp_path, tiny_engine, caplog):
    ds = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "hi"}])
    out = str(tmp_path / "out")
    assert run_job(tiny_engine, dataset=ds, output=out).exit_code == EXIT_OK
    with caplog.at_level(logging.WARNING, logger="jobrunner"):
        res = run_job(tiny_engine, dataset=ds, output=out, fail_on_empty=True)
    assert res.exit_code == EXIT_OK and "no rows" not in caplog.text


def test_failed_rows_are_reported_without_max_error_rate(tmp_path, tiny_engine, caplog):
    ds = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "hi"}, {"id": "b", "prompt": "yo"}],
                     tail="{not json\n")
    out = str(tmp_path / "out")
    with caplog.at_level(logging.WARNING, logger="jobrunner"):
        res = run_job(tiny_engine, dataset=ds, output=out)
    assert res.exit_code == EXIT_OK
    assert f"1 of 3 rows failed; their errors are in the `error` column of {out}" in caplog.text


def test_fail_on_empty_on_the_command_line(tmp_path, caplog):
    empty = write_jsonl(tmp_path / "e.jsonl", [])
    r = CliRunner().invoke(main, ["submit", empty, *TINY_OPTS, "-o", str(tmp_path / "o"), "--fail-on-empty"])
    assert r.exit_code == 2 and "has no rows" in r.output and not (tmp_path / "o").exists(), r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


# ---------------------------------------------------------------- Ctrl-C twice


def test_double_ctrl_c_exits_130_without_a_traceback(tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"row {i} " * 8} for i in range(3000)]
    ds = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "jobrunner.cli.main", "submit", ds, *TINY_OPTS, "-o", str(out), "--max-tokens", "8",
           "--ignore-eos", "--part-rows", "1", "--max-num-seqs", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not (out.is_dir() and any(p.startswith("part-") for p in os.listdir(out))):
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        seen = []
        for line in proc.stderr:        # the first one handled (Job._on_signal logs it): now the second
            seen.append(line)
            if "signal 2" in line:
                proc.send_signal(signal.SIGINT)
                break
        err = "".join(seen) + proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Aborted" not in err and "resume" in err
