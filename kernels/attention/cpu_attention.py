"""Paged attention on CPU that reads the KV blocks in place: no gather of the context per step.

The torch reference (kernels/attention/reference.py) copies every decode sequence's blocks out of the pool with
index_select at every layer of every step, pads them to the longest sequence, and runs SDPA at one query
row. Here a small C kernel (cpu_attention.c beside this file: its comment has the loop, the work split and
the two-pass softmax) walks each sequence's block table over the pool itself, reading K and V once:

    k_cache [NB, BS, Hk, D]   a token's K row of all Hk heads is Hk * D contiguous values
    q       [B, Hq, D]        the G = Hq // Hk query heads of a KV head share its rows (read once, from L1)
    tables  [B, W] int32      the step's block tables; seq_lens [B]: keys [seq_len - window, seq_len) visible

It is plain C (OpenMP, AVX-512 intrinsics where the compiler targets them, portable loops elsewhere) so it
compiles in about a second with the system's C compiler, for this CPU (-march=native), and loads through
ctypes: no torch headers, no inductor. This module holds the source's path, the flags, the loader and the
launcher; where a library is kept, when it is built and by whom belong to engine/run/cpu_decode.py (kernels/
runs no process and keeps no directory).

Covered: float32, bfloat16 and float16 caches (arithmetic in float32), GQA/MQA/MHA, any head_dim up to
MAX_HEAD_DIM, sliding windows, soft-capped scores, blocks shared between sequences. Not covered (the
reference serves): int8 caches (kernels/attention/kv_int8.py). In batch-invariant mode every prefill token is
a row here of its own (its sequence's table, its position's keys), in fixed splits, so a token's bits are the
same as a decode's at its position, whatever chunk, cached prefix or batch it came in (attention.py:
paged_attention_cpu).

Prefill chunks (prefill_attention_in_place; AVX-512 builds, head_dim a multiple of 16): each chunk's queries
over its context and its own keys in one causal flash pass, reading the blocks in place (the second half of
cpu_attention.c); elsewhere kernels/attention/cpu_prefill.py serves (torch's flash attention).
"""
from __future__ import annotations

import ctypes
import hashlib
from pathlib import Path
from typing import Protocol

import torch

SOURCE = Path(__file__).with_name("cpu_attention.c")
# -ffast-math is not used: linked into a shared library (gcc < 13) it sets flush-to-zero for the whole process.
# The kernel reassociates its sums explicitly (omp simd reductions, vector lanes) instead.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared")
LIBS = ("-lm",)
MAX_HEAD_DIM = 1024                          # the combine's stack buffer (cpu_attention.c)
SPLIT_MAX = 4096                             # keys a split at most (cpu_attention.c)
PREFILL_MAX_KEYS = 65536                     # a prefill chunk's keys at most (cpu_attention.c: a thread's copies)
# Batch-invariant mode: every row's keys in splits of this many from its first key, whatever the batch and
# the threads (cpu_attention.c; SPLIT_MIN there: below it a split's fixed costs show).
INVARIANT_SPLIT = 256
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def compile_command(cc: list[str], output: Path) -> list[str]:
    """The compiler's argv that builds the library at output (the caller runs it)."""
    return [*cc, *CFLAGS, str(SOURCE), "-o", str(output), *LIBS]


def library_name() -> str:
    """The library's file name: it changes with the source and the flags, so a stale build is never loaded."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS + LIBS).encode()).hexdigest()[:12]
    return f"cpu_attention-{digest}.so"


class DecodeLibrary:
    """The compiled kernel, loaded: one entry point per cache dtype."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        ptr, i32, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        self.functions = {}
        for dtype, name in DTYPES.items():
            fn = getattr(lib, f"decode_attention_{name}")
            fn.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int64, ptr, ptr] + [i32] * 6 + [f32, f32, i32, i32]
            fn.restype = i32
            self.functions[dtype] = fn
        # prefill chunks in place: AVX-512 builds only (elsewhere cpu_prefill.py serves)
        self.prefill = {}
        for dtype, name in DTYPES.items():
            fn = getattr(lib, f"prefill_attention_{name}", None)
            if fn is not None:
                fn.argtypes = [ptr, ptr, ptr, ptr, ctypes.c_int64, ptr, ptr, ptr] + [i32] * 5 + [f32, i32]
                fn.restype = i32
                self.prefill[dtype] = fn
        self.path = path

    def covers(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return (q.dtype in self.functions and k_cache.dtype == q.dtype and q.shape[-1] <= MAX_HEAD_DIM
                and q.device.type == "cpu")

    def covers_prefill(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return (q.dtype in self.prefill and k_cache.dtype == q.dtype and q.shape[-1] % 16 == 0
                and q.device.type == "cpu")


class CpuDecode(Protocol):
    """The engine's side of the in-place kernel, as the dispatch (kernels/attention/attention.py) sees it."""

    def library(self) -> DecodeLibrary | None:
        """The loaded kernel, or None: the gather reference serves."""

    def set_aside(self, error: Exception) -> None:
        """The loaded kernel failed: not to be handed out again."""


def decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float, window: int | None, softcap: float | None,
                         lib: DecodeLibrary, out: torch.Tensor | None = None, split: int = 0) -> torch.Tensor:
    """q: [B, Hq, D] decode rows; k/v_cache: [NB, BS, Hk, D]; tables: [B, W] int32 (rows may be longer than
    needed); seq_lens: [B] int32 (each >= 1) -> [B, Hq, D], in out when given. split: keys a split (the
    batch-invariant mode's INVARIANT_SPLIT: a row's bits then depend on its own keys only); 0: chosen
    from the batch and the threads."""
    B, hq, d = q.shape
    nb, bs, hk, dk = k_cache.shape
    if q.dtype not in lib.functions or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"decode_attention_cpu: q {q.dtype}, caches {k_cache.dtype}/{v_cache.dtype}: one of "
                        f"{', '.join(DTYPES.values())} for all three")
    if dk != d or v_cache.shape != k_cache.shape or hq % hk or d > MAX_HEAD_DIM:
        raise ValueError(f"decode_attention_cpu: q {tuple(q.shape)}, k {tuple(k_cache.shape)}, "
                         f"v {tuple(v_cache.shape)}: want Hq a multiple of Hk, one head_dim <= {MAX_HEAD_DIM}")
    if not 0 <= split <= SPLIT_MAX:
        raise ValueError(f"decode_attention_cpu: split {split}: 0 (chosen per call) up to {SPLIT_MAX} keys")
    if tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or tables.shape[0] < B or seq_lens.shape[0] < B:
        raise ValueError("decode_attention_cpu: tables [B, W] and seq_lens [B] as int32")
    if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous() and seq_lens.is_contiguous()
            and tables.stride(1) == 1):
        raise ValueError("decode_attention_cpu: q, the caches and seq_lens contiguous, table rows contiguous")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("decode_attention_cpu: out must be a contiguous tensor like q")
    with torch.profiler.record_function("cpu_attention.decode (in place)"):   # the profiler can't see into it
        rc = lib.functions[q.dtype](q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                                    tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), B, hq, hk, d, bs,
                                    int(window or 0), float(scale), float(softcap or 0.0),
                                    torch.get_num_threads(), int(split))
    if rc == -1:
        raise MemoryError("decode_attention_cpu: the kernel could not allocate its scratch")
    if rc != 0:
        raise ValueError(f"decode_attention_cpu: the kernel refused its arguments ({rc})")
    return out


def prefill_attention_in_place(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                               starts: torch.Tensor, seq_lens: torch.Tensor, scale: float, lib: DecodeLibrary,
                               out: torch.Tensor) -> bool:
    """Prefill chunks over a float cache (float32 arithmetic), read in place: chunk c's queries are rows
    [starts[c], starts[c + 1]) of q [T, Hq, D] (their keys written), its keys [0, seq_lens[c]) through tables[c];
    each query at position p sees keys [0, p]. Into out (like q). False where the kernel does not take the call
    (the caller's torch path serves: a chunk past PREFILL_MAX_KEYS)."""
    n = seq_lens.shape[0]
    _, hq, d = q.shape
    _, bs, hk, _ = k_cache.shape
    if not (q.is_contiguous() and out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
            and tables.stride(1) == 1 and starts.is_contiguous() and seq_lens.is_contiguous()
            and starts.dtype == seq_lens.dtype == tables.dtype == torch.int32 and starts.shape[0] == n + 1):
        raise ValueError("prefill_attention_in_place: contiguous q, out and caches; int32 tables, starts [n + 1], "
                         "seq_lens [n]")
    with torch.profiler.record_function("cpu_attention.prefill (in place)"):
        rc = lib.prefill[q.dtype](q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                                  tables.stride(0), starts.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), n, hq, hk,
                                  d, bs, float(scale), torch.get_num_threads())
    if rc == -1:
        raise MemoryError("prefill_attention_in_place: the kernel could not allocate its scratch")
    return rc == 0
