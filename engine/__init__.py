"""The engine's public face: what the layers above (jobs, jobrunner) may use; they import no
engine submodule (an import-linter contract in pyproject.toml).

    from jobrunner.engine import Engine, EngineConfig, Request, SamplingParams
    engine = Engine(EngineConfig(model="dummy:tiny"))
    outputs = engine.generate([Request("a", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4))])
    engine.info.max_model_len, engine.counters().generated_tokens

Importing this package loads no torch: the names below are torch-free, and the ones that need torch
(the Engine, the loader, tensor-parallel plans, grammar checks) load on first use (PEP 562).
jobs/ must stay free of torch; tests/test_engine_face.py checks both.
"""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from jobrunner.engine.config.engine_config import CPU_KV_CACHE_BYTES, KV_CACHE_DTYPES, QUANTIZATIONS, SPECULATIVE_MODES, ConfigError, EngineConfig, cache_root
from jobrunner.engine.api.counters import EngineCounters
from jobrunner.engine.config.embedding import CheckpointPooling
from jobrunner.engine.api.errors import EngineFailure, ModelError
from jobrunner.engine.config.generation import SAMPLING_KEYS, GenerationDefaults
from jobrunner.engine.api.info import EngineInfo, Tokenizer
from jobrunner.engine.schedule.kv_manager import common_prefix
from jobrunner.engine.lora.adapter import AdapterSpec, check_adapter
from jobrunner.engine.config.numerics import NUMERICS_VERSION
from jobrunner.engine.api.request import CONSTRAINT_KINDS, POOLINGS, Completion, Constraint, EmbedParams, ImageInput, Request, RequestOutput, SamplingParams, TokenLogprob
from jobrunner.engine.schedule.sequence import last_index_of

if TYPE_CHECKING:
    from jobrunner.engine.sample.constraints import check_constraint
    from jobrunner.engine.core.engine import Engine
    from jobrunner.engine.load.loader import DUMMY_CONFIGS, checkpoint_quantization, load_model_bundle, ships_int4
    from jobrunner.engine.load.hf_export import EXPORT_DTYPES, export_hf_dir
    from jobrunner.engine.parallel.shards import check_split, rank_plan
    from jobrunner.engine.vision.processor import ImageProcessor, PreparedImage, image_key, load_image_processor

# name -> the module that defines it, imported when the name is first read
_LAZY = {
    "Engine": "jobrunner.engine.core.engine",
    "DUMMY_CONFIGS": "jobrunner.engine.load.loader",
    "load_model_bundle": "jobrunner.engine.load.loader",
    "checkpoint_quantization": "jobrunner.engine.load.loader",
    "ships_int4": "jobrunner.engine.load.loader",
    "export_hf_dir": "jobrunner.engine.load.hf_export",
    "EXPORT_DTYPES": "jobrunner.engine.load.hf_export",
    "check_constraint": "jobrunner.engine.sample.constraints",
    "check_split": "jobrunner.engine.parallel.shards",
    "rank_plan": "jobrunner.engine.parallel.shards",
    # numpy and PIL, no torch: loaded on first use all the same (PIL costs a text job's start-up)
    "ImageProcessor": "jobrunner.engine.vision.processor",
    "PreparedImage": "jobrunner.engine.vision.processor",
    "image_key": "jobrunner.engine.vision.processor",
    "load_image_processor": "jobrunner.engine.vision.processor",
}

__all__ = ["AdapterSpec", "check_adapter", "CONSTRAINT_KINDS", "CPU_KV_CACHE_BYTES", "KV_CACHE_DTYPES", "NUMERICS_VERSION", "POOLINGS", "QUANTIZATIONS", "SPECULATIVE_MODES",
           "SAMPLING_KEYS", "CheckpointPooling", "Completion", "ConfigError", "Constraint", "EmbedParams",
           "EngineConfig", "EngineCounters", "EngineFailure", "EngineInfo", "GenerationDefaults", "ImageInput", "ModelError",
           "Request", "RequestOutput", "SamplingParams", "TokenLogprob", "Tokenizer", "cache_root", "common_prefix",
           "last_index_of",
           *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name]), name)
    globals()[name] = value         # read once: later reads find it here
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
