"""Engine configuration: one frozen dataclass built once by the caller."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m-instruct"
CPU_KV_CACHE_BYTES = 2 * 1024**3  # fixed CPU budget (about 46k tokens of the default model); GPUs size from free memory


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL          # known name, local path, fsspec URL, or "dummy:<config.json>"
    dtype: str = "auto"                 # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"                # auto | cpu | cuda | cuda:N
    quantization: str = "none"          # none | int8 | int4 | w8a8 | fp8
    kv_cache_dtype: str = "auto"        # auto | int8 | fp8
    kv_cache_memory: int | None = None  # bytes; None: a share of free GPU memory, or CPU_KV_CACHE_BYTES
    gpu_memory_share: float = 0.85
    block_size: int = 16
    max_num_seqs: int | None = None             # None: by device (engine/runtime.py: BATCH_LIMITS)
    max_num_batched_tokens: int | None = None   # per-step token budget (decodes + prefill chunks); None: by device
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True            # on CUDA, replay captured graphs for pure-decode steps
    async_scheduling: bool = True       # schedule step k+1 while step k runs (engine/engine.py)
    num_threads: int | None = None      # CPU intra-op threads; None: torch's default
    seed: int = 0


class ConfigError(ValueError):
    """A configuration that cannot work; the message says what to change."""
