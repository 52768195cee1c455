"""`jobrunner submit -m ./llama-W4A16` as a new user runs it: the job runs, and the scheme is named in
validate, the manifest and _stats.json; what cannot run stops before any work with exit 2."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli_helpers import jsonl, submit
from jobrunner.cli.main import main

pytest.importorskip("compressed_tensors")
from quantized_checkpoints import make_compressed  # noqa: E402

ROWS = [{"id": str(i), "prompt": p} for i, p in enumerate(["the cat sat", "numbers: 1 2 3", "hello there"])]


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory):
    return make_compressed(tmp_path_factory.mktemp("ckpt") / "llama-W4A16", "llama", "W4A16")


def test_submit_runs_a_compressed_checkpoint_and_names_its_scheme(w4a16, tmp_path):
    ds = jsonl(tmp_path / "prompts.jsonl", ROWS)
    r, rows = submit(tmp_path, ds, "-m", str(w4a16), "--max-tokens", "4", "--no-chat")
    assert r.exit_code == 0, r.output
    assert len(rows) == 3 and all(row["error"] is None for row in rows)
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    scheme = "compressed-tensors: int4 g128"
    assert manifest["quantization"] == scheme
    assert manifest["config"]["checkpoint_quantization"] == scheme          # in the resume fingerprint
    assert json.loads((tmp_path / "out" / "_stats.json").read_text())["quantization"] == scheme
    v = CliRunner().invoke(main, ["validate", ds, "-m", str(w4a16), "--no-chat"])
    assert v.exit_code == 0 and scheme in v.output


def test_quantization_on_a_quantized_checkpoint_exits_2(w4a16, tmp_path):
    ds = jsonl(tmp_path / "prompts.jsonl", ROWS)
    r, _ = submit(tmp_path, ds, "-m", str(w4a16), "--quantization", "int4")
    assert r.exit_code == 2 and "quantized already" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "out").exists()          # stopped before any work


def test_an_unsupported_scheme_exits_2_naming_it(w4a16, tmp_path):
    import shutil
    other = tmp_path / "bnb"
    shutil.copytree(w4a16, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (other / "config.json").write_text(json.dumps(cfg))
    ds = jsonl(tmp_path / "prompts.jsonl", ROWS)
    r, _ = submit(tmp_path, ds, "-m", str(other))
    assert r.exit_code == 2 and "bitsandbytes" in r.output and "Traceback" not in r.output
