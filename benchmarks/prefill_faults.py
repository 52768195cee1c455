"""Page faults and system time of CPU prefill steps: the C heap kept (engine/run/host_memory.py) or glibc's defaults.

    python -m benchmarks.prefill_faults                      # the engine as it runs
    python -m benchmarks.prefill_faults --glibc-defaults     # the heap left to glibc
    python -m benchmarks.prefill_faults --populate           # the KV pool touched first (isolates the heap)

Each step is one fresh --chunk-token prompt (its own KV blocks); the figures come from getrusage
around engine.step(). --populate writes the whole pool first with MADV_POPULATE_WRITE (Linux 5.14+),
so that the first touch of the pool's pages (RESULTS.md: ~100 MB/s on a VM whose host backs memory
lazily) stays out of the steps.
"""
from __future__ import annotations

import argparse
import ctypes
import resource
import time

MADV_POPULATE_WRITE = 23


def populate(tensors) -> float:
    """Faults every page of the tensors in; seconds taken."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    t = time.perf_counter()
    for x in tensors:
        start, end = (x.data_ptr() + 4095) & ~4095, (x.data_ptr() + x.nbytes) & ~4095
        if libc.madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")
    return time.perf_counter() - t


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", default="smollm2-135m-instruct")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--glibc-defaults", action="store_true", help="don't keep the C heap (engine/run/host_memory.py)")
    p.add_argument("--populate", action="store_true", help="touch the whole KV pool before the steps")
    args = p.parse_args(argv)

    from benchmarks.step_profile import _requests
    from jobrunner.engine.run import host_memory
    from jobrunner.engine.config.engine_config import EngineConfig
    from jobrunner.engine.core.engine import Engine
    from jobrunner.models.known import resolve_model
    if args.glibc_defaults:
        host_memory.hold = lambda: False
    engine = Engine(EngineConfig(model=resolve_model(args.model), device="cpu", num_threads=args.threads,
                                 max_num_batched_tokens=args.chunk))
    try:
        if args.populate:
            caches = [t for layer in engine.runner.kv_caches for t in layer]
            print(f"populated the KV pool ({sum(t.nbytes for t in caches) >> 20} MiB) in {populate(caches):.2f} s")
        vocab = engine.rt.model_config.vocab_size
        print("| step | wall s | user s | system s | minor faults |\n|---|---|---|---|---|")
        for k in range(args.steps):
            for r in _requests(1, args.chunk, 1, vocab, 100 + k):
                engine.add_request(r)
            before, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            engine.step()
            wall, after = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
            print(f"| {k} | {wall:.2f} | {after.ru_utime - before.ru_utime:.2f} | "
                  f"{after.ru_stime - before.ru_stime:.2f} | {after.ru_minflt - before.ru_minflt} |", flush=True)
            while engine.has_unfinished():
                engine.step()
    finally:
        engine.close()


if __name__ == "__main__":
    main()
