"""The in-place CPU decode attention (kernels/cpu_attention.py) against the gather reference, and the
engine's side of it (engine/cpu_decode.py: packages' paths, the build policy, its child and lock).

Fast tests run the kernel's function eagerly (FlexAttention's math path over tiny pools) and check the
block mask's lists on their own, since eager flex evaluates the mask everywhere and would not notice a
wrong block list; the compiled package (a minute to build) is checked by the `slow` test.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from engine import cpu_decode as cd
from kernels import cpu_attention as ca
from tests.attention_helpers import TOL, paged_tensors
from kernels.attention import paged_attention, paged_attention_ref


def make_step(seqs, num_decodes, Hq, Hk, D, BS, dtype, gen, window=None, spare=3, share=False):
    """seqs: [(query_len, seq_len)], decodes first; a shuffled pool with `spare` blocks nobody uses.
    share: every sequence's first block is the same physical block (a shared prefix)."""
    need = [(L + BS - 1) // BS for _, L in seqs]
    nb = sum(need) + spare
    free = torch.randperm(nb, generator=gen).tolist()
    common = free.pop()
    tables = [[common] + [free.pop() for _ in range(n - 1)] if share else [free.pop() for _ in range(n)]
              for n in need]
    return paged_tensors(seqs, num_decodes, tables, nb, Hq, Hk, D, BS, gen, dtype, window)


def eager_runner(args, softcap=None):
    """A package's runner, evaluated eagerly: the function build() traces, plus the block lists as a mask
    term (eager flex ignores them), so it computes what the compiled kernel computes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ca.decode_flex(*args, softcap=softcap, listed=ca.listed_blocks(*args[3:7]))


class Handing:
    """A CpuDecode that hands out one runner for every key, and records what the dispatch tells it."""

    def __init__(self, runner):
        self.run, self.set_aside_keys, self.gathered = runner, [], []

    def runner(self, key):
        return self.run

    def set_aside(self, key, error):
        self.set_aside_keys.append(key)

    def note_gather(self, key, seconds):
        self.gathered.append(key)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(20)


SHAPES = [  # Hq, Hk, D, block_size, seq_lens of the decode rows
    (2, 2, 16, 4, [1, 7, 33]),             # MHA, a length-1 context, tiny blocks
    (6, 2, 40, 16, [50, 17, 16, 32]),      # GQA 3, head_dim not a power of two, lengths on block edges
    (9, 3, 64, 16, [130, 3, 64, 1]),       # SmolLM2's heads
    (5, 1, 24, 8, [9, 8, 23]),             # MQA, odd group
]


CASES = [  # shape, dtype, window, softcap (eager flex costs about a second a case: a sample of the grid)
    (0, torch.float32, None, None), (1, torch.float32, 11, None), (2, torch.float32, None, 3.0),
    (3, torch.float32, 5, 7.0), (2, torch.bfloat16, 40, None), (1, torch.bfloat16, None, None),
]


@pytest.mark.parametrize("shape,dtype,window,softcap", [(SHAPES[i], *c) for i, *c in CASES],
                         ids=["mha", "gqa3-d40-window", "smollm-softcap", "mqa5-window-softcap", "smollm-bf16-window",
                              "gqa3-d40-bf16"])
def test_decode_matches_reference(dtype, shape, window, softcap, gen):
    Hq, Hk, D, BS, lens = shape
    q, k, v, meta = make_step([(1, L) for L in lens], len(lens), Hq, Hk, D, BS, dtype, gen, window)
    mask = meta.decode_mask(k.shape[0], window)
    out = ca.decode_attention_cpu(q, k, v, mask, 0.3, softcap, lambda a: eager_runner(a, softcap))
    ref = paged_attention_ref(q.float(), k.float(), v.float(), meta, 0.3, softcap=softcap)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


@pytest.mark.parametrize("window", [None, 1, 5, 16, 40])
@pytest.mark.parametrize("share", [False, True], ids=["own-blocks", "shared-prefix"])
def test_block_lists_cover_exactly_the_visible_slots(window, share, gen):
    """Full blocks: every slot visible; partial blocks: some; no other block of the pool is read."""
    BS, lens = 8, [1, 8, 9, 23, 40, 17]
    _, k, _, meta = make_step([(1, L) for L in lens], len(lens), 2, 1, 8, BS, torch.float32, gen, window,
                              share=share)
    nb = k.shape[0]
    m = meta.decode_mask(nb, window)
    for b, L in enumerate(lens):
        table = meta.block_tables[b].tolist()
        lo = max(0, L - window) if window else 0
        visible = {table[p // BS] * BS + p % BS for p in range(lo, L)}
        full = m.full_idx[b, 0, 0, :int(m.full_num[b])].tolist()
        part = m.part_idx[b, 0, 0, :int(m.part_num[b])].tolist()
        assert len(set(full + part)) == len(full) + len(part)
        assert all(blk * BS + o in visible for blk in full for o in range(BS))
        assert all(any(blk * BS + o in visible for o in range(BS)) for blk in part)
        assert all(any(blk * BS + o in visible for o in range(BS)) is False or blk in full + part
                   for blk in range(nb))
        assert all(s // BS in full + part for s in visible)


def test_block_at_two_positions_falls_back(gen):
    """A physical block at two logical positions can't be addressed by the mask: no DecodeMask."""
    tables = torch.tensor([[3, 1], [1, 2]], dtype=torch.int32)
    assert ca.DecodeMask.build(tables, torch.tensor([8, 8]), 4, 5, None) is None


@pytest.mark.parametrize("int8", [False, True], ids=["float-cache", "int8-cache"])
def test_dispatch_mixed_step(int8, gen):
    """Decodes through the (eager) kernel, prefill chunks gathered; int8 caches stay on the reference."""
    from kernels.kv_int8 import paged_attention_int8_ref, quantize_int8_ref
    seqs = [(1, 21), (1, 90), (7, 7), (12, 35)]
    q, k, v, meta = make_step(seqs, 2, 6, 3, 32, 16, torch.float32, gen, window=30)
    meta.cpu_decode = handing = Handing(eager_runner)
    if int8:
        (kq, ks), (vq, vs) = quantize_int8_ref(k), quantize_int8_ref(v)
        out = paged_attention(q, kq, vq, meta, 0.2, ks, vs)
        ref = paged_attention_int8_ref(q, kq, vq, ks, vs, meta, 0.2)
    else:
        out = paged_attention(q, k, v, meta, 0.2)
        ref = paged_attention_ref(q, k, v, meta, 0.2)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    assert not handing.gathered and not handing.set_aside_keys


def test_a_failing_package_is_set_aside_and_the_reference_serves(gen):
    q, k, v, meta = make_step([(1, 9), (1, 20)], 2, 2, 1, 8, 4, torch.float32, gen)

    def broken(args):
        raise RuntimeError("a package from another build")
    meta.cpu_decode = handing = Handing(broken)
    torch.testing.assert_close(paged_attention(q, k, v, meta, 0.5), paged_attention_ref(q, k, v, meta, 0.5))
    key = ca.decode_key(q, k, None)
    assert handing.set_aside_keys == [key] and handing.gathered == [key]


def test_gather_mode_hands_out_no_package(monkeypatch, tmp_path):
    """JOBRUNNER_CPU_DECODE=gather: the engine's side never hands out a package, loaded or on disk."""
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    monkeypatch.setenv("JOBRUNNER_CPU_DECODE", "gather")
    kernels = cd.DecodeKernels()
    key = ca.DecodeKey("float32", 1, 2, 8, 4, 0.0)
    kernels.runners[key] = eager_runner
    assert kernels.runner(key) is None


@pytest.mark.parametrize("mode", ["auto", "flex"])
def test_bfloat16_caches_gather_even_with_a_package_at_hand(monkeypatch, tmp_path, caplog, mode):
    """The gather path decodes bfloat16 faster than the package (RESULTS.md): none is loaded, built or suggested."""
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    monkeypatch.setenv("JOBRUNNER_CPU_DECODE", mode)
    kernels = cd.DecodeKernels()
    key = ca.DecodeKey("bfloat16", 1, 2, 8, 4, 0.0)
    kernels.runners[key] = eager_runner
    monkeypatch.setattr(cd, "build_package", lambda *a: pytest.fail("built a bfloat16 package"))
    with caplog.at_level("INFO", logger="jobrunner"):
        assert kernels.runner(key) is None
        kernels.note_gather(key, 1e9)
    assert not kernels.children and "warmup" not in caplog.text
    float32 = ca.DecodeKey("float32", 1, 2, 8, 4, 0.0)
    kernels.runners[float32] = eager_runner
    assert kernels.runner(float32) is eager_runner           # float32 caches still take theirs


def test_packages_live_under_the_one_cache_root(monkeypatch, tmp_path):
    from engine.config import cache_root
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    path = cd.package_path(ca.DecodeKey("float32", 3, 3, 64, 16, 0.0))
    assert path.is_relative_to(cache_root() / "kernels") and path.name.startswith("decode-v")


def test_build_starts_once_past_the_threshold(monkeypatch, tmp_path, gen):
    """auto with a threshold (opt-in: the default is never): the gather path's decode seconds are counted;
    past it one child (nice 19) builds."""
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    monkeypatch.setenv("JOBRUNNER_CPU_DECODE", "auto")
    monkeypatch.setenv("JOBRUNNER_CPU_DECODE_BUILD_AFTER", "3")
    after = 3.0
    started = []

    class FakePopen:
        pid = os.getpid()        # alive: the lock reads as held

        def __init__(self, args, **kw):
            started.append((args, kw))

        def poll(self):
            return None

    monkeypatch.setattr(cd.subprocess, "Popen", FakePopen)
    kernels = cd.DecodeKernels()
    key = ca.DecodeKey("float32", 1, 2, 8, 4, 0.0)
    kernels.note_gather(key, after / 2)
    assert not started
    kernels.note_gather(key, after)
    kernels.note_gather(key, after)
    assert len(started) == 1
    args, kw = started[0]
    assert args[1:4] == ["-m", "engine.cpu_decode", "build"] and kw["start_new_session"]
    assert kernels.runner(key) is None                    # nothing built yet: the reference serves
    other = cd.DecodeKernels()                            # another process sees the lock and doesn't build
    other.note_gather(key, 2 * after)
    assert len(started) == 1


def test_mode_rejects_unknown(monkeypatch):
    monkeypatch.setenv("JOBRUNNER_CPU_DECODE", "fast")
    with pytest.raises(ValueError, match="JOBRUNNER_CPU_DECODE"):
        cd.decode_mode()


@pytest.mark.slow
@pytest.mark.parametrize("softcap", [None, 4.0], ids=["plain", "softcap"])
def test_built_package_matches_reference(monkeypatch, tmp_path, softcap, gen):
    """The AOTInductor package (built here: about a minute) over varying batch, pool size and window."""
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    key = ca.DecodeKey("float32", 2, 3, 40, 8, softcap or 0.0)
    path = cd.package_path(key)
    cd.build_package(key, path)
    runner = ca.load_decode_package(path)
    for lens, window, spare in [([1], None, 1), ([5, 70, 8, 16, 33], None, 9), ([44, 3, 200], 19, 40)]:
        q, k, v, meta = make_step([(1, L) for L in lens], len(lens), 6, 2, 40, 8, torch.float32, gen, window,
                                  spare=spare, share=True)
        out = ca.decode_attention_cpu(q, k, v, meta.decode_mask(k.shape[0], window), 0.25, softcap, runner)
        ref = paged_attention_ref(q, k, v, meta, 0.25, softcap=softcap)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_tiny_model_greedy_same_on_both_paths():
    """A tiny random Llama (GQA 2) stepped through prefill chunks, mixed steps and decodes: the same greedy
    tokens with decodes gathered and with decodes through the in-place kernel (eagerly)."""
    from tests.tiny import step_tiny_llama
    plan = [[(0, 4)], [(0, 3), (1, 5)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(1, 1)]]
    assert step_tiny_llama(plan, Handing(eager_runner)) == step_tiny_llama(plan)
