"""Result cache keys: a hash of everything that determines a request's result, nothing else.

A key is blake2b-128 over (the model key, the request's description). The model key covers the
checkpoint's content (jobrunner/cache/identity.py) and the numeric mode (dtype, quantization, KV
cache dtype, device type, torch's version, packed CPU weights, batch invariance, engine.numerics.NUMERICS_VERSION). The request's
description is every field of engine.request.Request but its id and its prompt text (kept for the
output only), plus the job kind: the prompt's token ids, the sampling parameters (seed included),
the kind's inputs (classify's candidates, score's score_from), a LoRA adapter's content hash, and any field a later change adds
(a constraint: one more Request field is keyed with no change here). Never the row id or the
dataset path. A request's images by their keys (engine.ImageInput.key: a hash of the prepared pixels and
grid), offsets and lengths, never their pixels; a request without images is keyed exactly as before images
existed (its key bytes unchanged: caches written then still serve it).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
from array import array
from collections.abc import Mapping
from dataclasses import asdict, fields, is_dataclass

from jobrunner import engine
from jobrunner.engine import Constraint, EngineInfo, Request, SamplingParams
from jobrunner.cache.identity import checkpoint_identity

log = logging.getLogger("jobrunner")

KEY_BYTES = 16
# Request fields that never change a result: the row id, and the prompt text (the token ids decide).
NOT_KEYED = frozenset({"id", "prompt", "prompt_token_ids", "images"})     # token ids, images: keyed apart


def is_deterministic(req: Request) -> bool:
    """Whether equal requests give equal results: scoring (nothing sampled), greedy, or seeded.
    A row sampled without a seed draws from its row id, so its copies differ: never reused."""
    sp = req.sampling
    return req.candidates is not None or req.score_from is not None or sp.temperature == 0 or sp.seed is not None


def model_key(checkpoint: dict, numeric_mode: dict) -> bytes:
    """The model's part of every key: its checkpoint identity and the engine's numeric mode (the engine's
    NUMERICS_VERSION, read at each call)."""
    text = _canonical({"checkpoint": checkpoint, "numerics": {**numeric_mode, "version": engine.NUMERICS_VERSION}})
    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


def job_model_key(model: str, info: EngineInfo, quantization: str, kv_cache_dtype: str) -> bytes | None:
    """The model's part of every cache key (checkpoint content and numeric mode); None, with a
    warning, when the checkpoint cannot be identified (then nothing is cached)."""
    import torch        # its version is in the numeric mode: loaded only for a job with a cache

    try:
        checkpoint = checkpoint_identity(model)
    except Exception as e:  # noqa: BLE001 - an unidentifiable model is never cached, never fatal
        log.warning("result cache off: cannot identify the model %s (%s)", model, e)
        return None
    numeric_mode = {"dtype": info.dtype, "kv_dtype": info.kv_dtype, "kv_cache_dtype": kv_cache_dtype,
                    "quantization": quantization, "device": info.device_type,
                    "torch": ".".join(torch.__version__.split(".")[:2])}
    if info.packed_weights:     # another summation order; keys of the F.linear path stay as they were
        numeric_mode["packed_weights"] = True
    if info.batch_invariant:    # another summation order (engine/run/batch_invariance.py); off: keys as before
        numeric_mode["batch_invariant"] = True
    return model_key(checkpoint, numeric_mode)


def request_key(model: bytes, kind: str, req: Request, adapters: Mapping[str, str] | None = None) -> bytes:
    """The cache key of `req` run by the model `model` (model_key) in a job of `kind`; a LoRA adapter is
    keyed by its content hash (`adapters`: name -> hash), never its name."""
    h = hashlib.blake2b(model, digest_size=KEY_BYTES)
    tokens = array("I", req.prompt_token_ids).tobytes()
    h.update(len(tokens).to_bytes(8, "little"))
    h.update(tokens)
    h.update(_sampling_text(req.sampling).encode())
    rest = {f.name: getattr(req, f.name) for f in fields(req) if f.name not in NOT_KEYED and f.name != "sampling"}
    if req.adapter is not None:
        rest["adapter"] = adapters[req.adapter]
    if req.images:          # absent without images: a text request's key is as it always was
        rest["images"] = [[im.key, im.offset, im.length] for im in req.images]
    h.update(_canonical({"kind": kind, **rest}).encode())
    return h.digest()


@functools.lru_cache(maxsize=256)
def _sampling_text(sp: SamplingParams) -> str:
    """Most rows share one SamplingParams (frozen, hashable): serialize it once."""
    return _canonical(asdict(sp))


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_plain)


def _plain(o):
    if isinstance(o, Constraint):       # `reasoning` keyed only when set: keys made before it existed still hit
        return {k: v for k, v in asdict(o).items() if not (k == "reasoning" and v is None)}
    if is_dataclass(o) and not isinstance(o, type):
        return asdict(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if isinstance(o, (bytes, bytearray)):
        return o.hex()
    raise TypeError(f"cannot key a {type(o).__name__}")
