"""Results reused instead of computed, for one job: copies of a row within the job (dedup.py) and
the result cache across runs (jobrunner/cache/).

Only deterministic requests are keyed (cache.key.is_deterministic): a row sampled without a seed
is always computed. A row whose result is reused keeps the token counts of the computation that
made it; the job's stats count it in rows_reused (a copy of another row) or rows_from_cache, and
its prompt and completion tokens in tokens_saved.
"""
from __future__ import annotations

import logging
import time

from jobrunner.engine import RequestOutput
from jobrunner.cache.codec import decode_output, encode_output
from jobrunner.cache.key import is_deterministic, request_key
from jobrunner.cache.dedup import Dedup

log = logging.getLogger("jobrunner")
LOOKUP_ROWS = 16_384    # rows looked up in the result cache together (jobrunner/cache/store.py: the cost)


class Reuse:
    def __init__(self, stats, kind: str, *, dedup: bool, window_rows: int, store=None, mode: str = "read-write",
                 model: bytes | None = None, adapters: dict[str, str] | None = None):
        self.stats, self.kind = stats, kind
        self.adapters = adapters or {}      # LoRA adapter name -> content hash: keys hash the content, not the name
        self.dedup = Dedup(window_rows) if dedup else None
        self.store = store if model is not None else None
        self.model = model or b""           # dedup alone: one job, one model
        self.read = self.store is not None and mode in ("read-write", "read-only")
        self.write = self.store is not None and mode in ("read-write", "write-only", "refresh")
        self.keys: dict[str, bytes] = {}    # row id -> key: keyed rows admitted, not finished
        self.batch_rows = LOOKUP_ROWS if self.read else 1      # rows a job holds back for one lookup
        self.held: dict[str, RequestOutput] = {}        # row id -> hit, until its unit is claimed (data-parallel)

    def admit(self, row, req, notes=None) -> tuple[bool, RequestOutput | None]:
        """(runs, result) for a row, its request and the kind's notes on it (a copy keeps its own): see
        Dedup.admit. Call before packing the prompt."""
        if (self.dedup is None and self.store is None) or not is_deterministic(req):
            return True, None
        key = request_key(self.model, self.kind, req, self.adapters)
        if self.dedup is not None:
            runs, result = self.dedup.admit(row, key, notes)
            if not runs:
                if result is not None:
                    self._saved(result, copy=True)
                return False, result
        self.keys[row.id] = key
        return True, None

    def fetch(self, ids: list[str]) -> dict[str, RequestOutput]:
        """Row id -> its result from the cache, for the keyed rows among ids that it holds."""
        keyed = [(i, self.keys[i]) for i in ids if i in self.keys] if self.read else []
        if not keyed:
            return {}
        start, cpu = time.perf_counter(), time.process_time()
        self.stats.cache_lookups += len(keyed)
        found = self.store.get_many([k for _, k in keyed])
        out = {}
        for i, k in keyed:
            if k in found:
                try:
                    out[i] = decode_output(found[k], i)
                except (ValueError, TypeError, KeyError) as e:
                    log.warning("result cache: an entry does not decode (%s); recomputing its row", e)
        self.stats.cache_lookup_s += time.perf_counter() - start
        self.stats.cache_lookup_cpu_s += time.process_time() - cpu
        return out

    def hold(self, row_id: str, out: RequestOutput) -> None:
        self.held[row_id] = out

    def take(self, ids: list[str]) -> dict[str, RequestOutput]:
        """The held hits among ids (a claimed unit's rows)."""
        if not self.held:
            return {}
        return {i: self.held.pop(i) for i in ids if i in self.held}

    def adopt(self, pending, copies) -> None:
        """A leader planned in another process (a Ray job's driver; a job.pending.PendingRow) and the
        copies it found for it, as (row, notes): the result cache gets the leader's result, the copies
        get it too (not matched again here)."""
        if self.store is not None and is_deterministic(pending.request):
            self.keys[pending.id] = request_key(self.model, self.kind, pending.keyed_request(), self.adapters)
        if copies:
            self.dedup.waiting[pending.id] = list(copies)

    def release(self, row_id: str) -> list:
        """A leader that another process runs, with the copies waiting for it (returned); later copies
        of its request lead anew (computed once more: its result never comes back here)."""
        key = self.keys.pop(row_id, None)
        return self.dedup.release(row_id, key) if self.dedup is not None else []

    def finished(self, row_id: str, out: RequestOutput, from_cache: bool = False) -> list:
        """A leader's result (computed or from the cache): stores it, and returns the copies waiting for
        it, each as (row, its notes)."""
        key = self.keys.pop(row_id, None)
        if from_cache:
            self.stats.rows_from_cache += 1
            self._saved(out)
        elif key is not None and self.write and out.error is None:
            self.store.put(key, encode_output(out))
        copies = self.dedup.finish(row_id, out) if self.dedup is not None else []
        for _ in copies:
            self._saved(out, copy=True)
        return copies

    def drop(self, row_id: str) -> None:
        """A row another worker runs."""
        self.keys.pop(row_id, None)
        self.held.pop(row_id, None)
        if self.dedup is not None:
            self.dedup.drop(row_id)

    def close(self) -> None:
        """Store what is buffered (also after an interruption: it was computed)."""
        if self.write:
            self.store.flush()

    def _saved(self, out: RequestOutput, copy: bool = False) -> None:
        if copy:
            self.stats.rows_reused += 1
        self.stats.tokens_saved += out.prompt_tokens + out.completion_tokens
