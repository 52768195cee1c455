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

Compilation: ahead of time with AOTInductor into a package kept under <cache>/kernels/ (<cache>:
$JOBRUNNER_CACHE, else ~/.cache/jobrunner) and loaded in a few milliseconds without importing
dynamo. A torch.compile of the same function costs 4-5 s at every start with a warm inductor cache
(26 s cold), which would break the start-up target; the package costs one to several minutes to build,
once per (torch version, CPU capability, dtype, heads, head_dim, block size, soft-cap). `jobrunner warmup`
builds it in the foreground (mode flex, below). A job never builds it on the cores it runs on (its
threads already take every core a 2-core machine has: a background build there cost the first job
minutes at 1-2 tokens/s); it loads a package that is there, else the reference serves and one line says
how to build it. JOBRUNNER_CPU_DECODE: auto (that policy, the default), flex (build now, in this
process's wait, if absent: warmup and benchmarks), gather (the reference only);
JOBRUNNER_CPU_DECODE_BUILD_AFTER: seconds of gather-path decode after which a job does start a build in a
child at nice 19 (opt-in, for machines with idle cores; default inf: never).

Not covered (the reference serves): int8 KV caches (FlexAttention wants one dtype for q, k and v),
prefill chunks (SDPA over gathered blocks runs near the matmul rate there), and a step where one
physical block sits at two logical positions (never, with prefix sharing from position 0).
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

BUILD_AFTER_S = float("inf")   # seconds of gather-path decode attention before a job builds the package:
                               # never by default (`jobrunner warmup` does); $JOBRUNNER_CPU_DECODE_BUILD_AFTER opts in
PACKAGE_VERSION = 1          # raise when decode_flex or DecodeMask.inputs() change: old packages are not loaded
log = logging.getLogger("jobrunner")


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


# ------------------------------------------------------------------------- packages: key, build, load

@dataclass(frozen=True)
class Key:
    dtype: str            # "float32", "bfloat16", "float16"
    kv_heads: int
    group: int
    head_dim: int
    block_size: int
    softcap: float        # 0.0: none (a model has one soft-cap value: it is compiled in)

    def path(self) -> Path:
        env = os.environ.get("JOBRUNNER_CACHE")
        root = Path(env) if env else Path.home() / ".cache" / "jobrunner"
        name = (f"decode-v{PACKAGE_VERSION}-{self.dtype}-hk{self.kv_heads}-g{self.group}-d{self.head_dim}"
                f"-bs{self.block_size}{f'-softcap{self.softcap:g}' if self.softcap else ''}.pt2")
        return root / "kernels" / f"torch-{torch.__version__}-{_cpu_tag()}" / name


def _cpu_tag() -> str:
    """The CPU a package was compiled for: inductor compiles for the build machine (-march=native), so a
    cache shared with another CPU must not hand it this one's package (illegal instructions)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    digest = hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:8]
    return f"{torch.backends.cpu.get_cpu_capability()}-{digest}"


def build(key: Key, path: Path) -> None:
    """Exports decode_flex with dynamic batch, pool size and table width, and compiles it (AOTInductor)
    into the package at path (written to a temporary name, then renamed)."""
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
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.pt2")
    torch._inductor.aoti_compile_and_package(program, package_path=str(tmp))
    os.replace(tmp, path)


def _load(path: Path):
    """The package's runner: the C++ loader directly (milliseconds, no dynamo import), else the public
    torch._inductor.aoti_load_package (imports inductor: about 2 s)."""
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        return lambda args: loader.run(args)[0]
    except (AttributeError, TypeError, RuntimeError):
        from torch._inductor import aoti_load_package
        model = aoti_load_package(str(path))
        return lambda args: model(*args)


class _Kernels:
    """Per process: each key's runner once loaded, the child building it, and the seconds the gather
    path has spent on decode attention (the build starts past BUILD_AFTER_S)."""

    def __init__(self):
        self.runners: dict[Key, object] = {}
        self.children: dict[Key, subprocess.Popen] = {}
        self.failed: set[Key] = set()
        self.gather_s = 0.0
        self._next_look = 0.0
        self.hinted = False          # the "jobrunner warmup" line is logged once a process

    def runner(self, key: Key, mode: str):
        if key in self.runners:
            return self.runners[key]
        if key in self.failed:
            return None
        path = key.path()
        if mode == "flex" and not path.exists():
            build(key, path)
        now = time.monotonic()
        if mode == "flex" or now >= self._next_look:
            self._next_look = now + 1.0                      # a stat a second at most, not one per layer
            child = self.children.get(key)
            if child is not None and child.poll() not in (None, 0):
                self.failed.add(key)
                return None
            if path.exists():
                try:
                    self.runners[key] = _load(path)
                except Exception as e:                       # a package this torch can't load: stay on gather
                    log.warning("kernels.cpu_attention: cannot load %s: %s", path, e)
                    self.failed.add(key)
                    return None
                return self.runners[key]
        return None

    def set_aside(self, key: Key, error: Exception) -> None:
        """A loaded package failed: not used again in this process."""
        log.warning("kernels.cpu_attention: the package for %s failed (%s); decode attention gathers instead",
                    key, error)
        self.runners.pop(key, None)
        self.failed.add(key)

    def note_gather(self, key: Key, seconds: float) -> None:
        """Counts gather-path decode time; past BUILD_AFTER_S starts the build in a child at nice 19."""
        self.gather_s += seconds
        after = float(os.environ.get("JOBRUNNER_CPU_DECODE_BUILD_AFTER", BUILD_AFTER_S))
        if not self.hinted and key not in self.failed and after == float("inf"):
            self.hinted = True
            log.info("decode attention gathers the KV blocks at every step; `jobrunner warmup` builds the "
                     "in-place CPU kernel for this model once (0.4x the attention time)")
        if self.gather_s < after or key in self.children or key in self.failed:
            return
        path = key.path()
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = path.with_suffix(".building")                 # the builder's pid, while it runs
        if path.exists() or not _take(lock):
            self.children[key] = None                        # there, or another process is building it
            return
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        args = [sys.executable, "-m", "kernels.cpu_attention", "build", key.dtype, str(key.kv_heads),
                str(key.group), str(key.head_dim), str(key.block_size), "--softcap", str(key.softcap)]
        # a session of its own: the build (about a minute) outlives a job that ends first, and stays out of
        # its signals; it lowers its own priority (nice 19) first thing
        with open(path.with_suffix(".log"), "w") as out:
            child = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                     start_new_session=True)
        lock.write_text(str(child.pid))
        self.children[key] = child
        log.info("kernels.cpu_attention: building the in-place CPU decode attention once (about a minute, at "
                 "low priority) into %s", path)


def _take(lock: Path) -> bool:
    """Creates the build lock, atomically (one builder among the processes sharing the cache); a lock whose
    builder is gone is taken over. False: another live process holds it."""
    for _ in range(2):
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            if _alive(lock):
                return False
            lock.unlink(missing_ok=True)
    return False


def _alive(lock: Path) -> bool:
    """Whether the pid written in lock is a running process (a lock just created, still empty, counts)."""
    try:
        text = lock.read_text()
        if not text:                 # created, its pid not yet written (or a builder that died right there)
            return time.time() - lock.stat().st_mtime < 60
        os.kill(int(text), 0)
        return True
    except (OSError, ValueError):
        return False


KERNELS = _Kernels()


def mode() -> str:
    m = os.environ.get("JOBRUNNER_CPU_DECODE", "auto")
    if m not in ("auto", "flex", "gather"):
        raise ValueError(f"JOBRUNNER_CPU_DECODE={m!r}: expected auto, flex or gather")
    return m


def key_for(q, k_cache, softcap) -> Key:
    hq, (_, bs, hk, d) = q.shape[1], k_cache.shape
    return Key(str(q.dtype).removeprefix("torch."), hk, hq // hk, d, bs, float(softcap or 0.0))


def decode_attention_cpu(q, k_cache, v_cache, mask: DecodeMask, scale: float, softcap: float | None,
                         runner) -> torch.Tensor:
    """q: [B, Hq, D] decode rows -> [B, Hq, D], through a loaded package's runner."""
    B, hq, d = q.shape
    hk = k_cache.shape[2]
    qs = (q * scale).view(B, hk, hq // hk, d)                                         # contiguous, prescaled
    with torch.profiler.record_function("cpu_attention.decode (package)"):     # the profiler can't see into it
        return runner([qs, k_cache, v_cache, *mask.inputs()]).view(B, hq, d)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.cpu_attention",
                                description="Build the in-place CPU decode attention package for one shape.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("dtype", choices=["float32", "bfloat16", "float16"])
    for name in ("kv_heads", "group", "head_dim", "block_size"):
        b.add_argument(name, type=int)
    b.add_argument("--softcap", type=float, default=0.0, help="the model's attention soft-cap (0: none)")
    a = p.parse_args(argv)
    os.nice(19)                      # idle cycles only: the job that asked for the build goes first
    key = Key(a.dtype, a.kv_heads, a.group, a.head_dim, a.block_size, a.softcap)
    t0 = time.perf_counter()
    try:
        build(key, key.path())
    finally:
        key.path().with_suffix(".building").unlink(missing_ok=True)
    print(f"built {key.path()} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
