"""The result cache's parts: keys (what they depend on), the store (lookups through a bounded index,
newest entry wins, concurrent writer processes), and `jobrunner cache stats | prune`."""
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobrunner.engine.api.request import Request, SamplingParams
from jobrunner.cache.identity import checkpoint_identity
from jobrunner.cache.key import is_deterministic, model_key, request_key
from jobrunner.cache.store import CacheStore

NUMERIC = {"dtype": "torch.float32", "kv_dtype": "torch.float32", "kv_cache_dtype": "auto", "quantization": "none",
           "device": "cpu", "torch": "2.13"}


def _key(model=b"m" * 16, kind="generate", **req):
    req = {"id": "row-1", "prompt_token_ids": [1, 2, 3], **req}
    return request_key(model, kind, Request(**req))


def test_the_key_depends_on_what_decides_the_result_and_nothing_else():
    base = _key()
    assert _key(id="another-row", prompt="text kept for the output") == base
    for changed in (_key(model=b"n" * 16), _key(kind="score"), _key(prompt_token_ids=[1, 2, 4]),
                    _key(sampling=SamplingParams(temperature=0.5, seed=1)),
                    _key(sampling=SamplingParams(temperature=0.5, seed=2)),
                    _key(sampling=SamplingParams(max_tokens=3)), _key(candidates=[[5], [6]]),
                    _key(candidates=[[5], [7]]), _key(score_from=2)):
        assert changed != base
    assert model_key({"files": {}}, NUMERIC) != model_key({"files": {}}, {**NUMERIC, "quantization": "int8"})
    assert model_key({"files": {}}, NUMERIC) != model_key({"files": {}}, {**NUMERIC, "kv_cache_dtype": "int8"})
    assert is_deterministic(Request("a", [1])) and is_deterministic(Request("a", [1], candidates=[[2]]))
    assert is_deterministic(Request("a", [1], SamplingParams(temperature=1.0, seed=0)))
    assert not is_deterministic(Request("a", [1], SamplingParams(temperature=1.0)))


def test_a_new_request_field_is_keyed_without_changing_the_key_code():
    """Issue 17's constraint will be one more Request field: request_key covers it as it is."""
    from dataclasses import dataclass, field

    @dataclass
    class ConstrainedRequest(Request):
        constraint: dict | None = field(default=None)

    a = request_key(b"m" * 16, "generate", ConstrainedRequest("r", [1, 2], constraint={"json_schema": {"type": "object"}}))
    b = request_key(b"m" * 16, "generate", ConstrainedRequest("r", [1, 2], constraint={"regex": "[0-9]+"}))
    assert a != b != request_key(b"m" * 16, "generate", ConstrainedRequest("r", [1, 2]))


def test_the_checkpoint_identity_follows_its_content(tiny_hf_model_dir, tmp_path):
    src = tiny_hf_model_dir("llama")
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    assert checkpoint_identity(str(copy)) == checkpoint_identity(str(src))      # a copy elsewhere: the same
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01                                    # one weight's low bits, same size and header
    weights.write_bytes(bytes(data))
    assert checkpoint_identity(str(copy)) != checkpoint_identity(str(src))


def test_a_large_checkpoint_is_identified_by_header_and_samples(tmp_path, monkeypatch):
    from jobrunner.cache import identity
    monkeypatch.setattr(identity, "FULL_HASH_BYTES", 1000)
    monkeypatch.setattr(identity, "SAMPLE_BYTES", 64)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 40)
    first = checkpoint_identity(str(path))
    path.write_bytes(b"GGUF" + bytes(range(256)) * 39 + bytes(255) + b"\x01")     # the last byte differs
    assert checkpoint_identity(str(path)) != first
    assert checkpoint_identity("dummy:smollm2-135m") != checkpoint_identity("dummy:llama-3.1-8b")


def _entries(n: int, salt: bytes = b"") -> dict[bytes, bytes]:
    import hashlib
    return {hashlib.blake2b(salt + i.to_bytes(4, "little"), digest_size=16).digest(): b"v%d" % i + salt
            for i in range(n)}


def test_lookups_through_a_small_index_budget_find_every_entry(tmp_path):
    url = str(tmp_path / "c")
    w = CacheStore(url, flush_entries=700)
    entries = _entries(3000)
    for k, v in entries.items():
        w.put(k, v)
    w.flush()
    r = CacheStore(url, max_index_bytes=4096)           # a few buckets' keys at a time
    misses = list(_entries(200, b"absent"))
    found = r.get_many(list(entries) + misses)
    assert found == entries
    assert sum(i.nbytes for i in r._index.values()) <= 4096 + max(i.nbytes for i in r._index.values())


def test_the_newest_entry_of_a_key_wins(tmp_path):
    url = str(tmp_path / "c")
    key = b"k" * 16
    for value in (b"old", b"new"):
        w = CacheStore(url)
        w.put(key, value)
        w.flush()
    assert CacheStore(url).get_many([key]) == {key: b"new"}


WRITER = """
import hashlib, sys
from jobrunner.cache.store import CacheStore
def _entries(n, salt=b""):
    return {hashlib.blake2b(salt + i.to_bytes(4, "little"), digest_size=16).digest(): b"v%d" % i + salt
            for i in range(n)}
url, salt = sys.argv[1], sys.argv[2].encode()
store = CacheStore(url, flush_entries=250)
for k, v in {**_entries(800, salt), **_entries(200, b"shared")}.items():
    store.put(k, v)
store.flush()
"""


def test_two_writer_processes_lose_and_tear_nothing(tmp_path):
    url = str(tmp_path / "c")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, url, salt], env=env) for salt in ("a", "b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    want = {**_entries(800, b"a"), **_entries(800, b"b"), **_entries(200, b"shared")}
    assert CacheStore(url).get_many(list(want)) == want
    names = [n for _, _, files in os.walk(url) for n in files]
    assert not [n for n in names if n.startswith("_tmp-")]


def test_cache_stats_and_prune_commands(tmp_path):
    from jobrunner.cache.maintenance import parse_duration, prune
    from jobrunner.cli.main import main
    url = str(tmp_path / "c")
    w = CacheStore(url)
    for k, v in _entries(50).items():
        w.put(k, v)
    w.flush()
    r = CliRunner().invoke(main, ["cache", "stats", url, "--json"])
    assert r.exit_code == 0, r.output
    import json
    s = json.loads(r.output)
    assert s["entries"] == 50 and s["shards"] == s["buckets"] > 1 and s["unreadable_shards"] == 0
    r = CliRunner().invoke(main, ["cache", "prune", url, "--older-than", "30d"])
    assert r.exit_code == 0 and "shards_removed       0" in r.output
    assert prune(url, older_than_s=3600, now=__import__("time").time() + 7200)["shards_left"] == 0
    assert CacheStore(url).get_many(list(_entries(50))) == {}
    for bad in (["--older-than", "soon"], ["--max-size", "lots"], []):
        assert CliRunner().invoke(main, ["cache", "prune", url, *bad]).exit_code == 2
    assert parse_duration("2w") == 14 * 86400 and parse_duration("90m") == 5400


def test_prune_to_a_size_drops_the_oldest_shards_first(tmp_path):
    from jobrunner.cache.maintenance import cache_stats, prune
    url = str(tmp_path / "c")
    old, new = b"\x01" + b"o" * 15, b"\x01" + b"n" * 15        # one bucket: two shards, oldest first
    for key in (old, new):
        w = CacheStore(url)
        w.put(key, os.urandom(2000))
        w.flush()
    size = cache_stats(url)["bytes"]
    out = prune(url, max_size=size - 1)
    assert out["shards_removed"] == 1 and out["shards_left"] == 1
    assert list(CacheStore(url).get_many([old, new])) == [new]
