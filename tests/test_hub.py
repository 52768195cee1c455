"""Hugging Face Hub names (jobrunner.hub): `-m org/name[@revision]` from the standard HF cache,
offline. No hub is reachable here, so each test lays a tiny checkpoint out the way
huggingface_hub's downloads leave it:

    <HF_HUB_CACHE>/models--org--name/blobs/<sha256>, snapshots/<commit>/<file> -> blob, refs/<branch>
"""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobrunner.engine.api.errors import ModelError
from jobrunner.models import hub, known as models
from jobrunner.cli.main import main

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def populate_hf_cache(cache: Path, repo: str, src: Path, commit: str, refs=("main",)) -> Path:
    """src's files as one commit of `repo` in an HF hub cache; returns the snapshot directory."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for f in sorted(p for p in src.iterdir() if p.is_file()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        (root / "blobs" / digest).write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", digest))
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty HF cache in offline mode, for this process (huggingface_hub reads its environment
    once, at import) and for subprocesses (through the environment)."""
    from huggingface_hub import constants
    cache = tmp_path / "hf-hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_names():
    assert hub.parse("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", None)
    assert hub.parse("org/name@v1.0") == ("org/name", "v1.0")
    assert hub.parse(f"org/name@{COMMIT}") == ("org/name", COMMIT)
    for not_hub in ("smollm2-135m-instruct", "dummy:smollm2-135m", "s3://bucket/dir", "a/b/c", "./a/b", "m.gguf"):
        assert not hub.is_hub_name(not_hub), not_hub


def test_resolve_branch_tag_and_commit_offline(offline_cache, tiny_hf_model_dir):
    src = tiny_hf_model_dir("qwen2")
    main_snap = populate_hf_cache(offline_cache, "tiny-org/tiny-qwen2", src, COMMIT)
    tag_snap = populate_hf_cache(offline_cache, "tiny-org/tiny-qwen2", src, OTHER, refs=("v1",))
    assert models.resolve_model("tiny-org/tiny-qwen2") == str(main_snap)
    assert models.resolve_model("tiny-org/tiny-qwen2@v1") == str(tag_snap)
    assert models.pull(f"tiny-org/tiny-qwen2@{OTHER}") == tag_snap
    assert models.model_record("tiny-org/tiny-qwen2@v1", str(tag_snap)) == {
        "repo": "tiny-org/tiny-qwen2", "revision": "v1", "commit": OTHER}
    assert models.model_record(str(src), str(src)) is None


def test_missing_model_offline_is_a_clear_error(offline_cache, tmp_path):
    with pytest.raises(ModelError, match="not in the Hugging Face cache.*models pull"):
        models.resolve_model("tiny-org/absent")
    result = CliRunner().invoke(main, ["models", "pull", "tiny-org/absent"])
    assert result.exit_code == 2 and "HF_HUB_OFFLINE" in result.output
    (tmp_path / "x.jsonl").write_text('{"prompt": "hi"}\n')
    result = CliRunner().invoke(main, ["submit", str(tmp_path / "x.jsonl"), "-m", "tiny-org/absent@v2"])
    assert result.exit_code == 2 and "'tiny-org/absent@v2' is not in the Hugging Face cache" in result.output


def test_submit_a_hub_name_offline(offline_cache, tiny_hf_model_dir, tmp_path):
    """The CLI, in a fresh process whose environment alone makes it offline, runs a cached Hub model:
    the same outputs as the directory itself, and the manifest names the repo and the commit."""
    from jobrunner import generate
    src = tiny_hf_model_dir("qwen2")
    populate_hf_cache(offline_cache, "tiny-org/tiny-qwen2", src, COMMIT)
    rows = [{"id": str(i), "prompt": p} for i, p in enumerate(["The quick brown fox", "Numbers 0123"])]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    options = ["--no-chat", "--max-tokens", "8", "--kv-cache-memory", "4MB"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "jobrunner.cli.main", "submit", str(data), "-m", "tiny-org/tiny-qwen2",
                           "-o", str(tmp_path / "out"), *options], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["hub"] == {"repo": "tiny-org/tiny-qwen2", "revision": "main", "commit": COMMIT}
    assert manifest["model_source"].startswith("tiny-org/tiny-qwen2 (")

    import polars as pl
    from jobrunner.output import read_results
    got = dict(pl.from_arrow(read_results(str(tmp_path / "out"))).select("id", "output").iter_rows())
    want = generate(rows, model=str(src), chat=False, max_tokens=8, kv_cache_memory="4MB")
    assert got == dict(want.select("id", "output").iter_rows())


def test_resume_refuses_a_moved_branch(offline_cache, tiny_hf_model_dir, tmp_path):
    """The fingerprint has the name, not the commit: a resumed job checks the commit itself."""
    import jobrunner
    from jobrunner.config.job import JobConfigError
    src = tiny_hf_model_dir("qwen2")
    populate_hf_cache(offline_cache, "tiny-org/moving", src, COMMIT)
    data = tmp_path / "rows.jsonl"
    data.write_text('{"id": "a", "prompt": "hello"}\n')
    run = dict(model="tiny-org/moving", chat=False, max_tokens=2, kv_cache_memory="4MB")
    assert jobrunner.submit(str(data), str(tmp_path / "out"), **run).exit_code == 0
    assert jobrunner.submit(str(data), str(tmp_path / "out"), **run).exit_code == 0      # same commit: resumes
    populate_hf_cache(offline_cache, "tiny-org/moving", src, OTHER)                      # main moves on
    with pytest.raises(JobConfigError, match=f"at commit {COMMIT}, but tiny-org/moving is now commit {OTHER}"):
        jobrunner.submit(str(data), str(tmp_path / "out"), **run)
    assert jobrunner.submit(str(data), str(tmp_path / "out"), overwrite=True, **run).exit_code == 0
