"""`jobrunner warmup` builds the CPU decode attention package once, in the foreground; a job never starts a
build on the cores it runs on (issue 28 item 17). The package build itself (a minute) is faked here: the
real one is checked by test_cpu_attention's slow test."""
from __future__ import annotations

import logging

import pytest
from click.testing import CliRunner

from jobrunner.cli.main import main
from engine import cpu_decode as cd


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """The package's compile writes a marker instead; its load gives a runner that fails, so the dispatch
    sets it aside and gathers (the outputs stay the reference's)."""
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("JOBRUNNER_CPU_DECODE", raising=False)
    built = []

    def build(key, path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("package")
        built.append(key)

    def load(path):
        def runner(args):
            raise RuntimeError("a fake package")
        return runner

    monkeypatch.setattr(cd, "compile_decode_package", build)
    monkeypatch.setattr(cd, "load_decode_package", load)
    return built


def test_warmup_builds_the_models_package_once(fake_build, tiny_hf_model_dir, monkeypatch):
    r = CliRunner().invoke(main, ["warmup", "-m", str(tiny_hf_model_dir("llama"))])
    assert r.exit_code == 0, r.output
    assert len(fake_build) == 1 and cd.package_path(fake_build[0]).exists()
    assert "decode_kernel_s" in r.output
    # another process (a new engine): the package is in the cache
    r = CliRunner().invoke(main, ["warmup", "-m", str(tiny_hf_model_dir("llama"))])
    assert r.exit_code == 0, r.output
    assert len(fake_build) == 1


def test_a_job_never_starts_a_build_and_says_how(fake_build, tiny_hf_model_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("JOBRUNNER_CPU_DECODE_BUILD_AFTER", raising=False)     # the default policy
    started = []
    monkeypatch.setattr(cd.subprocess, "Popen", lambda *a, **kw: started.append(a))
    ds = tmp_path / "p.jsonl"
    ds.write_text("".join(f'{{"id": {i}, "prompt": "hello number {i}"}}\n' for i in range(3)))
    with caplog.at_level(logging.INFO, logger="jobrunner"):
        r = CliRunner().invoke(main, ["submit", str(ds), "-m", str(tiny_hf_model_dir("llama")), "--no-chat",
                                      "--max-tokens", "8", "--min-tokens", "8", "-o", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert not started and not fake_build
    assert caplog.text.count("`jobrunner warmup` builds") == 1
