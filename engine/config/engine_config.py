"""Engine configuration: one frozen dataclass built once by the caller, and the choices its
fields take (the CLI offers these same tuples)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

QUANTIZATIONS = ("none", "int8", "int4", "w8a8", "w4a8", "fp8")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
SPECULATIVE_MODES = ("off", "ngram", "draft", "auto")   # engine/spec: drafts from each row's own tokens or a
                                                         # draft model; auto where they pay
CPU_KV_CACHE_BYTES = 2 * 1024**3  # fixed CPU budget (about 46k tokens of the default model); GPUs size from free memory


@dataclass(frozen=True)
class EngineConfig:
    model: str                          # local path or fsspec URL of a checkpoint (HF directory or .gguf),
                                        # or "dummy:<name or config.json>" (random weights); no names
    dtype: str = "auto"                 # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"                # auto | cpu | cuda | cuda:N
    quantization: str = "none"          # one of QUANTIZATIONS
    kv_cache_dtype: str = "auto"        # one of KV_CACHE_DTYPES
    kv_cache_memory: int | None = None  # bytes; None: a share of free GPU memory, or CPU_KV_CACHE_BYTES
    gpu_memory_share: float = 0.85
    block_size: int = 16
    max_num_seqs: int | None = None             # None: by device (engine/run/runtime.py: BATCH_LIMITS)
    max_num_batched_tokens: int | None = None   # per-step token budget (decodes + prefill chunks); None: by device
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True            # on CUDA, replay captured graphs for pure-decode steps
    async_scheduling: bool = True       # schedule step k+1 while step k runs (engine/core/engine.py)
    num_threads: int | None = None      # CPU intra-op threads; None: torch's default
    packed_weights: bool = True         # on CPU, float32/bfloat16 linears over weights packed once for oneDNN
                                        # (float32 not bit-exact against F.linear: engine/run/packed_weights.py)
    batch_invariant: bool = False       # a row's results bit-identical whatever shares its steps, on CPU
                                        # (engine/run/batch_invariance.py: how, and what it does not cover)
    speculative: str = "off"            # off | ngram | auto: draft from each row's own tokens (engine/spec);
    num_speculative_tokens: int = 4     # auto where it pays by measurement; at most this many drafted a step
    draft_model: str | None = None      # speculative "draft" (or "auto"): a smaller model of the same vocabulary
                                        # drafts (its local path, as `model`); else drafts are n-gram lookups
    seed: int = 0
    grammar_timeout_s: float = 30.0     # structured output: a constraint's compile time at most (engine/sample/constraints.py)
    tensor_parallel: int = 1            # ranks (devices, processes) one engine spans (engine/parallel)
    moe_split: str = "auto"             # tensor parallelism: routed experts split by experts or by columns
                                        # (auto: by the layer's shape, engine/parallel/shards.py)
    loras: tuple[tuple[str, str], ...] = ()   # (name, local PEFT adapter directory): Request.adapter picks one
    max_loras: int | None = None        # adapters resident on the device at once (None: all); the rest wait on the host


class ConfigError(ValueError):
    """A configuration that cannot work; the message says what to change."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The local cache directory: the argument, else $JOBRUNNER_CACHE, else ~/.cache/jobrunner.
    The engine copies remote checkpoints under <cache>/remote/ (engine.loader); the CLI keeps the
    known models it fetches beside them (jobrunner.models)."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("JOBRUNNER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "jobrunner"
