"""Where the in-place CPU decode attention (kernels/attention/cpu_attention.py and .c) is compiled, kept and loaded:
the process side of a kernel that kernels/ keeps as plain functions.

The library is kept under <cache>/kernels/<cpu>/ (<cache>: engine.config.cache_root, the one cache-directory
rule; <cpu>: the CPU's flags, since it is compiled with -march=native), its name a hash of the source and the
flags. The first engine on CPU that decodes builds it with the system's C compiler ($CC, else cc), which takes
about a second, to a temporary name, then renames it: a library file is whole, and two processes building at
once both succeed. Where no compiler works, one warning says so and decode attention gathers (the reference).

JOBRUNNER_CPU_DECODE: auto (the kernel when it builds, the default) or gather (the reference only); read at each
call, so a caller can change it for a block.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shlex
import subprocess
from pathlib import Path

import torch

from jobrunner.engine.config.engine_config import cache_root
from jobrunner.kernels.ops import DecodeLibrary, compile_command, library_name

MODES = ("auto", "gather")
BUILD_TIMEOUT_S = 120
log = logging.getLogger("jobrunner")


def env_mode(name: str, modes: tuple[str, ...]) -> str:
    """The environment's choice among `modes` (the first when unset); ValueError naming the others."""
    m = os.environ.get(name, modes[0])
    if m not in modes:
        raise ValueError(f"{name}={m!r}: expected {', '.join(modes[:-1])} or {modes[-1]}")
    return m


def decode_mode() -> str:
    return env_mode("JOBRUNNER_CPU_DECODE", MODES)


def library_path() -> Path:
    return cache_root() / "kernels" / _cpu_tag() / library_name()


def _cpu_tag() -> str:
    """The CPU a library was compiled for (-march=native): a cache shared with another CPU must not hand it
    this one's build (illegal instructions)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    digest = hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:8]
    return f"{torch.backends.cpu.get_cpu_capability()}-{digest}"


def build_library(path: Path, command=compile_command) -> None:
    """Compiles the kernel to a temporary name beside path, then renames it. Raises RuntimeError with the
    compiler's message when it fails. command(cc, output) -> argv: the decode attention's by default (the int4
    and int8 matmuls': engine/run/cpu_kernel_build.py)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.so")
    cc = shlex.split(os.environ.get("CC") or "cc")
    try:
        done = subprocess.run(command(cc, tmp), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"{' '.join(cc)}: {e}") from e
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(cc)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    os.replace(tmp, path)


def ensure_library() -> Path:
    """The library's path, built first if absent."""
    path = library_path()
    if not path.exists():
        build_library(path)
    return path


class DecodeKernels:
    """One engine's side of the kernel (kernels.cpu_attention.CpuDecode): built or found, loaded once; set
    aside for good after a failure."""

    def __init__(self):
        self.loaded: DecodeLibrary | None = None
        self.failed = False

    def library(self) -> DecodeLibrary | None:
        if decode_mode() == "gather" or self.failed:
            return None
        if self.loaded is None:
            try:
                self.loaded = DecodeLibrary(ensure_library())
            except Exception as e:   # noqa: BLE001 - no compiler, a compile error, a library this OS can't load
                log.warning("the in-place CPU decode attention is not available (%s); decode attention gathers "
                            "the KV blocks at every step instead (slower, same results)", e)
                self.failed = True
                return None
        return self.loaded

    def set_aside(self, error: Exception) -> None:
        log.warning("the in-place CPU decode attention failed (%s); decode attention gathers instead", error)
        self.loaded, self.failed = None, True
