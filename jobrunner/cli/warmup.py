"""`jobrunner warmup`: what a first job would otherwise pay for, paid once in the foreground.

On CPU that is the in-place decode attention package (engine/cpu_decode.py: minutes of compiling,
once per torch version, CPU and model shape) and a small GGUF's float32 conversion (engine/float_cache.py).
A job never builds the package on the cores it runs on; it uses one that is there, else the gather path.
Idempotent: a second warmup finds both in the cache and takes seconds.
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager

from engine import Request, SamplingParams
from jobrunner.config.job import JobConfig
from jobrunner.job import build      # build.load_engine, read at each call (tests replace it)
from jobrunner.job.resolve import resolve_engine
from jobrunner.models import describe

log = logging.getLogger("jobrunner")


@contextmanager
def _decode_mode(mode: str):
    """JOBRUNNER_CPU_DECODE for the block (the kernels read it at each call), restored after."""
    old = os.environ.get("JOBRUNNER_CPU_DECODE")
    os.environ["JOBRUNNER_CPU_DECODE"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("JOBRUNNER_CPU_DECODE", None)
        else:
            os.environ["JOBRUNNER_CPU_DECODE"] = old


def warmup(cfg: JobConfig) -> dict:
    """Loads the job's model (converting it once if it needs converting) and, on CPU, decodes two tokens
    with the in-place attention asked for, which builds its package when absent. Returns the figures."""
    t0 = time.perf_counter()
    engine = build.load_engine(cfg, resolve_engine(cfg))
    try:
        loaded = time.perf_counter() - t0
        info = engine.info
        figures = {"model": describe(cfg.engine.model, info.source), "device": info.device, "load_s": round(loaded, 1)}
        if info.device_type != "cpu" or os.environ.get("JOBRUNNER_CPU_DECODE") == "gather":
            return figures
        log.info("building the in-place CPU decode attention for this model if it is not built yet "
                 "(minutes, once per torch version, CPU and model shape)")
        t1 = time.perf_counter()
        ids = engine.tokenizer.encode_batch(["warm up"], add_special_tokens=True)[0]
        with _decode_mode("flex"):
            engine.add_request(Request("warmup", ids, SamplingParams(max_tokens=2, temperature=0.0)))
            while engine.has_unfinished():
                engine.step()
        figures["decode_kernel_s"] = round(time.perf_counter() - t1, 1)
        return figures
    finally:
        engine.close()
