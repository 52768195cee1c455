"""Prefill chunks through the in-place CPU kernel (cpu_attention.c: prefill_attention_float32) against the
reference, the bits it promises, and where the torch path (kernels/attention/cpu_prefill.py) still serves."""
from __future__ import annotations

import pytest
import torch

from jobrunner.kernels.attention import attention as A
from jobrunner.kernels.attention import cpu_attention as ca
from jobrunner.kernels.attention.attention import paged_attention, paged_attention_ref
from jobrunner.kernels.attention.metadata import AttentionMetadata
from tests.attention_helpers import TOL
from tests.test_cpu_attention import Handing, lib, make_step, portable_lib  # noqa: F401 - the session fixtures

needs_kernel = pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
                                  reason="the in-place prefill is built for AVX-512 CPUs only")


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(7)


@pytest.fixture
def torch_path_calls(monkeypatch):
    """The torch path's calls in this test (the dispatch falls back to it where the kernel does not serve)."""
    calls = []
    real = A.prefill_attention_cpu
    monkeypatch.setattr(A, "prefill_attention_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


SHAPES = {  # Hq, Hk, D, block_size
    "smollm": (9, 3, 64, 16),               # 3 heads a KV head: a tile of 12 rows is 4 positions
    "gqa8-d128": (16, 2, 128, 16),          # two 64-wide column runs in the weighted sum
    "mha-d16": (4, 4, 16, 4),               # one vector a row, tiny blocks
    "mqa7-d80": (7, 1, 80, 32),             # a group of 7: tiles straddle positions; a 16-wide tail run
}
STEPS = {  # [(query_len, seq_len)]: decodes (query_len 1) first
    "fresh-prompts": ([(5, 5), (37, 37), (1, 1), (64, 64)], 0),
    "after-context": ([(20, 33), (1, 101), (40, 71), (3, 200)], 0),          # chunks after cached keys
    "with-decodes": ([(1, 50), (1, 9), (31, 31), (12, 45)], 2),
    "long": ([(300, 300), (77, 333)], 0),                                      # many panels of 32 keys
}


@needs_kernel
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_prefill_in_place_matches_reference(lib, gen, torch_path_calls, shape, step):
    Hq, Hk, D, BS = SHAPES[shape]
    seqs, nd = STEPS[step]
    q, k, v, meta = make_step(seqs, nd, Hq, Hk, D, BS, torch.float32, gen)
    meta.cpu_decode = handing = Handing(lib)
    out = paged_attention(q, k, v, meta, D ** -0.5)
    torch.testing.assert_close(out, paged_attention_ref(q, k, v, meta, D ** -0.5), **TOL[torch.float32])
    assert not torch_path_calls and not handing.errors


@needs_kernel
def test_queries_as_a_strided_view(lib, gen, torch_path_calls):
    """q as a view of a fused projection (rows not dense): decodes and chunks served, the kernel not set aside."""
    seqs, nd = STEPS["with-decodes"]
    q, k, v, meta = make_step(seqs, nd, 9, 3, 64, 16, torch.float32, gen)
    fused = torch.cat([q, torch.randn_like(q)], dim=-1)[..., :64]           # every row 128 wide, q its first half
    assert not fused.is_contiguous()
    meta.cpu_decode = handing = Handing(lib)
    out = paged_attention(fused, k, v, meta, 0.125)
    torch.testing.assert_close(out, paged_attention_ref(q, k, v, meta, 0.125), **TOL[torch.float32])
    assert not torch_path_calls and not handing.errors


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_chunks_over_a_shared_prefix(lib, gen, torch_path_calls, threads):
    """Chunks whose first block is the same physical block (a cached prefix) and chunks beside them that share
    nothing: a thread keeps the copied keys of the blocks two chunks share, and only those."""
    seqs = [(20, 60), (7, 40), (30, 30), (25, 90), (18, 18), (40, 75)]
    q, k, v, meta = make_step(seqs, 0, 9, 3, 64, 16, torch.float32, gen, share=True)
    meta.cpu_decode = Handing(lib)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_attention(q, k, v, meta, 0.125)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, paged_attention_ref(q, k, v, meta, 0.125), **TOL[torch.float32])
    assert not torch_path_calls


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_caches_widened_exactly(lib, gen, torch_path_calls, dtype):
    """bfloat16 and float16 caches: q, K and V widened exactly, float32 arithmetic, the output rounded once: within
    one unit in the last place of the float32 reference over the same (half) inputs."""
    q, k, v, meta = make_step(STEPS["after-context"][0], 0, 9, 3, 64, 16, dtype, gen)
    meta.cpu_decode = Handing(lib)
    out = paged_attention(q, k, v, meta, 0.125)
    ref = paged_attention_ref(q.float(), k.float(), v.float(), meta, 0.125)
    assert out.dtype == dtype and not torch_path_calls
    # one unit in the last place; float16's subnormals near zero have an absolute one
    ulp = dict(atol=0, rtol=2 ** -7) if dtype == torch.bfloat16 else dict(atol=2 ** -23, rtol=2 ** -10)
    torch.testing.assert_close(out.float(), ref, **ulp)


def _prefill_rows(lib, q, k, v, meta, threads=2):
    """The kernel's output for the step's prefill rows (decodes first in q are skipped)."""
    nd = meta.num_decodes
    out = torch.full_like(q, float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert ca.prefill_attention_in_place(q, k, v, meta.block_tables[nd:], meta.query_start_loc[nd:],
                                             meta.seq_lens_t[nd:], 0.125, lib, out)
    finally:
        torch.set_num_threads(before)
    return out[int(meta.query_start_loc[nd]):]


@needs_kernel
@pytest.mark.parametrize("threads", [1, 3])
def test_a_rows_bits_do_not_depend_on_chunking_batch_or_threads(lib, gen, threads):
    """A prompt of 90 tokens in one chunk, alone at 2 threads; the same prompt's last 50 tokens as a chunk after
    its first 40 (cached), beside another prompt, at 1 and 3 threads: the last 50 rows are the same bits (each
    row's sums run over panels of keys counted from its sequence's first key)."""
    Hq, Hk, D, BS = 9, 3, 64, 16
    q, k, v, meta = make_step([(90, 90)], 0, Hq, Hk, D, BS, torch.float32, gen)
    whole = _prefill_rows(lib, q, k, v, meta)[40:]
    table = meta.block_tables[0].tolist()
    other = [b + k.shape[0] for b in range(3)]                       # a second prompt in blocks of its own
    k2 = torch.cat([k, torch.randn(3, BS, Hk, D, generator=gen)])
    v2 = torch.cat([v, torch.randn(3, BS, Hk, D, generator=gen)])
    slots = [table[p // BS] * BS + p % BS for p in range(40, 90)] + [other[p // BS] * BS + p % BS for p in range(33)]
    meta2 = AttentionMetadata.build(BS, 0, [50, 33], [90, 33], slots, [table, other], "cpu")
    q2 = torch.cat([q[40:], torch.randn(33, Hq, D, generator=gen)])
    split = _prefill_rows(lib, q2, k2, v2, meta2, threads)[:50]
    assert torch.equal(split, whole)


@needs_kernel
def test_the_torch_path_serves_where_the_kernel_does_not(lib, portable_lib, gen, torch_path_calls):
    """A portable build (no AVX-512: no prefill entry), head_dim off 16, and a chunk past PREFILL_MAX_KEYS keys:
    the torch path, the same answer."""
    seqs = [(20, 30), (18, 18)]                                       # past SHORT_CHUNK: the chunk path
    for dtype, library, D in ((torch.float32, portable_lib, 32), (torch.float32, lib, 40)):
        q, k, v, meta = make_step(seqs, 0, 4, 2, D, 16, dtype, gen)
        meta.cpu_decode = Handing(library)
        out = paged_attention(q, k, v, meta, 0.2)
        torch.testing.assert_close(out.float(), paged_attention_ref(q.float(), k.float(), v.float(), meta, 0.2),
                                   **TOL[dtype])
    assert len(torch_path_calls) == 2
    assert not portable_lib.prefill and not portable_lib.covers_prefill(q, k)
    long = ca.PREFILL_MAX_KEYS + 1                                   # one query over more keys than the kernel copies
    q, k, v, meta = make_step([(1, 1), (1, long)], 1, 2, 1, 16, 256, torch.float32, gen, spare=1)
    out = torch.empty_like(q)
    assert not ca.prefill_attention_in_place(q, k, v, meta.block_tables[1:], meta.query_start_loc[1:],
                                             meta.seq_lens_t[1:], 0.25, lib, out)


@needs_kernel
def test_launcher_checks_its_arguments(lib, gen):
    q, k, v, meta = make_step([(5, 9)], 0, 4, 2, 16, 4, torch.float32, gen)
    args = (meta.block_tables, meta.query_start_loc, meta.seq_lens_t)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="int32"):
        ca.prefill_attention_in_place(q, k, v, args[0].long(), *args[1:], 0.2, lib, out)
    with pytest.raises(ValueError, match="contiguous"):
        ca.prefill_attention_in_place(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, *args, 0.2, lib, out)
    with pytest.raises(ValueError, match="starts"):
        ca.prefill_attention_in_place(q, k, v, args[0], args[1][:1], args[2], 0.2, lib, out)
