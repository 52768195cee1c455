"""`--quantization auto`: the fastest numeric mode whose perplexity stays within 1% of float32's.

On CPU the choice is measured, once per model and machine (jobrunner/pipeline/calibration.py: each mode's
perplexity on a fixed text and its decode tokens/s, cached under the engine's cache). This module holds
the machine's facts (its CPU's name and flags, its GPUs) and the rule by flags alone, which stands in
where nothing is measured: `JOBRUNNER_CALIBRATION=off`, a dry resolve (`jobrunner validate`) before
the first calibration, the ranks of a torchrun job. The flag rule rests on the default model's figures
(benchmarks/RESULTS.md, issues 20 and 34; `python -m benchmarks.quant_report`): bfloat16 compute costs
+0.2% perplexity and, on CPUs with AMX or AVX512_BF16, runs a job 2.1-2.2x faster than float32; w8a8
costs +0.8% and runs 1.7-2.8x faster on CPUs with VNNI (int8 dot products: torch._int_mm, or fbgemm
with row scales); on AVX2 alone fbgemm's 7-bit activations cost +5.9%, so float32 is the choice there.
Another model or machine may fall either side of the 1%: that is why the measurement decides.
GGUF blocks as shipped times int8 activations (llama.cpp's Q4_1 x Q8_1) is the w4a8 candidate where the
weights ship 4-bit: our own C kernel (kernels/matmul/cpu_w4a8.c, VNNI int8 dot products; no maintained CPU
kernel for it is on PyPI, and torch's paths ran it 1.3-100x slower than float32, issue 20 item 3). On a GPU the
model's own dtype (bfloat16) already is the fast path: nothing more is chosen. The default stays exact
(float32 on CPU): auto is asked for, never assumed.
"""
from __future__ import annotations

from functools import lru_cache

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
VNNI_FLAGS = ("avx512_vnni", "avx_vnni")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@lru_cache(maxsize=1)
def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), "" where it is not said."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cuda_count(device: str) -> int:
    """The CUDA GPUs visible to a job on `device` (0 for cpu or mps, or without a usable CUDA)."""
    if not (device == "auto" or device.startswith("cuda")):
        return 0
    try:
        import torch        # only to count GPUs, when a job asks: importing jobrunner loads no torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable CUDA: CPU
        return 0


def on_gpu(device: str) -> bool:
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    return cuda_count(device) > 0


def measures(device: str, dtype: str) -> bool:
    """Whether auto is decided by measurement (a CPU, the dtype left to auto); else auto_precision's rule."""
    return not on_gpu(device) and dtype == "auto"


def auto_precision(device: str, dtype: str) -> tuple[str, str, str]:
    """(dtype, quantization, why) for `--quantization auto` by the CPU's flags alone (the module doc); a
    GPU keeps the model's dtype, a dtype the user chose is kept."""
    if on_gpu(device):
        return dtype, "none", "GPU: the model's 16-bit dtype"
    if dtype != "auto":
        return dtype, "none", f"--dtype {dtype} chosen"
    flags = cpu_flags()
    if any(f in flags for f in BF16_FLAGS):
        return "bfloat16", "none", "CPU with AMX/AVX512_BF16: bfloat16 compute"
    if any(f in flags for f in VNNI_FLAGS):
        return "auto", "w8a8", "CPU with VNNI: int8 weights and activations"
    return "auto", "none", "CPU without bf16 or int8 dot products: float32"
