"""`jobrunner warmup`: what a first job would otherwise pay for, paid once in the foreground.

That is a small GGUF's float32 conversion (engine/load/float_cache.py: tens of seconds for the default model) and,
on CPU, the in-place decode attention's compile (engine/run/cpu_decode.py: about a second, once per CPU and
version of the kernel; a job that finds it absent builds it itself). Idempotent: a second warmup finds
both in the cache.
"""
from __future__ import annotations

import time

from jobrunner.engine import Request, SamplingParams
from jobrunner.config.job import JobConfig
from jobrunner.pipeline import build      # build.load_engine, read at each call (tests replace it)
from jobrunner.pipeline.resolve import resolve_engine
from jobrunner.models.known import describe


def warmup(cfg: JobConfig) -> dict:
    """Loads the job's model (converting it once if it needs converting) and, on CPU, decodes two tokens,
    which builds the in-place decode attention when absent. Returns the figures."""
    t0 = time.perf_counter()
    engine = build.load_engine(cfg, resolve_engine(cfg))
    try:
        loaded = time.perf_counter() - t0
        info = engine.info
        figures = {"model": describe(cfg.engine.model, info.source), "device": info.device, "load_s": round(loaded, 1)}
        if info.device_type != "cpu":
            return figures
        t1 = time.perf_counter()
        ids = engine.tokenizer.encode_batch(["warm up"], add_special_tokens=True)[0]
        engine.add_request(Request("warmup", ids, SamplingParams(max_tokens=2, temperature=0.0)))
        while engine.has_unfinished():
            engine.step()
        figures["decode_kernel_s"] = round(time.perf_counter() - t1, 1)
        return figures
    finally:
        engine.close()
