"""The batch-invariant forms of the CPU ops (engine/run/batch_invariance.py), op by op: a row's bits do not
depend on the rows beside it, the thread count, or (attention) how its sequence's tokens were chunked.
tests/test_determinism.py runs whole jobs under many schedules."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jobrunner.engine.run import cpu_decode as cd
from jobrunner.engine.sample.sampler import SampleRow, sample
from jobrunner.engine.api.request import SamplingParams
from jobrunner.kernels.attention import cpu_attention as ca
from jobrunner.kernels.attention.attention import AttentionMetadata, paged_attention
from jobrunner.kernels.matmul import cpu_linear
from jobrunner.kernels.ops import pack_linear, packing_available

THREADS = (1, 2)


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ca.DecodeLibrary:
    path = tmp_path_factory.mktemp("kernel") / ca.library_name()
    cd.build_library(path)
    return ca.DecodeLibrary(path)


class Handing:
    def __init__(self, library):
        self.lib = library

    def library(self):
        return self.lib

    def set_aside(self, error):
        raise error


def at_threads(n, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


# ---- linears --------------------------------------------------------------------------------------------

@pytest.mark.skipif(not packing_available(), reason="no oneDNN in this torch")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (2048, 512), (64, 96)])
def test_invariant_packed_linear_gives_each_row_its_bits_at_every_batch_size(shape, dtype):
    """Each row's product is the same bits alone, at 2 to 130 rows a call and at 1 or 2 threads. (The lone
    row of the default form takes oneDNN's matrix-vector path, which sums otherwise where K is large.)"""
    torch.manual_seed(0)
    linear = torch.nn.Linear(*shape, bias=True).to(dtype)
    packed = pack_linear(linear, batch_invariant=True)      # its check at packing passes
    x = torch.randn(130, shape[0]).to(dtype)
    with torch.inference_mode():
        want = torch.cat([packed(x[i:i + 1]) for i in range(x.shape[0])])
        for n in THREADS:
            for m in (1, 2, 3, 7, 64, 129, 130):
                assert torch.equal(at_threads(n, lambda: packed(x[:m])), want[:m]), (n, m)
            assert torch.equal(at_threads(n, lambda: packed(x[5:42])), want[5:42])


@pytest.mark.skipif(not packing_available(), reason="no oneDNN in this torch")
def test_the_default_lone_row_differs_where_k_is_large():
    """Why min_rows is 2: alone, a row's product is not the bits it gets beside another row (K = 1536)."""
    torch.manual_seed(0)
    packed = pack_linear(torch.nn.Linear(1536, 576, bias=False))
    x = torch.randn(2, 1536)
    with torch.inference_mode():
        assert not torch.equal(packed(x[:1])[0], packed(x)[0])


def test_a_linear_whose_rows_follow_the_batch_is_refused(monkeypatch):
    torch.manual_seed(0)
    packed = pack_linear(torch.nn.Linear(64, 32), check=False, batch_invariant=True)
    real = packed._linear
    monkeypatch.setattr(packed, "_linear", lambda x: real(x) + 1e-3 * (x.shape[0] > 64))
    with pytest.raises(ValueError, match="depends on the rows beside it"):
        cpu_linear.check_row_invariant(packed)


# ---- per-row torch ops -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,op,width", [
    ("rms_norm", lambda x: F.rms_norm(x, (x.shape[1],), None, 1e-6), 576),
    ("log_softmax", lambda x: torch.log_softmax(x, -1), 49152),
    ("logsumexp", lambda x: torch.logsumexp(x, -1), 49152),
    ("softmax", lambda x: torch.softmax(x, -1), 49152),
    ("cumsum", lambda x: x.double().cumsum(-1), 49152),
    ("silu", lambda x: F.silu(x), 1536),
])
def test_per_row_ops_do_not_split_a_row_between_threads(name, op, width):
    """The norms, softmaxes and scans the forward and the sampler use: a row alone at 1 or 2 threads, or
    among 256 rows, has the same bits (torch's CPU kernels split rows, not a row's sum)."""
    x = torch.randn(256, width, generator=torch.Generator().manual_seed(3))
    want = op(x)
    for n in THREADS:
        assert torch.equal(at_threads(n, lambda: op(x[:1])), want[:1]), n
        assert torch.equal(at_threads(n, lambda: op(x[7:9])), want[7:9]), n


def test_a_seeded_row_draws_the_same_token_alone_or_in_any_batch():
    """Each sampled row's uniform comes from its own seed and position (draw_uniform), never a shared stream."""
    logits = torch.randn(6, 320, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7)
    from jobrunner.engine.sample.sampler import draw_uniform
    rows = [SampleRow(i, params, draw_uniform(7, 0, 10 + i)) for i in range(6)]
    together, _ = sample(logits, rows)
    alone = [sample(logits[i:i + 1], [SampleRow(0, params, rows[i].uniform)])[0][0] for i in range(6)]
    reversed_, _ = sample(logits.flip(0), [SampleRow(5 - i, params, rows[i].uniform) for i in range(6)][::-1])
    assert together == alone == reversed_[::-1]


# ---- attention -------------------------------------------------------------------------------------------

def _pool(length, nb, bs, hk, d, gen):
    """A shuffled pool holding one sequence of `length` keys: (k, v, its block table)."""
    table = torch.randperm(nb, generator=gen)[:-(-length // bs)].tolist()
    return torch.randn(nb, bs, hk, d, generator=gen), torch.randn(nb, bs, hk, d, generator=gen), table


def _attend(lib, q, k, v, table, steps, bs, invariant, window=None, softcap=None):
    """The sequence's queries q [L, Hq, D] computed in `steps` (query lengths, in order): one output row per
    position. A one-token step is a decode; the others prefill chunks after the keys before them."""
    out, done = [], 0
    for n in steps:
        slots = [table[p // bs] * bs + p % bs for p in range(done, done + n)]
        meta = AttentionMetadata.build(bs, int(n == 1), [n], [done + n], slots, [table], "cpu", window,
                                       cpu_decode=Handing(lib), batch_invariant=invariant)
        out.append(paged_attention(q[done:done + n].contiguous(), k, v, meta, 0.25, sliding=True, softcap=softcap))
        done += n
    return torch.cat(out)


@pytest.mark.parametrize("window,softcap", [(None, None), (100, None), (None, 5.0)], ids=["full", "window", "softcap"])
def test_invariant_attention_gives_a_token_its_bits_however_its_sequence_is_chunked(lib, window, softcap):
    """One 600-token sequence (three splits of 256 keys) as one prefill, as uneven chunks (a cached prefix
    then the rest), and as a prompt then decodes: every position's output is the same bits. The default
    path differs between a prompt and its decodes; between chunkings of a prompt too where flash attention
    serves (merged by logsumexp over a cached context), not where the in-place prefill does (its panels of
    keys count from the sequence's first key)."""
    gen = torch.Generator().manual_seed(5)
    bs, hq, hk, d, L = 16, 6, 2, 32, 600
    k, v, table = _pool(L, 64, bs, hk, d, gen)
    q = torch.randn(L, hq, d, generator=gen)
    schedules = [[L], [37, 219, 300, 44], [520] + [1] * 80, [256, 256, 88]]
    outs = [_attend(lib, q, k, v, table, s, bs, True, window, softcap) for s in schedules]
    for s, o in zip(schedules[1:], outs[1:]):
        assert torch.equal(o, outs[0]), s
    assert torch.equal(at_threads(1, lambda: _attend(lib, q, k, v, table, schedules[1], bs, True, window, softcap)),
                       outs[0])
    if window is None and softcap is None:
        default = [_attend(lib, q, k, v, table, s, bs, False) for s in schedules[:3]]
        torch.testing.assert_close(default[0], outs[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(default[0], default[1]) == bool(lib.prefill)
        assert not torch.equal(default[0], default[2])


def test_invariant_decode_rows_have_their_bits_in_batches_of_1_7_and_64(lib):
    """A decode row of 3000 keys alone and beside 6 or 63 others (short and long) at 1 and 2 threads: the
    same bits with fixed splits; the default split, chosen from the batch, gives other bits."""
    gen = torch.Generator().manual_seed(6)
    bs, hq, hk, d, nb = 16, 8, 2, 64, 2048
    k, v = torch.randn(nb, bs, hk, d, generator=gen), torch.randn(nb, bs, hk, d, generator=gen)
    lens = [3000] + torch.randint(1, 3000, (63,), generator=gen).tolist()
    tables = torch.randint(0, nb, (64, -(-3000 // bs)), generator=gen, dtype=torch.int32)
    q = torch.randn(64, hq, d, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)

    def run(b, split, threads=2):
        return at_threads(threads, lambda: ca.decode_attention_cpu(q[:b].contiguous(), k, v, tables[:b], seq_lens[:b],
                                                                   0.125, None, None, lib, split=split))[0]
    want = run(1, ca.INVARIANT_SPLIT)
    for b in (1, 7, 64):
        for n in THREADS:
            assert torch.equal(run(b, ca.INVARIANT_SPLIT, n), want), (b, n)
    assert not torch.equal(run(1, 0), run(64, 0))
    with pytest.raises(ValueError, match="split"):
        run(1, ca.SPLIT_MAX + 1)
