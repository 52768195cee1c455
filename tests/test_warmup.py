"""`jobrunner warmup` pays a first job's one-time costs in the foreground: on CPU that includes compiling the
in-place decode attention (about a second); a job that finds it absent compiles it itself and says nothing
about warmup."""
from __future__ import annotations

import logging

import pytest
from click.testing import CliRunner

from jobrunner.cli.main import main
from jobrunner.engine.run import cpu_decode as cd


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("JOBRUNNER_CPU_DECODE", raising=False)
    return tmp_path / "cache"


def test_warmup_builds_the_decode_kernel_once(cache, tiny_hf_model_dir):
    r = CliRunner().invoke(main, ["warmup", "-m", str(tiny_hf_model_dir("llama"))])
    assert r.exit_code == 0, r.output
    path = cd.library_path()
    assert path.exists() and "decode_kernel_s" in r.output
    stamp = path.stat().st_mtime_ns
    r = CliRunner().invoke(main, ["warmup", "-m", str(tiny_hf_model_dir("llama"))])
    assert r.exit_code == 0, r.output
    assert path.stat().st_mtime_ns == stamp                    # found in the cache, not built again


def test_a_first_job_builds_it_itself(cache, tiny_hf_model_dir, tmp_path, caplog):
    ds = tmp_path / "p.jsonl"
    ds.write_text("".join(f'{{"id": {i}, "prompt": "hello number {i}"}}\n' for i in range(3)))
    with caplog.at_level(logging.INFO, logger="jobrunner"):
        r = CliRunner().invoke(main, ["submit", str(ds), "-m", str(tiny_hf_model_dir("llama")), "--no-chat",
                                      "--max-tokens", "8", "--min-tokens", "8", "-o", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert cd.library_path().exists()
    assert "warmup" not in caplog.text and "not available" not in caplog.text
