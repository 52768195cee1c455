"""Paged decode attention on CPU that reads the KV blocks in place: no gather of the context per step.

The torch reference (kernels/attention.py) copies every decode sequence's blocks out of the pool with
index_select at every layer of every step, pads them to the longest sequence, and runs SDPA at one
query row. Here FlexAttention's CPU template (inductor's C++ flash-attention loop) walks the pool
itself: a block mask's kv block is one cache block, and its kv_indices are the sequence's block table.

    k_cache [NB, BS, Hk, D]  -- view -->  [1, Hk, NB*BS, D]   one "sequence" of every slot, no copy
    q       [B, Hq, D]       -- view -->  [B, Hk, G, D]       G = Hq // Hk query heads that share a KV
                                                              head are G query rows: each cache block
                                                              is one [G, D] x [D, BS] product
    per decode sequence b, with lo_b = first visible position (sliding window, else 0), hi_b = seq_len:
        full_kv_indices[b]   blocks wholly inside [lo_b, hi_b)        no mask evaluated
        kv_indices[b]        the <= 2 blocks that lo_b or hi_b cuts   mask_mod evaluated (_cut_mask)
        (blocks outside the window and other sequences' blocks are never read)

Compilation: ahead of time with AOTInductor into a package file, loaded in a few milliseconds without
importing dynamo (a torch.compile of the same function costs 4-5 s at every start). This module only
compiles a package to a path and loads one: where packages are kept, when one is built, the locks between
processes and the build's background process belong to the engine (engine/cpu_decode.py), which hands a
step's AttentionMetadata a `CpuDecode` (below) to ask for the loaded runner.

Not covered (the reference serves): int8 KV caches (FlexAttention wants one dtype for q, k and v),
prefill chunks (kernels/cpu_prefill.py serves those, no compile needed), and a step where one
physical block sits at two logical positions (never, with prefix sharing from position 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch

PACKAGE_VERSION = 1          # raise when decode_flex or DecodeMask.inputs() change: old packages are not loaded


# ----------------------------------------------------------------------------------- the block mask

@dataclass
class DecodeMask:
    """The decode rows' block mask over the whole pool; built once per step (and pool size), shared by
    every layer. Shapes, with B decode sequences and NB pool blocks:"""
    part_num: torch.Tensor       # [B, 1, 1] int32: 0..2 blocks cut by lo or hi
    part_idx: torch.Tensor       # [B, 1, 1, NB] int32: those blocks first (FlexAttention wants NB columns)
    full_num: torch.Tensor       # [B, 1, 1] int32
    full_idx: torch.Tensor       # [B, 1, 1, NB] int32: the wholly visible blocks first
    cuts: tuple                  # 4 x [B] int32: the block lo cuts (-1: none), lo % BS, the block hi cuts
                                 #   (-1: none), hi % BS; what the mask_mod reads (1-D: see build())

    @classmethod
    def build(cls, tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_blocks: int,
              window: int | None) -> "DecodeMask | None":
        """tables: [B, W] int32 (padded with 0), seq_lens: [B]. None when a physical block would sit at two
        logical positions (the mask addresses slots by physical block)."""
        bs, B, W = block_size, tables.shape[0], tables.shape[1]
        hi = seq_lens.long()
        lo = (hi - window).clamp(min=0) if window else torch.zeros_like(hi)
        nblk = -(-hi // bs)                                                      # [B] blocks in use
        j = torch.arange(W)
        used = j[None, :] < nblk[:, None]                                        # [B, W]
        tab = tables.long()
        blk_pos = torch.full((num_blocks,), -1, dtype=torch.int64)              # physical -> logical block
        blk_pos[tab[used]] = j.expand(B, W)[used]
        if not bool((blk_pos[tab[used]] == j.expand(B, W)[used]).all()):
            return None
        rows = torch.arange(B)
        # wholly visible blocks: [ceil(lo / bs), floor(hi / bs))
        fs, fe = -(-lo // bs), hi // bs
        full_num = (fe - fs).clamp(min=0)
        src = (fs[:, None] + j[None, :]).clamp(max=W - 1)
        full = torch.where(j[None, :] < full_num[:, None], tab.gather(1, src), 0)
        # blocks cut by the window's start (lo % bs) or by the end (hi % bs); one entry if the same block
        first, last = lo // bs, (hi - 1) // bs
        cut_lo, cut_hi = lo % bs != 0, hi % bs != 0
        first_blk = tab[rows, first.clamp(max=W - 1)]
        last_blk = tab[rows, last.clamp(max=W - 1)]
        part_num = cut_lo.long() + cut_hi.long() - (cut_lo & cut_hi & (first == last)).long()
        part = torch.stack([torch.where(cut_lo, first_blk, last_blk), last_blk], 1)
        part = torch.where(torch.arange(2)[None, :] < part_num[:, None], part, 0)
        cuts = (torch.where(cut_lo, first_blk, -1), lo % bs, torch.where(cut_hi, last_blk, -1), hi % bs)

        def wide(x):                                                             # [B, k] -> [B, 1, 1, NB]
            # FlexAttention wants NB columns, the kernel reads the first num: the rest is left unwritten
            # (a zero fill costs ~1 ms a step on a quiet machine, 20 under load: the fill is threaded)
            out = torch.empty(B, 1, 1, num_blocks, dtype=torch.int32)
            k = min(x.shape[1], num_blocks)
            out[:, 0, 0, :k] = x[:, :k]
            return out
        i32 = lambda x: x.to(torch.int32)
        return cls(i32(part_num).view(B, 1, 1), wide(part), i32(full_num).view(B, 1, 1), wide(full),
                   tuple(map(i32, cuts)))

    def inputs(self) -> list[torch.Tensor]:
        """What the package takes after q, k_cache and v_cache."""
        return [self.part_num, self.part_idx, self.full_num, self.full_idx, *self.cuts]


def _cut_mask(block_size, cuts, listed=None):
    """mask_mod over the pool's slots, for the blocks the block mask lists as partial: in the block that lo
    cuts, offsets >= lo % BS; in the block that hi cuts, offsets < hi % BS (the kernel skips unlisted blocks
    and doesn't mask full ones). Eager flex evaluates a mask_mod on every slot of the pool: listed(b, blk)
    then says which blocks b's lists hold."""
    def mask_mod(b, h, q_idx, kv_idx):
        blk, off = kv_idx // block_size, kv_idx % block_size
        lo_blk, lo_off, hi_blk, hi_off = cuts
        ok = ((blk != lo_blk[b]) | (off >= lo_off[b])) & ((blk != hi_blk[b]) | (off < hi_off[b]))
        return ok if listed is None else ok & listed(b, blk)
    return mask_mod


def listed_blocks(part_num, part_idx, full_num, full_idx):
    """(b, physical block) -> whether b's block lists hold it, as a mask_mod term for eager flex (which
    evaluates the mask on every slot and ignores the lists): eager then computes what the kernel does."""
    B, nb = part_idx.shape[0], part_idx.shape[-1]
    held = torch.zeros(B, nb + 1, dtype=torch.bool)
    j = torch.arange(nb)
    for num, idx in ((part_num, part_idx), (full_num, full_idx)):
        blocks = torch.where(j[None, :] < num.view(B, 1), idx.view(B, nb).long(), nb)   # unused -> column nb
        held.scatter_(1, blocks, True)
    return lambda b, blk: held[b, blk]


def decode_flex(q, k_cache, v_cache, part_num, part_idx, full_num, full_idx, *cuts, softcap=None, listed=None):
    """q: [B, Hk, G, D] already multiplied by the layer's scale; k/v_cache: [NB, BS, Hk, D]; then a
    DecodeMask's inputs(); softcap: None or the model's soft-cap (a float, compiled in); listed: eager only (_cut_mask).
    -> [B, Hk, G, D]. Run eagerly (tests), or traced and compiled by build()."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    nb, bs, hk, d = k_cache.shape
    g = q.shape[2]
    mask = BlockMask.from_kv_blocks(part_num, part_idx, full_num, full_idx, BLOCK_SIZE=(g, bs),
                                    mask_mod=_cut_mask(bs, cuts, listed), seq_lengths=(g, nb * bs),
                                    compute_q_blocks=False)
    k = k_cache.view(1, nb * bs, hk, d).transpose(1, 2)                              # [1, Hk, NB*BS, D], in place
    v = v_cache.view(1, nb * bs, hk, d).transpose(1, 2)
    def capped(s, b, h, q_idx, kv_idx):
        return torch.tanh(s / softcap) * softcap
    return flex_attention(q, k, v, score_mod=capped if softcap else None, block_mask=mask, scale=1.0)


class _Decode(torch.nn.Module):
    def __init__(self, softcap: float):
        super().__init__()
        self.softcap = softcap

    def forward(self, q, k_cache, v_cache, part_num, part_idx, full_num, full_idx, lo_blk, lo_off, hi_blk, hi_off):
        return decode_flex(q, k_cache, v_cache, part_num, part_idx, full_num, full_idx, lo_blk, lo_off, hi_blk,
                           hi_off, softcap=self.softcap)


# ------------------------------------------------------------------------- packages: key, compile, load

@dataclass(frozen=True)
class DecodeKey:
    """What a package is compiled for (besides torch and the CPU, which its directory names)."""
    dtype: str            # "float32", "bfloat16", "float16"
    kv_heads: int
    group: int
    head_dim: int
    block_size: int
    softcap: float        # 0.0: none (a model has one soft-cap value: it is compiled in)

    def file_name(self) -> str:
        return (f"decode-v{PACKAGE_VERSION}-{self.dtype}-hk{self.kv_heads}-g{self.group}-d{self.head_dim}"
                f"-bs{self.block_size}{f'-softcap{self.softcap:g}' if self.softcap else ''}.pt2")


def decode_key(q, k_cache, softcap) -> DecodeKey:
    hq, (_, bs, hk, d) = q.shape[1], k_cache.shape
    return DecodeKey(str(q.dtype).removeprefix("torch."), hk, hq // hk, d, bs, float(softcap or 0.0))


Runner = Callable[[list], torch.Tensor]


class CpuDecode(Protocol):
    """The engine's side of the in-place kernel, as the dispatch (kernels/attention.py) sees it."""

    def runner(self, key: DecodeKey) -> Runner | None:
        """The loaded package for key, or None: the gather reference serves."""

    def set_aside(self, key: DecodeKey, error: Exception) -> None:
        """A loaded package failed: not to be handed out again."""

    def note_gather(self, key: DecodeKey, seconds: float) -> None:
        """The gather reference served a step's decode rows in `seconds`."""


def compile_decode_package(key: DecodeKey, path: Path) -> None:
    """Exports decode_flex with dynamic batch, pool size and table width, and compiles it (AOTInductor)
    into the package file at path (minutes)."""
    from torch.export import Dim, export
    dtype = getattr(torch, key.dtype)
    B, NB = 4, 8
    i32 = dict(dtype=torch.int32)
    args = [torch.randn(B, key.kv_heads, key.group, key.head_dim).to(dtype),
            torch.randn(NB, key.block_size, key.kv_heads, key.head_dim).to(dtype),
            torch.randn(NB, key.block_size, key.kv_heads, key.head_dim).to(dtype),
            torch.ones(B, 1, 1, **i32), torch.zeros(B, 1, 1, NB, **i32), torch.ones(B, 1, 1, **i32),
            torch.zeros(B, 1, 1, NB, **i32)] + [torch.zeros(B, **i32) for _ in range(4)]
    b, nb = Dim("b", min=1, max=1 << 16), Dim("nb", min=2, max=1 << 24)
    shapes = [{0: b}, {0: nb}, {0: nb}, {0: b}, {0: b, 3: nb}, {0: b}, {0: b, 3: nb}] + [{0: b}] * 4
    program = export(_Decode(key.softcap), tuple(args), dynamic_shapes=tuple(shapes))
    torch._inductor.aoti_compile_and_package(program, package_path=str(path))


def load_decode_package(path: Path) -> Runner:
    """The package's runner: the C++ loader directly (milliseconds, no dynamo import), else the public
    torch._inductor.aoti_load_package (imports inductor: about 2 s)."""
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        return lambda args: loader.run(args)[0]
    except (AttributeError, TypeError, RuntimeError):
        from torch._inductor import aoti_load_package
        model = aoti_load_package(str(path))
        return lambda args: model(*args)


def decode_attention_cpu(q, k_cache, v_cache, mask: DecodeMask, scale: float, softcap: float | None,
                         runner: Runner) -> torch.Tensor:
    """q: [B, Hq, D] decode rows -> [B, Hq, D], through a loaded package's runner."""
    B, hq, d = q.shape
    hk = k_cache.shape[2]
    qs = (q * scale).view(B, hk, hq // hk, d)                                         # contiguous, prescaled
    with torch.profiler.record_function("cpu_attention.decode (package)"):     # the profiler can't see into it
        return runner([qs, k_cache, v_cache, *mask.inputs()]).view(B, hq, d)
