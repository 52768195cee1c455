"""Tensor parallelism through the job runner, on CPU (gloo): `submit --tensor-parallel 2` gives the rows
one process gives, DP 2 x TP 2 over 4 processes too; a rank killed mid-job exits 1 and a rerun finishes
every id exactly once; validate's split report; the options' checks (exit 2 before any work).

Every process runs one thread: on a 2-core machine more threads with gloo oversubscribe the cores.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
from click.testing import CliRunner

from jobrunner.cli.main import main
from jobrunner.config.job import job_config
from jobrunner.output import read_results

N_ROWS = 24


def _rows(n: int) -> list[dict]:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    return [{"id": f"r{i}", "prompt": " ".join(words[(i * 7 + k) % len(words)] for k in range(3 + i % 9))}
            for i in range(n)]


@pytest.fixture(scope="module")
def setup(tiny_hf_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tpjobs")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(N_ROWS)))
    model = str(tiny_hf_model_dir("llama"))
    common = ["-m", model, "--device", "cpu", "--threads", "1", "--no-chat", "--max-tokens", "8", "--ignore-eos",
              "--max-num-seqs", "4", "--part-rows", "5", "--kv-cache-memory", "4MiB"]
    out = str(root / "tp1")
    r = CliRunner().invoke(main, ["submit", str(data), *common, "-o", out])
    assert r.exit_code == 0, r.output
    reference = _outputs(out)
    assert len(reference) == N_ROWS and len({v[0] for v in reference.values()}) > 5   # outputs differ by row
    return {"root": root, "data": str(data), "model": model, "common": common, "reference": reference}


def _outputs(output: str) -> dict:
    rows = read_results(output).to_pylist()
    counts = Counter(r["id"] for r in rows)
    assert max(counts.values()) == 1, f"ids written twice: {[k for k, v in counts.items() if v > 1]}"
    return {r["id"]: (r["output"], r["completion_tokens"], r["error"]) for r in rows}


def test_submit_tensor_parallel_2_gives_the_rows_of_one_process(setup):
    out = str(setup["root"] / "tp2")
    r = CliRunner().invoke(main, ["submit", setup["data"], *setup["common"], "--tensor-parallel", "2", "-o", out])
    assert r.exit_code == 0, r.output
    assert _outputs(out) == setup["reference"]
    stats = json.loads(open(os.path.join(out, "_stats.json")).read())
    assert stats["devices"] == 2            # a device-hour is counted for each rank
    manifest = json.loads(open(os.path.join(out, "_manifest.json")).read())
    assert manifest["complete"] is True and "tensor_parallel" not in manifest["config"]    # not in the fingerprint


def test_data_parallel_2_by_tensor_parallel_2_over_4_processes(setup):
    out = str(setup["root"] / "dp2tp2")
    r = CliRunner().invoke(main, ["submit", setup["data"], *setup["common"], "--data-parallel", "2",
                                  "--tensor-parallel", "2", "-o", out])
    assert r.exit_code == 0, r.output
    assert _outputs(out) == setup["reference"]
    stats = json.loads(open(os.path.join(out, "_stats.json")).read())
    assert stats["devices"] == 4 and stats["data_parallel"]["workers"] == 2
    assert sum(w["rows"] for w in stats["workers"].values()) == N_ROWS


def test_a_killed_rank_exits_1_and_a_rerun_finishes_every_id_once(setup, tmp_path):
    data = tmp_path / "many.jsonl"
    n = 40
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(n)))
    out = tmp_path / "out"
    # one row at a time and a part per row: parts appear early, and most rows are still to come at the kill
    cmd = [sys.executable, "-m", "jobrunner.cli.main", "submit", str(data), *setup["common"], "--tensor-parallel", "2",
           "--max-num-seqs", "1", "--part-rows", "1", "--no-plan", "-o", str(out)]
    log = tmp_path / "log.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    try:
        follower = None
        while proc.poll() is None:
            if follower is None:
                m = re.search(r"tensor parallel: 2 ranks; ranks 1-1 are processes (\d+)", log.read_text())
                follower = int(m.group(1)) if m else None
            if follower is not None and out.exists() and any(p.startswith("part") for p in os.listdir(out)):
                os.kill(follower, signal.SIGKILL)
                break
            time.sleep(0.02)
        assert follower is not None, log.read_text()
        assert proc.wait(timeout=300) == 1, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "tensor-parallel rank 1" in errors[0] and "run the same command again" in errors[0]
    assert "Traceback" not in text
    written = read_results(str(out)).to_pylist()
    assert 0 < len(written) < n
    # run again, it resumes: every id exactly once, each as one process computes it (batch and part sizes
    # are not in the job's fingerprint: larger ones here only save time)
    rerun = CliRunner().invoke(main, ["submit", str(data), *setup["common"], "--tensor-parallel", "2",
                                      "--part-rows", "20", "-o", str(out)])
    assert rerun.exit_code == 0, rerun.output
    got = _outputs(str(out))
    assert sorted(got) == sorted(r["id"] for r in _rows(n))
    assert {k: v for k, v in got.items() if k in setup["reference"]} == setup["reference"]


def test_validate_reports_the_split_and_refuses_a_size_that_does_not_divide(setup):
    def validate(*args):
        return CliRunner().invoke(main, ["validate", setup["data"], "-m", setup["model"], "--device", "cpu",
                                         "--no-chat", *args])
    r = validate("--tensor-parallel", "2")
    assert r.exit_code == 0, r.output
    lines = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in r.output.splitlines() if re.search(r"\S\s{2,}", line))
    assert lines["tensor_parallel"].startswith("2 ranks")
    assert lines["attention heads per rank"] == "2 of 4"
    assert lines["KV heads per rank"] == "1 of 2 (split)"
    assert lines["MLP columns per rank"] == "64 of 128"
    assert lines["weights per rank"].startswith("about ") and "float32" in lines["weights per rank"]
    assert lines["device memory"].startswith("CPU: host memory") and lines["fits"].startswith(("yes", "no"))
    r = validate("--tensor-parallel", "4")
    assert r.exit_code == 0, r.output
    assert "1 of 2 (replicated: each kept by 2 ranks)" in r.output
    r = validate("--tensor-parallel", "3")
    assert r.exit_code == 2
    assert "--tensor-parallel 3" in r.output and "do not split evenly" in r.output


@pytest.mark.parametrize("size,experts,gib", [
    (4, r"all 128 on every rank, each split by columns: 192 of 768", (13, 15)),     # ~57 GiB of bfloat16 over 4
    (8, r"16 of 128 whole", (6.5, 7.5)),          # 96 of 768 columns each would be narrow: experts held whole
])
def test_validate_says_how_experts_split(setup, size, experts, gib):
    r = CliRunner().invoke(main, ["validate", setup["data"], "-m", "dummy:qwen3-30b-a3b", "--device", "cpu",
                                  "--no-chat", "--tensor-parallel", str(size), "--dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    assert re.search(rf"experts per rank\s+{experts}", r.output)
    per_rank = re.search(r"weights per rank\s+about ([\d.]+) GiB", r.output)
    assert per_rank and gib[0] < float(per_rank.group(1)) < gib[1]


def test_option_checks_exit_2_before_any_work(setup, tmp_path):
    out = tmp_path / "never"

    def submit(*args):
        return CliRunner().invoke(main, ["submit", setup["data"], *setup["common"], "-o", str(out), *args])
    r = submit("--tensor-parallel", "0")
    assert r.exit_code == 2 and "--tensor-parallel must be an integer >= 1" in r.output
    r = submit("--tensor-parallel", "2", "--quantization", "w8a8")
    assert r.exit_code == 2 and "w8a8" in r.output and "--tensor-parallel" in r.output
    toml = tmp_path / "job.toml"
    toml.write_text("tensor_parallel = 0\n")
    r = submit("--config", str(toml))
    assert r.exit_code == 2 and "--tensor-parallel must be" in r.output
    toml.write_text('tensor_parallel = "two"\n')
    r = submit("--config", str(toml))
    assert r.exit_code == 2 and "tensor_parallel must be an integer" in r.output
    assert not out.exists()
    r = submit("--tensor-parallel", "3")          # the engine's check_split, before any follower starts
    assert r.exit_code == 2 and "do not split evenly" in r.output


def test_threads_are_shared_by_the_ranks(setup):
    from jobrunner.pipeline.resolve import resolve_engine
    assert job_config("x", threads=4, tensor_parallel=2).cpu_threads() == 2
    assert job_config("x", threads=1, tensor_parallel=2).cpu_threads() == 1        # at least one each
    cfg = job_config("x", model=setup["model"], threads=6, tensor_parallel=4)
    ec = cfg.engine_config(resolve_engine(cfg))
    assert ec.tensor_parallel == 4 and ec.num_threads == 1
    # not in the fingerprint: a job may resume with another split (greedy outputs are the same by design)
    assert job_config("x", tensor_parallel=2).fingerprint_fields() == job_config("x").fingerprint_fields()


def test_gpus_for_data_parallel_by_tensor_parallel(monkeypatch):
    """No GPU here: the device arithmetic alone, with 4 GPUs pretended."""
    from jobrunner.config.job import JobConfigError
    from jobrunner.pipeline import checks
    from jobrunner.parallel import world
    assert world.gpu_groups("3,5,6,7", 4, 2, 2) == ["3,5", "6,7"]     # the user's CUDA_VISIBLE_DEVICES honoured
    assert world.gpu_groups(None, 4, 4, 1) == ["0", "1", "2", "3"]
    for module in (checks, world):
        monkeypatch.setattr(module, "cuda_count", lambda device: 4)
    def sections(**options):
        cfg = job_config("x", **options)
        return cfg.engine, cfg.parallel
    assert world.data_parallel_size(*sections(tensor_parallel=2)) == 2
    assert world.data_parallel_size(*sections(tensor_parallel=8)) == 1
    checks.check_gpus(*sections(tensor_parallel=2), 2)
    with pytest.raises(JobConfigError, match=r"--data-parallel 3 x --tensor-parallel 2 needs 6 GPUs.*default is 2"):
        checks.check_gpus(*sections(tensor_parallel=2), 3)
    with pytest.raises(JobConfigError, match=r"--tensor-parallel 2 from cuda:3 needs 5 GPUs"):
        checks.check_gpus(*sections(device="cuda:3", tensor_parallel=2))
    checks.check_gpus(*sections(device="cpu", tensor_parallel=8), 4)      # CPU: nothing to check
