"""How many CPU threads a job computes with.

torch starts one intra-op thread per core. On a machine where other processes keep cores
busy, a thread that waits for a busy core stalls every step of the whole team (each matmul
ends at a barrier): two threads on a loaded 2-core machine measured several times slower
than one. So a job takes the cores of its affinity set that nothing else is running on
when it starts, follows the load as it changes (ThreadGovernor), and `--threads N` decides it
for the user who knows better.
"""
from __future__ import annotations

import logging
import os
import statistics
import time

log = logging.getLogger("jobrunner")

_SAMPLES, _GAP_S = 5, 0.005


def _running_elsewhere() -> int | None:
    """Runnable threads on the machine other than this one (Linux: /proc/stat's procs_running)."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("procs_running"):
                    return max(0, int(line.split()[1]) - 1)
    except OSError:
        pass
    return None


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                       # not Linux
        return os.cpu_count() or 1


def free_cores() -> int:
    """Cores this process may use that other runnable threads are not busy on (the median of a few
    samples over ~25 ms: one sample catches passing bursts), at least 1."""
    cores = available_cores()
    samples = []
    for i in range(_SAMPLES):
        busy = _running_elsewhere()
        if busy is None:
            return cores
        samples.append(busy)
        if i + 1 < _SAMPLES:
            time.sleep(_GAP_S)
    return max(1, cores - int(statistics.median(samples)))


def threads_each(threads: int | None, processes: int, cores: int | None = None) -> int:
    """CPU threads for each of `processes` processes sharing `threads` (--threads), else `cores` (else
    the free cores): at least one each (two busy threads on one core stall each other)."""
    return max(1, (threads or (cores if cores is not None else free_cores())) // processes)


_BUSY_FIELDS = slice(0, 8)      # /proc/stat's cpu line: user nice system idle iowait irq softirq steal
_IDLE, _IOWAIT = 3, 4
OTHER_BUSY_CORE = 0.3           # another process's share of a core from which that core counts as busy


class OtherLoad:
    """The cores other processes kept busy since the last reading: the machine's busy CPU time
    (/proc/stat) less this process's own (all its threads, spinning ones too), over the wall time.
    An average over the interval, not a sample: neither a passing burst nor torch's own pool
    threads count."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.last = self._read()

    @staticmethod
    def _machine_busy_s() -> float | None:
        try:
            with open("/proc/stat") as f:
                ticks = [int(v) for v in f.readline().split()[1:]][_BUSY_FIELDS]
        except (OSError, ValueError):
            return None
        busy = sum(ticks) - ticks[_IDLE] - ticks[_IOWAIT]
        return busy / os.sysconf("SC_CLK_TCK")

    def _read(self) -> tuple[float, float | None, float]:
        t = os.times()
        return self.clock(), self._machine_busy_s(), t.user + t.system

    def cores(self) -> float | None:
        """Busy cores of other processes since the last call (None where /proc/stat is not there)."""
        (t0, busy0, own0), (t1, busy1, own1) = self.last, self._read()
        self.last = (t1, busy1, own1)
        if busy0 is None or busy1 is None or t1 <= t0:
            return None
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)


class ThreadGovernor:
    """Follows the machine's load through a long job. Every `every_s` seconds (between engine steps)
    it reads how many cores other processes kept busy meanwhile (OtherLoad): it drops threads at once
    when fewer cores are free than it computes with (a thread waiting for a busy core stalls every op
    of the step: several times slower than one thread), and takes them back only when three
    readings in a row find them free (a wrong rise costs far more than a late one gains). Only for a
    job whose threads were left to the machine: --threads N is kept."""

    RISE_AFTER = 3

    def __init__(self, set_threads, current: int, ceiling: int, every_s: float = 2.0, other=None,
                 clock=time.monotonic):
        self.set_threads, self.current, self.ceiling = set_threads, current, ceiling
        self.every_s, self.clock = every_s, clock
        self.other = other or OtherLoad(clock).cores
        self.next_check = clock() + every_s
        self.free_streak = 0            # readings in a row that found more cores free than in use
        self.changes = 0

    def tick(self) -> None:
        now = self.clock()
        if now < self.next_check:
            return
        self.next_check = now + self.every_s
        other = self.other()
        if other is None:
            return
        busy = int(other + 1 - OTHER_BUSY_CORE)
        target = max(1, min(self.ceiling, self.ceiling - busy))
        self.free_streak = self.free_streak + 1 if target > self.current else 0
        if target < self.current or self.free_streak >= self.RISE_AFTER:
            log.info("compute threads %d -> %d: other processes kept %.1f of %d cores busy",
                     self.current, target, other, self.ceiling)
            self.set_threads(target)
            self.current, self.changes, self.free_streak = target, self.changes + 1, 0


class FixedThreads:
    """The governor of a job whose threads are fixed (--threads, a data-parallel worker's share, a GPU)."""
    changes = 0

    def tick(self) -> None:
        pass
