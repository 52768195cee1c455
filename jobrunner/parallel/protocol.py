"""The store protocol: every key the coordinator and its workers share, who writes it and its JSON value.

    key                   written by     value
    loaded/<rank>         worker         engine loaded: {"device"}, or {"error": config error}
    round/<r>             coordinator    {"op": "run", "slots": {rank: slot}} or {"op": "stop", "exit_code"}
    r<r>/ready/<rank>     worker         its writer is open, so it has read the done ids:
                                         its manifest bar the config ({"model_source", "dataset_format",
                                         "hub", "sampling", ...}), or {"error": config error}
    r<r>/go               coordinator    {}: every member is ready; start claiming units
    r<r>/next_unit        workers        the work queue, a counter: add(key, 1) - 1 is the next ticket
    r<r>/progress/<rank>  worker         {"rows", "skipped", "failed", "tokens", "total"} so far, for the
                                         coordinator's progress line
    r<r>/result/<rank>    worker         {"rank", "slot", "round", "device", "exit_code", "summary", "error",
                                         "units", "run_s", "sketch"}: what parallel.stats.merge_stats reads
    abort                 coordinator    {"exit_code"}: give up, e.g. on a worker's config error
    hb/<rank>             worker         a counter its heartbeat bumps every few seconds (torchrun mode)
    exited                workers        a counter: each worker adds 1 as it acknowledges the end

The stores are torch.distributed's, made here (host_store, client_store, rendezvous_store): torch loads
once a job starts its workers, never when jobrunner.parallel is imported. Every key lives under one prefix
(`namespace`). Nobody else spells a key: each has its helpers here,
`set_*` for its writer and `get_*` (None while unset) or `wait_*` for its readers. A `wait_*` polls
until the key is set, and raises Stop on a signal or on `abort`.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta

from jobrunner.pipeline.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK  # noqa: F401 (EXIT_FAILED: imported from here)
STORE_TIMEOUT = timedelta(hours=2)


def _dist():
    """torch.distributed, imported at a store's first use (the one place jobrunner.parallel imports torch)."""
    import torch.distributed as dist
    return dist


def host_store(world: int):
    """The launcher's TCPStore, on a free loopback port (its `.port`), for `world` processes in all."""
    return _dist().TCPStore("127.0.0.1", 0, world, True, timeout=STORE_TIMEOUT, wait_for_workers=False)


def client_store(host: str, port: int, world: int):
    """A launched worker's client of the launcher's store (host_store)."""
    return _dist().TCPStore(host, port, world, False, timeout=STORE_TIMEOUT)


def rendezvous_store():
    """A torchrun rank's store (env://: rank 0's, or torchrun's agent's)."""
    store, _, _ = next(_dist().rendezvous("env://", timeout=STORE_TIMEOUT))
    return store


def namespace(store, attempt: str | None = None):
    """The job's keys inside `store`. Under torchrun, `attempt` is the restart count: torchrun's agent
    makes a fresh store per restart, and the attempt in the prefix guards a reused one."""
    return _dist().PrefixStore("jobrunner" if attempt is None else f"jobrunner/{attempt}", store)


class Stop(Exception):
    """A wait ended by a signal or the coordinator's abort; args[0] is the exit code."""


def _set(store, key: str, value: dict) -> None:
    store.set(key, json.dumps(value))


def _get(store, key: str) -> dict | None:
    return json.loads(store.get(key)) if store.check([key]) else None


def _wait(store, key: str, stop: list, poll: float = 0.02) -> dict:
    """Poll for a key (JSON value); raise Stop once `stop` holds a signal or on the coordinator's abort."""
    while True:
        if store.check([key]):
            return json.loads(store.get(key))
        if store.check(["abort"]):
            raise Stop(json.loads(store.get("abort")).get("exit_code", EXIT_FAILED))
        if stop:
            raise Stop(EXIT_INTERRUPTED)
        time.sleep(poll)
        poll = min(poll * 1.5, 0.05)       # 20 polls a second at most: every worker sees `go` at once


# --- worker to coordinator ---------------------------------------------------------------------

def set_loaded(store, rank: int, device: str | None = None, error: str | None = None) -> None:
    _set(store, f"loaded/{rank}", {"error": error} if error is not None else {"device": device})


def get_loaded(store, rank: int) -> dict | None:
    return _get(store, f"loaded/{rank}")


def set_ready(store, r: int, rank: int, manifest: dict | None = None, error: str | None = None) -> None:
    _set(store, f"r{r}/ready/{rank}", {"error": error} if error is not None else
         {k: v for k, v in (manifest or {}).items() if k != "config"})


def get_ready(store, r: int, rank: int) -> dict | None:
    return _get(store, f"r{r}/ready/{rank}")


def set_progress(store, r: int, rank: int, stats, total: int | None) -> None:
    """`stats`: the worker's JobStats so far; `total`: the rows it expects, when known."""
    _set(store, f"r{r}/progress/{rank}", {
        "rows": stats.rows, "skipped": stats.rows_skipped, "failed": stats.rows_failed,
        "tokens": stats.prompt_tokens + stats.completion_tokens, "total": total})


def get_progress(store, r: int, rank: int) -> dict | None:
    return _get(store, f"r{r}/progress/{rank}")


def set_result(store, r: int, rank: int, result: dict) -> None:
    _set(store, f"r{r}/result/{rank}", result)


def get_result(store, r: int, rank: int) -> dict | None:
    return _get(store, f"r{r}/result/{rank}")


def next_ticket(store, r: int) -> int:
    """The next ticket of round r's work queue (0, 1, 2, ...: each drawn by exactly one worker)."""
    return store.add(f"r{r}/next_unit", 1) - 1


def beat(store, rank: int) -> None:
    store.add(f"hb/{rank}", 1)


def beats(store, rank: int) -> int:
    return store.add(f"hb/{rank}", 0)


def ack_exit(store) -> None:
    store.add("exited", 1)


def exits(store) -> int:
    return store.add("exited", 0)


# --- coordinator to workers --------------------------------------------------------------------

@dataclass(frozen=True)
class Round:
    """round/<r> as a worker reads it: run with these members (rank -> slot), or stop (slots None)."""
    slots: dict[int, int] | None
    exit_code: int = EXIT_OK


def open_round(store, r: int, slots: dict[int, int]) -> None:
    _set(store, f"round/{r}", {"op": "run", "slots": {str(k): v for k, v in slots.items()}})


def end_rounds(store, r: int, exit_code: int) -> None:
    """Round r is the end: every worker acknowledges (`exited`) and leaves with `exit_code`."""
    _set(store, f"round/{r}", {"op": "stop", "exit_code": exit_code})


def wait_round(store, r: int, stop: list) -> Round:
    msg = _wait(store, f"round/{r}", stop)
    if msg["op"] != "run":
        return Round(None, msg.get("exit_code", EXIT_OK))
    return Round({int(k): v for k, v in msg["slots"].items()})


def set_go(store, r: int) -> None:
    _set(store, f"r{r}/go", {})


def wait_go(store, r: int, stop: list) -> None:
    _wait(store, f"r{r}/go", stop)


def set_abort(store, exit_code: int) -> None:
    _set(store, "abort", {"exit_code": exit_code})


def aborted(store) -> bool:
    return store.check(["abort"])
