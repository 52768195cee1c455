"""The CPU matmul kernels' libraries (engine/run/cpu_kernel_build.py's entries) built for real in a test session."""
from __future__ import annotations

from jobrunner.engine.run.cpu_decode import build_library
from jobrunner.engine.run.cpu_kernel_build import CpuMatmulKernel


def build_variants(kernel: CpuMatmulKernel, tmp_path_factory, variants=("native", "portable")) -> dict:
    """{variant: the loaded library}, each compiled into a temporary folder of its own (about a second a build)."""
    out = {}
    for variant in variants:
        path = tmp_path_factory.mktemp(f"{kernel.name}-{variant}") / kernel.library_name(variant)
        build_library(path, lambda cc, o, v=variant: kernel.compile_command(cc, o, v))
        out[variant] = kernel.load(path)
    return out
