"""The batch-invariant Triton kernels (issue 61 item 4), in Triton's interpreter on CPU tensors (as
tests/test_kernels.py runs them; the `cuda` cases run on a GPU where there is one): the same row in
batches of 1, 7 and 64 gives the same bits, and for attention also as a prefill token and as a decode at
the same position, whatever chunk it came in and wherever its prefix's blocks lie; each kernel within the
usual tolerance of its torch reference; and the ordinary paths (tiles or split counts chosen by the batch)
shown to differ in bits where they do, so these tests can fail."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from jobrunner.kernels.attention.attention import AttentionMetadata, paged_attention, paged_attention_ref  # noqa: E402
from jobrunner.kernels.attention.attention_triton import choose_num_splits, paged_attention_triton  # noqa: E402
from jobrunner.kernels.attention.attention_triton_invariant import paged_attention_triton_invariant  # noqa: E402
from jobrunner.kernels.matmul.invariant_matmul_triton import invariant_config, invariant_matmul_triton  # noqa: E402
from jobrunner.kernels.norm.norm_triton import rms_norm_triton  # noqa: E402
from jobrunner.kernels.norm.norm import rms_norm_ref  # noqa: E402
from jobrunner.kernels.ops import InvariantLinear, invariant_linear  # noqa: E402

from tests.kernel_cases import device_dtype_cases  # noqa: E402

CASES = device_dtype_cases(cuda_fp32=True)
BATCHES = (1, 7, 64)
ATTN_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3),
            torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def rand(gen, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


# ----------------------------------------------------------------------------- matmul

def linear_ref(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_invariant_matmul_same_row_bits_in_any_batch(device, dtype, bias):
    """Row r of x @ W^T + b: the same bits alone, among 7 and among 64 rows (at any place in the batch);
    within the usual rounding of F.linear in float32."""
    gen = torch.Generator().manual_seed(0)
    K, N = 112, 96                                         # neither a multiple of the tiles
    x = rand(gen, 64, K, dtype=dtype, device=device)
    w, b = rand(gen, N, K, dtype=dtype, device=device), rand(gen, N, dtype=dtype, device=device) if bias else None
    full = invariant_matmul_triton(x, w, b)
    for m in BATCHES:
        for lo in {0, 64 - m}:
            assert torch.equal(invariant_matmul_triton(x[lo:lo + m], w, b), full[lo:lo + m]), (m, lo)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(full.float(), linear_ref(x, w, b), atol=tol * K ** 0.5 * 4, rtol=tol)
    y3 = invariant_matmul_triton(x[:14].view(2, 7, K), w, b)                 # [..., K] inputs
    assert y3.shape == (2, 7, N) and torch.equal(y3.view(14, N), full[:14])


def test_matmul_tiles_chosen_by_batch_change_bits():
    """What the fixed tiles avoid: a K step chosen by M (as an autotuner or cuBLAS would) sums a row in
    another order, and float32 shows it in the bits."""
    gen = torch.Generator().manual_seed(1)
    x, w = rand(gen, 64, 256), rand(gen, 64, 256)
    fixed = invariant_matmul_triton(x, w)
    small_m = dict(invariant_config(torch.float32), BLOCK_K=16)              # "tuned" for a lone row
    assert not torch.equal(invariant_matmul_triton(x[:1], w, config=small_m), fixed[:1])
    assert torch.equal(invariant_matmul_triton(x[:1], w), fixed[:1])


def test_invariant_linear_module_and_dispatch(monkeypatch):
    """kernels.ops' InvariantLinear: nn.Linear's forward over the same weight; the Triton form where
    Triton runs (CUDA, or JOBRUNNER_TRITON=1 here), F.linear elsewhere."""
    gen = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(64, 48)
    inv = InvariantLinear(lin)
    assert inv.weight is lin.weight and inv.bias is lin.bias and "batch-invariant" in repr(inv)
    x = rand(gen, 5, 64)
    monkeypatch.setenv("JOBRUNNER_TRITON", "1")
    with torch.inference_mode():
        got = inv(x)
        assert torch.equal(got, invariant_matmul_triton(x, lin.weight, lin.bias))
        torch.testing.assert_close(got, lin(x), atol=1e-5, rtol=1e-5)
        monkeypatch.setenv("JOBRUNNER_TRITON", "0")
        assert torch.equal(invariant_linear(x, lin.weight, lin.bias), F.linear(x, lin.weight, lin.bias))


# ----------------------------------------------------------------------------- rms norm

@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("H", [96, 128])
def test_rms_norm_triton_is_row_invariant(device, dtype, H):
    """One program a row, the whole row's sum of squares in that program: a row's bits alone, among 7
    and among 64 rows, with and without the fused residual add."""
    gen = torch.Generator().manual_seed(3)
    x, r, w = rand(gen, 64, H, dtype=dtype, device=device), rand(gen, 64, H, dtype=dtype, device=device), \
        rand(gen, H, dtype=dtype, device=device)
    for res in (None, r):
        full, full_res = rms_norm_triton(x, w, 1e-6, res)
        for m in BATCHES:
            for lo in {0, 64 - m}:
                out, out_res = rms_norm_triton(x[lo:lo + m], w, 1e-6, None if res is None else res[lo:lo + m])
                assert torch.equal(out, full[lo:lo + m]) and torch.equal(out_res, full_res[lo:lo + m]), (m, lo)
        ref = rms_norm_ref(x, w, 1e-6, res)[0]
        torch.testing.assert_close(full, ref, **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32
                                                 else dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16
                                                 else dict(atol=1.6e-2, rtol=1.6e-2)))


# ----------------------------------------------------------------------------- attention

HQ, HK, D, BS = 2, 1, 32, 16   # GQA (2 query heads a KV head), kept small: the interpreter runs each program
TARGET = 520                     # the row under test: 3 splits of 256 keys (256, 256, 8)
CHUNK = 12


class Seq:
    """A sequence's K/V [L, Hk, D] and queries [L, Hq, D] at every position."""

    def __init__(self, gen, length, dtype, device):
        self.k, self.v = (rand(gen, length, HK, D, dtype=dtype, device=device) for _ in range(2))
        self.q = rand(gen, length, HQ, D, dtype=dtype, device=device)


def build_step(parts, num_decodes, seed, window=None, batch_invariant=True):
    """parts: [(Seq, seq_len, query_len)], decodes first: a shuffled paged cache holding each sequence's
    first seq_len keys (placed by `seed`), the step's queries and metadata. Returns (q, k_cache, v_cache, meta)."""
    seq = parts[0][0]
    nb = sum(-(-L // BS) for _, L, _ in parts) + 5
    free = torch.randperm(nb, generator=torch.Generator().manual_seed(seed)).tolist()
    k_cache = torch.zeros(nb, BS, HK, D, dtype=seq.k.dtype, device=seq.k.device)
    v_cache = torch.zeros_like(k_cache)
    tables, slots, qs = [], [], []
    for s, L, n in parts:
        table = [free.pop() for _ in range(-(-L // BS))]
        tables.append(table)
        for p in range(L):
            k_cache[table[p // BS], p % BS], v_cache[table[p // BS], p % BS] = s.k[p], s.v[p]
        slots += [table[p // BS] * BS + p % BS for p in range(L - n, L)]
        qs.append(s.q[L - n:L])
    meta = AttentionMetadata.build(BS, num_decodes, [n for _, _, n in parts], [L for _, L, _ in parts], slots,
                                   tables, seq.k.device, window, batch_invariant=batch_invariant)
    return torch.cat(qs), k_cache, v_cache, meta


def fillers(gen, count, dtype, device, longest=40):
    lens = torch.randint(1, longest, (count,), generator=gen).tolist()
    return [(Seq(gen, L, dtype, device), L, 1) for L in lens]


def target_rows(target, dtype, device, gen, window=None, invariant=True):
    """The target's last position (TARGET - 1) run in six settings: [(name, step, the target's row)]."""
    def decode_among(n, at, extra=()):
        others = fillers(gen, n - 1, dtype, device) + list(extra)
        parts = others[:at] + [(target, TARGET, 1)] + others[at:]
        return build_step(parts, len(parts), seed=n, window=window, batch_invariant=invariant), at

    long_row = [(Seq(gen, 800, dtype, device), 800, 1)]          # the step's longest: 4 splits on the grid
    chunk8 = build_step(fillers(gen, 2, dtype, device) + [(target, TARGET, 8)], 2, seed=11, window=window,
                        batch_invariant=invariant)
    chunk12 = build_step([(target, TARGET, CHUNK)], 0, seed=12, window=window, batch_invariant=invariant)
    return [("decode alone", *decode_among(1, 0)), ("decode among 7", *decode_among(7, 3, long_row)),
            ("decode among 64", *decode_among(64, 40)),
            ("last of a chunk of 8 over 512 cached", chunk8, 2 + 7),
            ("last of a 12-token chunk, blocks placed apart", chunk12, CHUNK - 1)]


def run_invariant(step, softcap=None):
    q, k, v, meta = step
    return paged_attention_triton_invariant(q, k, v, meta, D ** -0.5, softcap=softcap)


@pytest.mark.parametrize("device,dtype", CASES)
def test_invariant_attention_same_bits_any_batch_chunk_and_cache(device, dtype):
    """The target token's output: the same bits as a decode alone, among 7 (beside an 800-key row that
    widens the grid's splits) and among 64, and as a prefill token in chunks of 8 and 12 with its prefix
    in other blocks; every token of every step within tolerance of the torch reference; and the chunk's
    other tokens as decodes at their own positions (at a split edge: 512 keys, and 513)."""
    gen = torch.Generator().manual_seed(5)
    target = Seq(gen, TARGET, dtype, device)
    outs = []
    for name, step, row in target_rows(target, dtype, device, gen):
        out = run_invariant(step)
        q, k, v, meta = step
        ref = paged_attention_ref(q.float().cpu(), k.float().cpu(), v.float().cpu(), _cpu(meta), D ** -0.5)
        torch.testing.assert_close(out.float().cpu(), ref, **ATTN_TOL[dtype], msg=name)
        outs.append((name, out[row]))
    for name, o in outs[1:]:
        assert torch.equal(o, outs[0][1]), name
    chunk = out                                                    # the last step's: the 12-token chunk
    for pos in (511, 512):                                         # 2 whole splits; 3, the last of 1 key
        alone = run_invariant(build_step([(target, pos + 1, 1)], 1, seed=3))
        assert torch.equal(alone[0], chunk[pos - (TARGET - CHUNK)]), pos


def _cpu(meta):
    if meta.block_tables.device.type == "cpu":
        return meta
    return AttentionMetadata.build(meta.block_size, meta.num_decodes, meta.query_lens, meta.seq_lens,
                                   meta.slot_mapping.cpu(), meta.block_tables.cpu().tolist(), "cpu",
                                   meta.sliding_window)


def test_ordinary_attention_differs_where_invariant_does_not():
    """What the invariant form avoids, float32: the ordinary kernels give the target token other bits as a
    decode with the split count choose_num_splits picks for its batch (1 row: 2 splits; 64 rows: 1, on a
    GPU of 8 SMs) and as a prefill token (the prefill kernel: no splits at all)."""
    gen = torch.Generator().manual_seed(6)
    target = Seq(gen, TARGET, torch.float32, "cpu")
    seen = {}
    for name, step, row in target_rows(target, torch.float32, "cpu", gen, invariant=False):
        q, k, v, meta = step
        splits = choose_num_splits(meta.num_decodes, HK, max(meta.seq_lens[:meta.num_decodes], default=1), 8)
        seen[name] = paged_attention_triton(q, k, v, meta, D ** -0.5, num_splits=splits)[row]
    names = list(seen)
    assert not all(torch.equal(seen[n], seen[names[0]]) for n in names[1:]), "the ordinary path gave one answer"
    assert not torch.equal(seen["decode alone"], seen["decode among 64"])
    assert not torch.equal(seen["decode alone"], seen["last of a 12-token chunk, blocks placed apart"])


def test_invariant_attention_window_softcap_and_dispatch(monkeypatch):
    """A sliding window (splits from the window's first key) and soft-capped scores: a decode and the same
    position in a prefill chunk agree to the bit, and match the reference; paged_attention dispatches
    there when meta.batch_invariant is set and Triton runs (JOBRUNNER_TRITON=1 on CPU tensors)."""
    gen = torch.Generator().manual_seed(7)
    target = Seq(gen, TARGET, torch.float32, "cpu")
    window, cap = 300, 20.0
    decode = build_step(fillers(gen, 3, torch.float32, "cpu") + [(target, TARGET, 1)], 4, seed=1, window=window)
    chunk = build_step([(target, TARGET, 6)], 0, seed=2, window=window)
    a, b = run_invariant(decode, softcap=cap), run_invariant(chunk, softcap=cap)
    assert torch.equal(a[3], b[5]) and torch.equal(a[3], run_invariant(
        build_step([(target, TARGET, 1)], 1, seed=4, window=window), softcap=cap)[0])
    for out, (q, k, v, meta) in ((a, decode), (b, chunk)):
        torch.testing.assert_close(out, paged_attention_ref(q, k, v, meta, D ** -0.5, softcap=cap), atol=1e-4, rtol=1e-4)
    monkeypatch.setenv("JOBRUNNER_TRITON", "1")
    q, k, v, meta = chunk
    assert torch.equal(paged_attention(q, k, v, meta, D ** -0.5, softcap=cap), b)
    meta.batch_invariant = False                                    # the ordinary Triton kernels then
    assert torch.equal(paged_attention(q, k, v, meta, D ** -0.5, softcap=cap),
                       paged_attention_triton(q, k, v, meta, D ** -0.5, softcap=cap))


def test_engine_still_refuses_cuda_naming_the_triton_kernels():
    """The engine's GPU path is not wired yet (it awaits a GPU run): --deterministic on CUDA is refused,
    and the message says the invariant Triton kernels exist; CPU passes the same check."""
    from types import SimpleNamespace

    from jobrunner.engine.config.engine_config import ConfigError, EngineConfig
    from jobrunner.engine.run.batch_invariance import check_config
    bundle = SimpleNamespace(config=SimpleNamespace(moe=None, vision=None))
    config = EngineConfig(model="dummy:llama", batch_invariant=True)
    with pytest.raises(ConfigError, match="invariant Triton kernels exist.*awaits a run on a GPU"):
        check_config(config, bundle, torch.device("cuda"), torch.bfloat16)
    check_config(config, bundle, torch.device("cpu"), torch.float32)
