"""The in-place CPU decode attention (kernels/attention/cpu_attention.py and .c) against the gather reference, and the
engine's side of it (engine/run/cpu_decode.py: where the library is kept, its build, the modes, the fallbacks).

The kernel is compiled here for real (about a second) once per session; each case compares it with
paged_attention_ref over the same inputs in float32.
"""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jobrunner.engine.run import cpu_decode as cd
from jobrunner.kernels.attention import cpu_attention as ca
from jobrunner.kernels.attention.attention import paged_attention, paged_attention_ref
from tests.attention_helpers import TOL, paged_tensors

KERNEL_TOL = {**TOL, torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.fixture(scope="session")
def lib(tmp_path_factory) -> ca.DecodeLibrary:
    path = tmp_path_factory.mktemp("kernel") / ca.library_name()
    cd.build_library(path)
    return ca.DecodeLibrary(path)


@pytest.fixture(scope="session")
def portable_lib(tmp_path_factory) -> ca.DecodeLibrary:
    """The same source built without AVX-512: its portable loops, whatever this CPU has."""
    path = tmp_path_factory.mktemp("portable") / ca.library_name()
    flags = ca.CFLAGS
    ca.CFLAGS = flags + ("-mno-avx512f",)
    try:
        cd.build_library(path)
    finally:
        ca.CFLAGS = flags
    return ca.DecodeLibrary(path)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(20)


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


class Handing:
    """A CpuDecode that hands out one library, and records what the dispatch tells it."""

    def __init__(self, library):
        self.lib, self.errors = library, []

    def library(self):
        return self.lib

    def set_aside(self, error):
        self.errors.append(error)


SHAPES = {  # Hq, Hk, D, block_size, seq_lens of the decode rows
    "mha-tiny-blocks": (2, 2, 16, 4, [1, 7, 33]),
    "gqa3-d40": (6, 2, 40, 16, [50, 17, 16, 32]),          # head_dim not a multiple of 16: masked tails
    "smollm": (9, 3, 64, 16, [130, 3, 64, 1, 300]),
    "mqa5-d24": (5, 1, 24, 8, [9, 8, 23]),                 # a group of 5: two register tiles of heads
    "gqa8-d128": (16, 2, 128, 16, [40, 200]),              # two 64-wide column tiles
    "gqa4-d80": (8, 2, 80, 32, [77, 5]),
    "long-one-row": (4, 2, 64, 16, [3001]),                # one sequence split over the threads
    "long-mixed": (6, 3, 32, 16, [5000, 2, 700]),          # a split past SPLIT_MAX, short rows beside it
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("window,softcap", [(None, None), (11, None), (None, 3.0), (700, 7.0)],
                         ids=["full", "window", "softcap", "window-softcap"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("build", ["native", "portable"])
def test_decode_matches_reference(request, build, shape, dtype, window, softcap, gen):
    lib = request.getfixturevalue("lib" if build == "native" else "portable_lib")
    Hq, Hk, D, BS, lens = SHAPES[shape]
    q, k, v, meta = make_step([(1, L) for L in lens], len(lens), Hq, Hk, D, BS, dtype, gen, window)
    out = ca.decode_attention_cpu(q, k, v, meta.block_tables, meta.seq_lens_t, 0.3, window, softcap, lib)
    ref = paged_attention_ref(q.float(), k.float(), v.float(), meta, 0.3, softcap=softcap)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **KERNEL_TOL[dtype])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_shared_prefix_blocks_and_thread_counts(lib, threads, gen):
    """Rows that share their first physical block (a shared prefix), at any thread count (the work split
    changes with it; the answer does not, beyond float32's last bits)."""
    lens = [40, 17, 90, 16, 1]
    q, k, v, meta = make_step([(1, L) for L in lens], len(lens), 6, 3, 32, 16, torch.float32, gen, share=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = ca.decode_attention_cpu(q, k, v, meta.block_tables, meta.seq_lens_t, 0.2, None, None, lib)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, paged_attention_ref(q, k, v, meta, 0.2), **TOL[torch.float32])


def test_launcher_checks_what_the_kernel_trusts(lib, gen):
    q, k, v, meta = make_step([(1, 9)], 1, 4, 2, 16, 4, torch.float32, gen)
    tables, lens = meta.block_tables, meta.seq_lens_t
    with pytest.raises(TypeError, match="one of float32"):
        ca.decode_attention_cpu(q.double(), k.double(), v.double(), tables, lens, 1.0, None, None, lib)
    with pytest.raises(TypeError):
        ca.decode_attention_cpu(q, k.bfloat16(), v, tables, lens, 1.0, None, None, lib)
    with pytest.raises(ValueError, match="multiple of Hk"):
        ca.decode_attention_cpu(q[:, :3].contiguous(), k, v, tables, lens, 1.0, None, None, lib)
    with pytest.raises(ValueError, match="int32"):
        ca.decode_attention_cpu(q, k, v, tables.long(), lens, 1.0, None, None, lib)
    with pytest.raises(ValueError, match="contiguous"):
        ca.decode_attention_cpu(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, tables, lens, 1.0, None,
                                None, lib)
    out = torch.full_like(q, float("nan"))
    assert ca.decode_attention_cpu(q, k, v, tables, lens, 1.0, None, None, lib, out=out) is out
    assert not out.isnan().any()


@pytest.mark.parametrize("int8", [False, True], ids=["float-cache", "int8-cache"])
def test_dispatch_mixed_step(lib, int8, gen):
    """Decodes through the kernel, prefill chunks through their own path; int8 caches stay on the reference."""
    from jobrunner.kernels.attention.kv_int8 import paged_attention_int8_ref, quantize_int8_ref
    seqs = [(1, 21), (1, 90), (7, 7), (12, 35)]
    q, k, v, meta = make_step(seqs, 2, 6, 3, 32, 16, torch.float32, gen, window=30)
    meta.cpu_decode = handing = Handing(lib)
    if int8:
        (kq, ks), (vq, vs) = quantize_int8_ref(k), quantize_int8_ref(v)
        out = paged_attention(q, kq, vq, meta, 0.2, ks, vs)
        ref = paged_attention_int8_ref(q, kq, vq, ks, vs, meta, 0.2)
    else:
        out = paged_attention(q, k, v, meta, 0.2)
        ref = paged_attention_ref(q, k, v, meta, 0.2)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    assert not handing.errors


@pytest.mark.parametrize("window,softcap", [(None, None), (40, None), (None, 5.0)], ids=["full", "window", "softcap"])
def test_short_chunks_run_every_token_through_the_kernel_in_place(lib, gen, monkeypatch, window, softcap):
    """Speculative verify chunks (a row's last token and its drafts) and a prompt's few tokens after a prefix-cache
    hit: every token a row of the in-place kernel over its own keys (no gather of the cached context); a step
    with a longer chunk, or of more rows, takes the chunk path (the in-place prefill, or flash attention where
    that does not serve). Both match the reference."""
    from jobrunner.kernels.attention import attention as A
    calls = []
    in_place, flash = A._prefill_in_place, A.prefill_attention_cpu
    monkeypatch.setattr(A, "_prefill_in_place", lambda *a, **kw: calls.append(1) or in_place(*a, **kw))
    monkeypatch.setattr(A, "prefill_attention_cpu", lambda *a, **kw: calls.append(1) or flash(*a, **kw))
    many = [(5, 40)] * A.SHORT_STEP_ROWS
    for seqs, chunked in (([(1, 21), (5, 300), (A.SHORT_CHUNK, 90), (2, 2)], False),
                          ([(1, 21), (5, 300), (A.SHORT_CHUNK + 1, 90)], True),
                          ([(1, 21)] + many, True)):                  # more rows than SHORT_STEP_ROWS
        q, k, v, meta = make_step(seqs, 1, 6, 3, 32, 16, torch.float32, gen, window=window)
        meta.cpu_decode = handing = Handing(lib)
        calls.clear()
        out = paged_attention(q, k, v, meta, 0.2, softcap=softcap)
        torch.testing.assert_close(out, paged_attention_ref(q, k, v, meta, 0.2, softcap=softcap), **TOL[torch.float32])
        assert not handing.errors and bool(calls) == (chunked and softcap is None and not A._window_cuts(meta, window))


def test_a_failing_kernel_is_set_aside_and_the_reference_serves(lib, gen):
    q, k, v, meta = make_step([(1, 9), (1, 20)], 2, 2, 1, 8, 4, torch.float32, gen)

    class Broken(ca.DecodeLibrary):
        def __init__(self):
            self.functions = {dt: self.fail for dt in ca.DTYPES}

        def fail(self, *args):
            raise OSError("a library from another build")
    meta.cpu_decode = handing = Handing(Broken())
    torch.testing.assert_close(paged_attention(q, k, v, meta, 0.5), paged_attention_ref(q, k, v, meta, 0.5))
    assert [str(e) for e in handing.errors] == ["a library from another build"]


def test_engine_side_builds_once_under_the_cache_root(monkeypatch, tmp_path):
    from jobrunner.engine.config.engine_config import cache_root
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    monkeypatch.delenv("JOBRUNNER_CPU_DECODE", raising=False)
    path = cd.library_path()
    assert path.is_relative_to(cache_root() / "kernels") and path.name == ca.library_name()
    kernels = cd.DecodeKernels()
    loaded = kernels.library()
    assert loaded is not None and loaded.path == path and path.exists()
    stamp = path.stat().st_mtime_ns
    assert cd.DecodeKernels().library() is not None and path.stat().st_mtime_ns == stamp   # found, not rebuilt
    assert not list(path.parent.glob(".*tmp*"))                                            # no temporary left


def test_library_name_follows_source_and_flags(monkeypatch):
    name = ca.library_name()
    monkeypatch.setattr(ca, "CFLAGS", ca.CFLAGS + ("-DOTHER",))
    assert ca.library_name() != name


def test_gather_mode_hands_out_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    monkeypatch.setenv("JOBRUNNER_CPU_DECODE", "gather")
    assert cd.DecodeKernels().library() is None
    assert not cd.library_path().exists()


def test_no_compiler_warns_once_and_gathers(monkeypatch, tmp_path, caplog, gen):
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    monkeypatch.delenv("JOBRUNNER_CPU_DECODE", raising=False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    kernels = cd.DecodeKernels()
    q, k, v, meta = make_step([(1, 9), (1, 20)], 2, 2, 1, 8, 4, torch.float32, gen)
    meta.cpu_decode = kernels
    with caplog.at_level(logging.WARNING, logger="jobrunner"):
        for _ in range(3):
            torch.testing.assert_close(paged_attention(q, k, v, meta, 0.5), paged_attention_ref(q, k, v, meta, 0.5))
    assert caplog.text.count("not available") == 1 and "no-such-cc" in caplog.text
    assert kernels.failed


def test_a_compile_error_is_reported(monkeypatch, tmp_path):
    monkeypatch.setattr(ca, "CFLAGS", ca.CFLAGS + ("-fno-such-option",))
    with pytest.raises(RuntimeError, match="exited"):
        cd.build_library(tmp_path / "broken.so")
    assert not list(tmp_path.iterdir())


def test_mode_rejects_unknown(monkeypatch):
    monkeypatch.setenv("JOBRUNNER_CPU_DECODE", "flex")
    with pytest.raises(ValueError, match="JOBRUNNER_CPU_DECODE"):
        cd.decode_mode()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_one_openmp_runtime_in_the_process(lib):
    """Loading the library maps no libgomp beside torch's (it binds to the one torch loaded, by soname): one
    thread pool, not two spinning on the same cores. In a fresh process, where nothing else loaded one."""
    script = (
        "import sys, torch\n"
        "from jobrunner.kernels.attention.cpu_attention import DecodeLibrary\n"
        "def gomp(): return {l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}\n"
        "before = gomp(); DecodeLibrary(sys.argv[1]); print(before == gomp(), sorted(gomp()))\n")
    done = subprocess.run([sys.executable, "-c", script, str(lib.path)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("True"), done.stdout


def test_tiny_model_greedy_same_on_both_paths(monkeypatch, tmp_path):
    """A tiny random Llama (GQA 2) stepped through prefill chunks, mixed steps and decodes: the same greedy
    tokens with decodes gathered and with decodes through the in-place kernel."""
    from tests.tiny import step_tiny_llama
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path))
    monkeypatch.delenv("JOBRUNNER_CPU_DECODE", raising=False)
    plan = [[(0, 4)], [(0, 3), (1, 5)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(1, 1)]]
    kernels = cd.DecodeKernels()
    assert step_tiny_llama(plan, kernels) == step_tiny_llama(plan)
    assert kernels.loaded is not None and not kernels.failed
