"""One writer at a time on an output directory: the lease file `_lease.json`.

Two jobs writing one output (an Airflow retry overlapping a slow first try) would each compute and write
every row. The lease stops the second at once, naming the first.

Invariants:
- A lease appears by exclusive create (fsspec's pipe_file mode="create": O_EXCL on a local disk,
  If-None-Match on S3, an existence check in memory://), then is read back: a store that ignores the
  condition still shows one writer's record, and only that writer goes on.
- The holder rewrites its record every `stale_s / 6` seconds (`heartbeat`, seconds since the epoch); a
  record whose heartbeat is older than `stale_s`, or whose process on this host is gone, is a dead holder's
  and is taken over with a warning, so a killed job never blocks its rerun (on this host: at once; from
  another: after stale_s). Hosts sharing an output must agree on the time to within `stale_s`.
- Release deletes the record only while it is still ours. One lease per job: a data-parallel launcher,
  rank 0 under torchrun or the Ray driver holds it for all the job's workers; workers never take it.
- The heartbeat and release never raise: a store that fails under them (down mid-job) is warned of, and
  the job's own error, if any, stays the one reported; a record left behind is a dead holder's.

JOBRUNNER_LEASE_STALE_S sets stale_s (default 120).
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any

from jobrunner.common import storage
from jobrunner.output.layout import LEASE, OutputError, output_fs

log = logging.getLogger("jobrunner")
LEASE_FORMAT = "jobrunner-lease"
DEFAULT_STALE_S = 120.0


class OutputBusyError(OutputError):
    """Another live job holds the output's lease; the message names it (host, pid, since)."""


def stale_seconds() -> float:
    value = os.environ.get("JOBRUNNER_LEASE_STALE_S", "")
    try:
        return float(value) if value else DEFAULT_STALE_S
    except ValueError:
        raise OutputError(f"JOBRUNNER_LEASE_STALE_S={value!r}: expected seconds, e.g. 120") from None


def describe(record: dict) -> str:
    """Who holds a lease, as its message says it."""
    since = record.get("since", "?")
    return f"pid {record.get('pid', '?')} on {record.get('host', '?')}, since {since}"


class OutputLease:
    """The lease on one output directory, held from `acquire` to `release` (a context manager too)."""

    def __init__(self, output_url: str, stale_s: float | None = None):
        self.output_url = output_url
        self.fs, self.root = output_fs(output_url)
        self.path = storage.join(self.root, LEASE)
        self.stale_s = stale_seconds() if stale_s is None else stale_s
        self.record = {"format": LEASE_FORMAT, "holder": secrets.token_hex(8), "host": socket.gethostname(),
                       "pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "heartbeat": time.time()}
        self._made_root = False
        self.held = False
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self.lost = threading.Event()       # another job took the lease over (this one looked dead)

    # -- taking and giving back

    def acquire(self) -> OutputLease:
        """Take the lease, or raise OutputBusyError naming its live holder. Creates the directory."""
        try:
            return self._take()
        except BaseException:       # refused, or a signal mid-take (SIGTERM: KeyboardInterrupt): nothing of ours stays
            self.held = True
            self.release()
            raise

    def _take(self) -> OutputLease:
        if self.fs.exists(self.root) and not self.fs.isdir(self.root):
            return self         # not a directory: the output's own check says so (exit 2), nothing to hold
        if not self.fs.exists(self.root):
            self.fs.makedirs(self.root, exist_ok=True)
            self._made_root = True
        for _ in range(3):              # a stale record removed, or a holder that released meanwhile: try again
            if self._create():
                self.held = True
                self._start_heartbeat()
                return self
            held = self._read()
            if held is None:
                continue
            age = time.time() - float(held.get("heartbeat") or 0)
            if age <= self.stale_s and not self._holder_gone(held):
                raise OutputBusyError(
                    f"output {self.output_url} is being written by another job ({describe(held)}; last "
                    f"heartbeat {age:.0f} s ago). Wait for it to end, or choose another --output (a killed "
                    f"job's lease is taken over at once on its own host, {self.stale_s:.0f} s after its last "
                    "heartbeat from another)")
            log.warning("output %s: taking over the lease of a job that stopped without releasing it (%s; "
                        "last heartbeat %.0f s ago)", self.output_url, describe(held), age)
            self._remove_if(held.get("holder"))
        raise OutputBusyError(f"output {self.output_url}: could not take its lease ({self.path}) after "
                              "three tries; another job is starting on it")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
        if not self.lost.is_set():
            try:
                self._remove_if(self.record["holder"])
            except Exception as e:  # noqa: BLE001 - a store gone down: the job's own error, not this, is the news
                log.warning("output %s: could not remove its lease %s (%s: %s); the next run takes it over (on "
                            "this host at once, from another after %.0f s)", self.output_url, self.path,
                            type(e).__name__, _first_line(e), self.stale_s)
                return
        if self._made_root:             # the job wrote nothing (refused before any part): leave no empty directory
            try:
                if not storage.list_names(self.fs, self.root):
                    self.fs.rmdir(self.root)
            except OSError:
                pass

    def __enter__(self) -> OutputLease:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _holder_gone(self, held: dict) -> bool:
        """A holder on this host whose process is gone (a kill -9): its lease is stale at once."""
        pid = held.get("pid")
        if held.get("host") != self.record["host"] or not isinstance(pid, int) or pid == os.getpid():
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:             # alive, another user's
            return False
        try:                        # a killed process its parent has not reaped yet is gone too
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[-1].split()[0] == "Z"
        except (OSError, IndexError):
            return False

    # -- the record

    def _bytes(self) -> bytes:
        return json.dumps(self.record, sort_keys=True).encode()

    def _create(self) -> bool:
        """Exclusive create, then read back: True when the record there is ours."""
        try:
            self.fs.pipe_file(self.path, self._bytes(), mode="create")
        except FileExistsError:
            return False
        except OSError as e:
            if self._read() is None:    # a store that refuses the condition itself: say so, not "busy"
                raise OSError(f"cannot create the output's lease {self.path}: {e}") from e
            return False
        held = self._read()
        return held is not None and held.get("holder") == self.record["holder"]

    def _read(self) -> dict | None:
        """The record there now; None when there is none (or it is not a lease: a torn write counts as stale)."""
        try:
            self.fs.invalidate_cache(self.path)
        except Exception:  # noqa: BLE001 - cache invalidation is best effort
            pass
        try:
            with self.fs.open(self.path, "rb") as f:
                data: Any = json.loads(f.read() or b"null")
        except FileNotFoundError:
            return None
        except ValueError:      # a torn record; a store that cannot be reached raises (the caller decides)
            return {"holder": None, "heartbeat": 0}
        if not isinstance(data, dict) or data.get("format") != LEASE_FORMAT:
            return {"holder": None, "heartbeat": 0}
        return data

    def _remove_if(self, holder: str | None) -> None:
        """Delete the record if it is still `holder`'s (a stale one being taken over, or ours)."""
        held = self._read()
        if held is not None and held.get("holder") == holder:
            try:
                self.fs.rm(self.path)
            except FileNotFoundError:
                pass

    # -- the heartbeat

    def _start_heartbeat(self) -> None:
        beat = threading.Thread(target=self._heartbeat, name="jobrunner-lease", daemon=True)
        beat.start()
        self._beat = beat       # only once started: a signal inside start() leaves nothing for release() to join

    def _heartbeat(self) -> None:
        """Renew the record every stale_s / 6 until released or taken over. Never raises: a beat the store
        refuses (down, throttling) is retried at the next one; stale_s allows five."""
        interval = max(self.stale_s / 6, 0.05)
        while not self._stop.wait(interval):
            try:
                if not self._beat_once():
                    return
            except Exception as e:  # noqa: BLE001 - retried at the next beat
                log.warning("output %s: renewing its lease failed (%s: %s); retrying", self.output_url,
                            type(e).__name__, _first_line(e))

    def _beat_once(self) -> bool:
        """One renewal; False when another job took the lease over (this one looked dead to it)."""
        held = self._read()
        if held is None or held.get("holder") != self.record["holder"]:
            log.error("output %s: another job took this job's lease over (%s): this job looked dead to it; "
                      "rows written from now on may be written twice", self.output_url,
                      describe(held) if held else "the lease is gone")
            self.lost.set()
            return False
        self.record["heartbeat"] = time.time()
        storage.atomic_write(self.fs, self.path, self._bytes())
        return True


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]
