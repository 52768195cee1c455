"""The engine's public face: what the layers above (jobs, jobrunner) may use; they import no
engine submodule (an import-linter contract in pyproject.toml).

    from engine import Engine, EngineConfig, Request, SamplingParams
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

from engine.config import CPU_KV_CACHE_BYTES, KV_CACHE_DTYPES, QUANTIZATIONS, ConfigError, EngineConfig, cache_root
from engine.counters import EngineCounters
from engine.embedding_config import CheckpointPooling
from engine.errors import EngineFailure, ModelError
from engine.generation_config import SAMPLING_KEYS, GenerationDefaults
from engine.info import EngineInfo, Tokenizer
from engine.kv_manager import common_prefix
from engine.lora.adapter import AdapterSpec, check_adapter
from engine.numerics import NUMERICS_VERSION
from engine.request import (CONSTRAINT_KINDS, POOLINGS, Completion, Constraint, EmbedParams, ImageInput, Request,
                            RequestOutput, SamplingParams, TokenLogprob)
from engine.sequence import last_index_of

if TYPE_CHECKING:
    from engine.constraints import check_constraint
    from engine.engine import Engine
    from engine.loader import DUMMY_CONFIGS, checkpoint_quantization, load_model_bundle
    from engine.parallel.shards import check_split, rank_plan
    from engine.vision.processor import ImageProcessor, PreparedImage, image_key, load_image_processor

# name -> the module that defines it, imported when the name is first read
_LAZY = {
    "Engine": "engine.engine",
    "DUMMY_CONFIGS": "engine.loader",
    "load_model_bundle": "engine.loader",
    "checkpoint_quantization": "engine.loader",
    "check_constraint": "engine.constraints",
    "check_split": "engine.parallel.shards",
    "rank_plan": "engine.parallel.shards",
    # numpy and PIL, no torch: loaded on first use all the same (PIL costs a text job's start-up)
    "ImageProcessor": "engine.vision.processor",
    "PreparedImage": "engine.vision.processor",
    "image_key": "engine.vision.processor",
    "load_image_processor": "engine.vision.processor",
}

__all__ = ["AdapterSpec", "check_adapter", "CONSTRAINT_KINDS", "CPU_KV_CACHE_BYTES", "KV_CACHE_DTYPES", "NUMERICS_VERSION", "POOLINGS", "QUANTIZATIONS",
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
