"""Where the in-place CPU decode attention's packages (kernels/cpu_attention.py) live, when one is built,
and by whom: the process side of a kernel that kernels/ keeps as plain functions.

Packages are kept under <cache>/kernels/torch-<version>-<cpu>/ (<cache>: engine.config.cache_root, the
one cache-directory rule), one per (torch version, CPU, dtype, heads, head_dim, block size, soft-cap);
building one takes one to several minutes. `jobrunner warmup` builds it in the foreground (mode flex,
below). A job never builds it on the cores it runs on (its threads already take every core a 2-core
machine has: a background build there cost the first job minutes at 1-2 tokens/s); it loads a package
that is there, else the gather reference serves and one line says how to build it. bfloat16 caches
always gather (GATHER_DTYPES: faster there).

JOBRUNNER_CPU_DECODE: auto (that policy, the default), flex (build now, in this process's wait, if
absent: warmup and benchmarks), gather (the reference only). JOBRUNNER_CPU_DECODE_BUILD_AFTER: seconds
of gather-path decode after which a job does start a build in a child at nice 19 (opt-in, for machines
with idle cores; default inf: never). Both are read at each call, so a caller can change them for a block.

    python -m engine.cpu_decode build float32 3 3 64 16     # the child's command line (one shape)
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from engine.config import cache_root
from kernels import DecodeKey, compile_decode_package, load_decode_package

BUILD_AFTER_S = float("inf")   # seconds of gather-path decode attention before a job builds the package:
                               # never by default (`jobrunner warmup` does); $JOBRUNNER_CPU_DECODE_BUILD_AFTER opts in
MODES = ("auto", "flex", "gather")
# bfloat16 caches decode faster through the gather path: its SDPA runs bfloat16 natively, the package does
# not (a 64-sequence decode step at ~224 tokens, default model, AMX CPU: 116 ms gather, 167 ms package;
# benchmarks/RESULTS.md, issue 34). No package is built, loaded or suggested for them.
GATHER_DTYPES = frozenset({"bfloat16"})
log = logging.getLogger("jobrunner")


def decode_mode() -> str:
    m = os.environ.get("JOBRUNNER_CPU_DECODE", "auto")
    if m not in MODES:
        raise ValueError(f"JOBRUNNER_CPU_DECODE={m!r}: expected auto, flex or gather")
    return m


def package_path(key: DecodeKey) -> Path:
    return cache_root() / "kernels" / f"torch-{torch.__version__}-{_cpu_tag()}" / key.file_name()


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


def build_package(key: DecodeKey, path: Path) -> None:
    """Compiles key's package to a temporary name beside path, then renames it: a package file is whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.pt2")
    compile_decode_package(key, tmp)
    os.replace(tmp, path)


class DecodeKernels:
    """One engine's side of the kernel (kernels.cpu_attention.CpuDecode): each key's runner once loaded,
    the child building it, and the seconds the gather path has spent on decode attention."""

    def __init__(self):
        self.runners: dict[DecodeKey, object] = {}        # key -> the loaded package's runner
        self.children: dict[DecodeKey, subprocess.Popen | None] = {}
        self.failed: set[DecodeKey] = set()
        self.gather_s = 0.0
        self._next_look = 0.0
        self.hinted = False          # the "jobrunner warmup" line is logged once

    def runner(self, key: DecodeKey):
        mode = decode_mode()
        if mode == "gather" or key in self.failed or key.dtype in GATHER_DTYPES:
            return None
        if key in self.runners:
            return self.runners[key]
        path = package_path(key)
        if mode == "flex" and not path.exists():
            build_package(key, path)
        now = time.monotonic()
        if mode == "flex" or now >= self._next_look:
            self._next_look = now + 1.0                      # a stat a second at most, not one per layer
            child = self.children.get(key)
            if child is not None and child.poll() not in (None, 0):
                self.failed.add(key)
                return None
            if path.exists():
                try:
                    self.runners[key] = load_decode_package(path)
                except Exception as e:                       # a package this torch can't load: stay on gather
                    log.warning("engine.cpu_decode: cannot load %s: %s", path, e)
                    self.failed.add(key)
                    return None
                return self.runners[key]
        return None

    def set_aside(self, key: DecodeKey, error: Exception) -> None:
        log.warning("engine.cpu_decode: the package for %s failed (%s); decode attention gathers instead",
                    key, error)
        self.runners.pop(key, None)
        self.failed.add(key)

    def note_gather(self, key: DecodeKey, seconds: float) -> None:
        """Counts gather-path decode time (mode auto); past BUILD_AFTER_S starts the build in a child."""
        if decode_mode() != "auto" or key.dtype in GATHER_DTYPES:
            return
        self.gather_s += seconds
        after = float(os.environ.get("JOBRUNNER_CPU_DECODE_BUILD_AFTER", BUILD_AFTER_S))
        if not self.hinted and key not in self.failed and after == float("inf"):
            self.hinted = True
            log.info("decode attention gathers the KV blocks at every step; `jobrunner warmup` builds the "
                     "in-place CPU kernel for this model once (0.4x the attention time)")
        if self.gather_s < after or key in self.children or key in self.failed:
            return
        self.children[key] = _start_build(key)


def _start_build(key: DecodeKey) -> subprocess.Popen | None:
    """A child at nice 19 building key's package; None when it is there or another process builds it."""
    path = package_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_suffix(".building")                 # the builder's pid, while it runs
    if path.exists() or not _take(lock):
        return None
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    args = [sys.executable, "-m", "engine.cpu_decode", "build", key.dtype, str(key.kv_heads),
            str(key.group), str(key.head_dim), str(key.block_size), "--softcap", str(key.softcap)]
    # a session of its own: the build (about a minute) outlives a job that ends first, and stays out of
    # its signals; it lowers its own priority (nice 19) first thing
    with open(path.with_suffix(".log"), "w") as out:
        child = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                 start_new_session=True)
    lock.write_text(str(child.pid))
    log.info("engine.cpu_decode: building the in-place CPU decode attention once (about a minute, at "
             "low priority) into %s", path)
    return child


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.cpu_decode",
                                description="Build the in-place CPU decode attention package for one shape.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("dtype", choices=["float32", "bfloat16", "float16"])
    for name in ("kv_heads", "group", "head_dim", "block_size"):
        b.add_argument(name, type=int)
    b.add_argument("--softcap", type=float, default=0.0, help="the model's attention soft-cap (0: none)")
    a = p.parse_args(argv)
    os.nice(19)                      # idle cycles only: the job that asked for the build goes first
    key = DecodeKey(a.dtype, a.kv_heads, a.group, a.head_dim, a.block_size, a.softcap)
    path = package_path(key)
    t0 = time.perf_counter()
    try:
        build_package(key, path)
    finally:
        path.with_suffix(".building").unlink(missing_ok=True)
    print(f"built {path} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
