"""Reading safetensors files: every tensor once, in the file's order, whole or in a rank's ranges, through a
mapping reopened every MAPPED_BYTES, so the checkpoint's pages never stay resident beside the weights built
from them (issue 62 item 3: a quantized model's peak memory follows its own bytes)."""
from __future__ import annotations

import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from jobrunner.engine.load import safetensors_weights as sw

MB = 1 << 20


@pytest.fixture
def checkpoint(tmp_path):
    """12 tensors of 4 MB (float32), each filled with its own index, and a buffer old checkpoints carry."""
    tensors = {f"layers.{i}.weight": torch.full((1024, 1024), float(i)) for i in range(12)}
    tensors["rotary_emb.inv_freq"] = torch.ones(8)
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    return path


def opens(monkeypatch) -> list:
    """Counts safe_open's calls (the loader imports it when it reads)."""
    import safetensors
    calls, real = [], safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    return calls


def test_every_tensor_once_in_order_across_reopened_mappings(checkpoint, monkeypatch):
    with safe_open(checkpoint, framework="pt") as st:
        want = [n for n in st.keys() if not n.endswith("inv_freq")]
    monkeypatch.setattr(sw, "MAPPED_BYTES", 10 * MB)
    calls = opens(monkeypatch)
    got = list(sw.safetensors_weights([checkpoint])())
    assert [n for n, _ in got] == want
    assert all(torch.equal(t, torch.full((1024, 1024), float(n.split(".")[1]))) for n, t in got)
    assert len(calls) == 4      # 12 tensors of 4 MB, a mapping closed once 10 MB have been read through it


def test_a_ranks_ranges_and_the_tensors_it_skips(checkpoint, monkeypatch):
    monkeypatch.setattr(sw, "MAPPED_BYTES", 5 * MB)

    def select(name, shape):
        i = int(name.split(".")[1])
        return None if i == 0 else (0, [(2, 3)]) if i % 2 else (1, [])   # whole; rows 2-4; none (skipped)
    got = dict(sw.safetensors_weights([checkpoint])(select))
    assert set(got) == {f"layers.{i}.weight" for i in (0, 1, 3, 5, 7, 9, 11)}
    assert got["layers.0.weight"].shape == (1024, 1024) and got["layers.3.weight"].shape == (3, 1024)
    assert torch.equal(got["layers.3.weight"], torch.full((3, 1024), 3.0))


def _rss_file_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("mapped", [8 * MB, 1 << 40])
def test_pages_read_are_not_kept_resident(checkpoint, monkeypatch, mapped):
    """Each tensor read, touched and dropped, as a loader does converting it: through mappings of 8 MB the
    file's 48 MB never stay resident together; through one mapping (the old reading) they do, so this can fail."""
    monkeypatch.setattr(sw, "MAPPED_BYTES", mapped)
    before, peak = _rss_file_kb(), 0
    for _, tensor in sw.safetensors_weights([checkpoint])():
        tensor.sum()
        del tensor
        peak = max(peak, _rss_file_kb() - before)
    if mapped < 48 * MB:
        assert peak < 24 * 1024, f"{peak} kB of the file resident at once"
    else:
        assert peak > 40 * 1024, f"only {peak} kB resident through one mapping: this test measures nothing here"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_gguf_mappings_pages_are_dropped_once_copied(tmp_path):
    """engine.load.gguf.drop_pages, as GGUF loading calls it after each tensor is dequantized or its blocks copied:
    the pages leave the process's resident set, and the data reads back unchanged (faulted in again from the
    file)."""
    import numpy as np

    from jobrunner.engine.load.gguf import drop_pages
    path = tmp_path / "blocks.bin"
    want = np.random.default_rng(0).integers(0, 255, 48 * MB + 123, dtype=np.uint8)
    want.tofile(path)
    mapped = np.memmap(path, mode="c").view(np.ndarray)        # as GGUFFile's reader holds it
    view = mapped[100:40 * MB + 7]                              # starts and ends inside a page
    before = _rss_file_kb()
    assert int(view.sum()) > 0 and _rss_file_kb() - before > 36 * 1024
    drop_pages(view)
    assert _rss_file_kb() - before < 4 * 1024
    assert np.array_equal(mapped, want)
    drop_pages(np.arange(10))                                   # not on a mapping: nothing to drop
