"""Data parallelism: one worker process per device, each with its own engine, sharing one job.

Two ways to start the workers, one protocol between them:

    jobrunner submit --data-parallel N            torchrun / srun / PyTorchJob (RANK, WORLD_SIZE, ...)
    ----------------------------------            ---------------------------------------------------
    this launcher hosts a TCPStore, starts N      every rank is a worker; rank 0 (or torchrun's agent)
    workers (`python -m jobrunner.parallel`,      hosts the store; a thread of rank 0 coordinates;
    one GPU or cores // N threads each) and       a rank that stops beating its heart fails the job,
    coordinates; it sees a worker die at once     and torchrun's restart (or a rerun) resumes it

Every worker reads and plans the same dataset identically (Job's contract), so a work unit is
named by its index in the plan. The coordinator and the workers talk only through the store:

    loaded/<rank>           worker: engine loaded ({"device"}) or {"error": config error}
    round/<r>               coordinator: {"op": "run", "slots": {rank: slot}} or {"op": "stop"}
    r<r>/ready/<rank>       worker: its writer is open, so it has read the done ids
    r<r>/go                 coordinator: every member is ready; start claiming units
    r<r>/next_unit          the work queue: store.add(key, 1) - 1 is the next unit index to run
    r<r>/progress/<rank>    worker: rows and tokens so far, for the coordinator's progress line
    r<r>/result/<rank>      worker: its summary, units run, exit code
    abort                   coordinator: give up ({"exit_code"}), e.g. a worker's config error
    hb/<rank>, exited       heartbeats (torchrun mode) and the final acknowledgement

A round is one pass over the rows not yet in the output. The `ready` barrier makes every member
read the done ids before anyone writes, so all plan the same rows into the same units. Units are
handed out as workers ask for them (a worker asks when its engine has room), so a fast worker
takes more and all finish within about one engine queue of each other. The finished-units set is
the output directory itself: a row is done when a part file holding it exists (parts appear by
atomic rename). When a worker dies, the units it claimed but had not written are lost for that
round; the coordinator then runs another round with the survivors, whose plans cover exactly the
rows still missing, so every id is written exactly once. Under torchrun a lost rank ends the job
(exit 1) instead: torchrun's --max-restarts, or the next run, resumes it the same way.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from datetime import timedelta

from jobrunner.config import JobConfig, JobConfigError
from jobrunner.job import (EXIT_CONFIG, EXIT_ERROR_RATE, EXIT_INTERRUPTED, EXIT_OK, EXIT_STORAGE, Job,
                           JobResult)
from jobrunner.planner import spread_units
from jobrunner.stats_merge import merge_stats, worker_sketch

log = logging.getLogger("jobrunner")

EXIT_FAILED = 1                 # workers died and the job could not finish; run again to resume
MAX_ROUNDS = 4                  # launcher mode: passes over the remaining rows after workers died
STORE_TIMEOUT = timedelta(hours=2)
TEST_DIE_ENV = "JOBRUNNER_TEST_DIE"     # "RANK:ROWS": in round 0 that rank os._exit()s, holding unfinished
                                        # units, once it has written ROWS rows (tests only)


# --- when and how ------------------------------------------------------------------------------

def distributed_env() -> dict | None:
    """RANK, WORLD_SIZE, ... when started by torchrun (or srun, PyTorchJob) with a world over 1."""
    if os.environ.get("JOBRUNNER_LAUNCHER_PID"):
        return None                         # our own worker processes; see _worker_process_main
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return None
    if world <= 1 or "RANK" not in os.environ:
        return None
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise JobConfigError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: start the job with torchrun, "
                             "or set MASTER_ADDR and MASTER_PORT to rank 0's host and a free port")
    rank = int(os.environ["RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return {"rank": rank, "world": world, "local_rank": int(os.environ.get("LOCAL_RANK", rank % local_world)),
            "local_world": local_world}


def _cuda_count(device: str) -> int:
    if not (device == "auto" or device.startswith("cuda")):
        return 0
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable CUDA: CPU
        return 0


def data_parallel_size(cfg: JobConfig) -> int:
    """--data-parallel, or by default the number of visible GPUs (1 on CPU or with --device cuda:N)."""
    if cfg.data_parallel is not None:
        return cfg.data_parallel
    if cfg.device.startswith("cuda:") or cfg.device == "cpu":
        return 1
    return max(1, _cuda_count(cfg.device))


def wants_parallel(cfg: JobConfig) -> bool:
    return distributed_env() is not None or data_parallel_size(cfg) > 1


def run_parallel(cfg: JobConfig) -> JobResult:
    """The job over several workers: under torchrun this process is one rank, else a launcher.
    Raises JobConfigError for a configuration that can't run (nothing written)."""
    env = distributed_env()
    if env is not None:
        if cfg.data_parallel not in (None, env["world"]):
            log.warning("--data-parallel %s ignored: WORLD_SIZE=%d decides", cfg.data_parallel, env["world"])
        return _run_distributed(cfg, env)
    return _launch(cfg, data_parallel_size(cfg))


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _preflight(cfg: JobConfig) -> None:
    """What can fail without a model, before any process starts."""
    from jobrunner import checks
    cfg.validate()
    fmt, columns = checks.check_dataset(cfg)
    checks.check_template(cfg, columns)
    checks.check_not_empty(cfg, fmt)
    checks.check_output(cfg)


# --- the single-node launcher ------------------------------------------------------------------

def _launch(cfg: JobConfig, n: int) -> JobResult:
    import torch.distributed as dist

    _preflight(cfg)
    gpus = _cuda_count(cfg.device)
    on_gpu = gpus > 0 and cfg.device != "cpu"
    if cfg.device.startswith("cuda:"):
        raise JobConfigError(f"--device {cfg.device} names one GPU; use --device cuda --data-parallel {n} "
                             "(or CUDA_VISIBLE_DEVICES) to spread the job over several")
    if cfg.device == "cuda" and not on_gpu:
        raise JobConfigError("--device cuda was asked for but no CUDA GPU is visible")
    if on_gpu and n > gpus:
        raise JobConfigError(f"--data-parallel {n} but only {gpus} GPUs are visible (one worker per GPU)")
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()] or \
        [str(i) for i in range(gpus)]
    threads = max(1, _cpu_cores() // n)
    server = dist.TCPStore("127.0.0.1", 0, n + 1, True, timeout=STORE_TIMEOUT, wait_for_workers=False)
    store = dist.PrefixStore("jobrunner", server)
    worker_cfg = json.dumps(asdict(cfg))
    procs: dict[int, subprocess.Popen] = {}
    for rank in range(n):
        env = dict(os.environ, JOBRUNNER_LAUNCHER_PID=str(os.getpid()), JOBRUNNER_WORKER_CONFIG=worker_cfg,
                   RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port))
        if on_gpu:
            env["CUDA_VISIBLE_DEVICES"] = visible[rank]
        else:
            env.update(OMP_NUM_THREADS=str(threads), RAYON_NUM_THREADS=str(threads), JOBRUNNER_THREADS=str(threads))
        # A session of its own: a Ctrl-C on the terminal reaches the launcher only, which forwards one SIGTERM.
        procs[rank] = subprocess.Popen([sys.executable, "-m", "jobrunner.parallel"], env=env, start_new_session=True)
    log.info("data parallel: %d workers on %s", n, f"GPUs {','.join(visible[:n])}" if on_gpu
             else f"CPU, {threads} threads each")
    coord = Coordinator(cfg, store, n, alive=lambda r: procs[r].poll() is None, retry=True)

    def on_signal(signum, frame):
        coord.stopping = True
        log.warning("signal %d: workers finish what is written, then stop", signum)
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        result = coord.run()
    except BaseException:
        if not store.check(["abort"]):
            coord._abort(EXIT_FAILED)
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        deadline = time.time() + 30
        for p in procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return coord.raise_or(result)


def _worker_process_main() -> int:
    """`python -m jobrunner.parallel`: one worker started by _launch."""
    import torch.distributed as dist

    _setup_worker_logging(int(os.environ["RANK"]))
    cfg = config_from_json(os.environ["JOBRUNNER_WORKER_CONFIG"])
    parent = int(os.environ["JOBRUNNER_LAUNCHER_PID"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    threading.Thread(target=_orphan_watch, args=(parent,), daemon=True).start()
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world + 1, False,
                           timeout=STORE_TIMEOUT)
    threads = int(os.environ.get("JOBRUNNER_THREADS") or 0) or None
    return worker_loop(cfg, rank, world, dist.PrefixStore("jobrunner", client), threads=threads)


def _orphan_watch(parent: int) -> None:
    """The launcher was killed (SIGKILL, OOM): stop at once, so that a rerun never races this worker."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(EXIT_FAILED)


def config_from_json(text: str) -> JobConfig:
    d = json.loads(text)
    for key in ("stop", "labels"):
        d[key] = tuple(d.get(key) or ())
    return JobConfig(**d)


def _setup_worker_logging(rank: int) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, datefmt="%H:%M:%S",
                            format=f"%(asctime)s worker {rank} %(levelname)s %(message)s")


# --- torchrun / srun: every rank a worker, rank 0 also coordinates -------------------------------

def _run_distributed(cfg: JobConfig, env: dict) -> JobResult:
    import torch.distributed as dist

    rank, world = env["rank"], env["world"]
    on_gpu = _cuda_count(cfg.device) > 0 and cfg.device != "cpu"
    threads = None
    if on_gpu:
        cfg = replace(cfg, device=f"cuda:{env['local_rank']}")
    else:
        threads = max(1, _cpu_cores() // env["local_world"])
    _preflight(cfg)
    store, _, _ = next(dist.rendezvous("env://", timeout=STORE_TIMEOUT))
    # torchrun's agent makes a fresh store per restart; the attempt in the prefix guards a reused one
    ns = dist.PrefixStore(f"jobrunner/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    log.info("rank %d of %d (%s)", rank, world, cfg.device if on_gpu else f"CPU, {threads} threads")
    beat = _Heartbeat(ns.clone(), rank)
    beat.start()
    try:
        if rank == 0:
            return _coordinate_and_work(cfg, ns, world, threads)
        # once this rank has acknowledged the end (`exited`), rank 0 may destroy the store: stop beating first
        code = worker_loop(cfg, rank, world, ns, threads=threads, before_exit=beat.stop)
        return JobResult(code, {}, cfg.output_url)
    finally:
        beat.stop()     # joined: no thread of ours is inside a store call when the interpreter exits


def _coordinate_and_work(cfg: JobConfig, ns, world: int, threads: int | None) -> JobResult:
    """Rank 0: the coordinator in a thread, this process's worker in the main thread."""
    monitor = _HeartbeatMonitor(ns.clone())
    # the local worker counts as gone once worker_loop has returned without acknowledging the end (e.g.
    # stopped by a signal); one that acknowledged is counted in `exited`, so stays a member for the handshake
    coord = Coordinator(cfg, ns.clone(), world, retry=False,
                        alive=lambda r: monitor(r) and not (r == 0 and coord.local_done))
    thread = threading.Thread(target=coord.run_in_thread, name="jobrunner-coordinator", daemon=True)
    thread.start()
    acked: list[bool] = []
    try:
        worker_loop(cfg, 0, world, ns, threads=threads, before_exit=lambda: acked.append(True))
    finally:
        coord.local_done = not acked
    thread.join()       # it uses the store until every live worker has acknowledged the end
    return coord.raise_or(coord.result)


class _Heartbeat(threading.Thread):
    def __init__(self, store, rank: int, every_s: float = 2.0):
        super().__init__(name="jobrunner-heartbeat", daemon=True)
        self.store, self.key, self.every_s = store, f"hb/{rank}", every_s
        self._stop_event = threading.Event()

    def run(self):
        while not self._stop_event.is_set():
            try:
                self.store.add(self.key, 1)
            except Exception:  # noqa: BLE001 - the store is gone: the job is over
                return
            self._stop_event.wait(self.every_s)

    def stop(self, timeout: float = 30.0):
        """Stop beating; on return the thread is out of the store (a store call ends or fails well within
        `timeout`). A daemon thread left inside a store call aborts the process at exit ("terminate called
        without an active exception"), and a store call racing its destruction may hang or fail."""
        self._stop_event.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout)
            if self.is_alive():
                log.warning("the heartbeat thread did not stop within %.0f s", timeout)


class _HeartbeatMonitor:
    """alive(rank): its heartbeat counter moved within JOBRUNNER_HEARTBEAT_TIMEOUT seconds (coordinator's clock)."""

    def __init__(self, store):
        self.store = store
        self.timeout = float(os.environ.get("JOBRUNNER_HEARTBEAT_TIMEOUT", "120"))
        self.seen: dict[int, tuple[int, float]] = {}

    def __call__(self, rank: int) -> bool:
        key = f"hb/{rank}"
        value = self.store.add(key, 0)
        now = time.monotonic()
        last = self.seen.get(rank)
        if last is None or last[0] != value:
            self.seen[rank] = (value, now)
            return True
        return now - last[1] < self.timeout


# --- the worker ------------------------------------------------------------------------------

class _Stop(Exception):
    pass


def _wait(store, key: str, stop: list, poll: float = 0.02) -> dict:
    """Poll for a key (JSON value); raise _Stop on a signal or the coordinator's abort."""
    while True:
        if store.check([key]):
            return json.loads(store.get(key))
        if store.check(["abort"]):
            raise _Stop(json.loads(store.get("abort")).get("exit_code", EXIT_FAILED))
        if stop:
            raise _Stop(EXIT_INTERRUPTED)
        time.sleep(poll)
        poll = min(poll * 1.5, 0.05)       # 20 polls a second at most: every worker sees `go` at once


def worker_loop(cfg: JobConfig, rank: int, world: int, store, threads: int | None = None,
                before_exit=lambda: None) -> int:
    """One worker: load the engine once, then run rounds as the coordinator opens them. Returns an exit code.
    `before_exit()` runs just before the worker acknowledges the end (`exited`), after which the store may go:
    it stops the process's other users of the store."""
    from jobrunner.checks import load_engine

    stop: list = []

    def on_signal(signum, frame):   # between rounds; Job.run has its own handlers while it runs
        if stop:
            raise KeyboardInterrupt
        stop.append(signum)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    if threads:
        import torch
        torch.set_num_threads(threads)
    cfg = replace(cfg, overwrite=False)     # the coordinator alone prepares (and overwrites) the output
    try:
        engine = load_engine(cfg)
    except JobConfigError as e:
        store.set(f"loaded/{rank}", json.dumps({"error": str(e)}))
        return EXIT_CONFIG
    store.set(f"loaded/{rank}", json.dumps({"device": str(engine.rt.device)}))
    try:
        for r in itertools.count():
            msg = _wait(store, f"round/{r}", stop)
            if msg["op"] != "run" or str(rank) not in msg["slots"]:
                before_exit()
                store.add("exited", 1)
                return msg.get("exit_code", EXIT_OK)
            _run_round(cfg, engine, store, r, rank, msg["slots"][str(rank)], world, stop, members=len(msg["slots"]))
    except _Stop as e:
        return e.args[0]


class _WorkerJob(Job):
    """A data-parallel worker's Job: each planning window's units are spread over the workers, then
    come out largest first.

    A window of fewer units than workers (a small job sharing one prefix is one unit) would leave
    workers idle, so its largest units are halved until each worker can get one (spread_units); each
    worker then computes the shared prefix once. The planner orders units for cache locality (a
    depth-first trie walk), so a big prefix group can come last, and whoever draws it finishes long
    after the others. Handing the units out longest first (LPT) lets the small ones fill in around the
    big ones. Across workers the locality is lost anyway; within a unit nothing changes. Both steps are
    deterministic, so every worker agrees on the units and their order.
    """

    def _units(self):
        window = []
        for unit in super()._units():
            window.append(unit)
            if unit.window_end:
                yield from self._spread(window)
                window = []
        yield from self._spread(window)

    def _spread(self, window):
        # the window's rows all wait in self.pending, token ids packed: none is yielded (submitted) yet
        def tokens_of(key):
            return memoryview(self.pending[key][1].prompt_token_ids).cast("I")
        return self._largest_first(spread_units(window, self.world, tokens_of, self._cost))

    def _cost(self, u) -> int:
        """Tokens the engine computes for a unit: the shared prefix once, the rest, the outputs."""
        n = len(u.items)
        return u.prompt_tokens - u.shared_prefix_len * (n - 1) + n * self.cfg.n * self.cfg.max_tokens

    def _largest_first(self, units):
        return sorted(units, key=self._cost, reverse=True)     # stable: ties keep the planner's order


def _run_round(cfg, engine, store, r: int, rank: int, slot: int, world: int, stop: list, members: int) -> None:
    claim = _Claim(store, f"r{r}/next_unit", slot, members)     # members: this round's workers
    job = _WorkerJob(cfg, rank=slot, world=world, claim=claim)
    job.max_in_flight = engine.rt.max_num_seqs    # claim a unit only when the engine has room: dynamic balance
    job.progress_factory = lambda total: _StoreProgress(store, f"r{r}/progress/{rank}", total)
    try:
        job.prepare(engine=engine)
    except JobConfigError as e:
        store.set(f"r{r}/ready/{rank}", json.dumps({"error": str(e)}))
        raise _Stop(EXIT_CONFIG) from None
    store.set(f"r{r}/ready/{rank}", json.dumps({"model_source": engine.rt.source, "dataset_format": job.fmt}))
    _wait(store, f"r{r}/go", stop)
    if r == 0 and os.environ.get(TEST_DIE_ENV, "").split(":")[0] == str(rank):
        claim.die_after_rows, claim.job = int(os.environ[TEST_DIE_ENV].split(":")[1]), job
    t0 = time.time()
    payload = {"rank": rank, "slot": slot, "round": r, "device": str(engine.rt.device), "error": None}
    try:
        result = job.run()
        payload.update(exit_code=result.exit_code, summary=result.stats)
    except OSError as e:
        log.error("writing the output failed: %s", e)
        payload.update(exit_code=EXIT_STORAGE, summary=None, error=str(e))
    payload.update(units=claim.units, run_s=time.time() - t0, sketch=worker_sketch(getattr(job, "stats", None)))
    store.set(f"r{r}/result/{rank}", json.dumps(payload))


class _Claim:
    """Job's claim(index). Unit i < world goes to slot i, so every worker starts with a unit (the
    counter alone would let the first worker take them all while the others start up). Past those,
    indices come in order world, world + 1, ...; a ticket drawn from the counter is the next unit
    nobody holds. Every index is drawn by exactly one worker, and that worker reaches it, because all
    workers walk the same plan in the same order."""

    def __init__(self, store, key: str, slot: int = 0, world: int = 1):
        self.store, self.key, self.slot, self.world = store, key, slot, world
        self.ticket: int | None = None
        self.units = 0
        self.die_after_rows: int | None = None   # test hook (TEST_DIE_ENV)
        self.job = None

    def __call__(self, index: int) -> bool:
        if self.die_after_rows is not None and self.job.stats.rows >= self.die_after_rows \
                and self.job.engine.num_in_flight:
            os._exit(17)        # as a crash would, holding unfinished units: they and unflushed rows are lost
        if index < self.world:
            return self._take(index == self.slot)
        while self.ticket is None or self.ticket < index:
            self.ticket = self.store.add(self.key, 1) - 1 + self.world
        if self.ticket > index:
            return False
        self.ticket = None
        return self._take(True)

    def _take(self, mine: bool) -> bool:
        self.units += mine
        return mine


class _StoreProgress:
    """Job's progress object for a worker: publishes its counts for the coordinator's progress line."""

    def __init__(self, store, key: str, total: int | None, every_s: float = 1.0):
        self.store, self.key, self.total, self.every_s = store, key, total, every_s
        self.last = 0.0

    def update(self, stats, force: bool = False) -> None:
        now = time.time()
        if force or now - self.last >= self.every_s:
            self.last = now
            self.store.set(self.key, json.dumps({
                "rows": stats.rows, "skipped": stats.rows_skipped, "failed": stats.rows_failed,
                "tokens": stats.prompt_tokens + stats.completion_tokens, "total": self.total}))

    def close(self) -> None:
        pass


# --- the coordinator -----------------------------------------------------------------------

class Coordinator:
    """Opens rounds, hands nothing out itself (the counter does), notices lost workers, and at the end
    merges the workers' stats, writes _stats.json and marks the manifest complete."""

    def __init__(self, cfg: JobConfig, store, world: int, alive, retry: bool):
        self.cfg, self.store, self.world, self.alive, self.retry = cfg, store, world, alive, retry
        self.stopping = False
        self.local_done = False
        self.result: JobResult | None = None
        self.error: Exception | None = None
        self.bar = None
        self.last_log = self.last_progress = time.time()

    def run_in_thread(self) -> None:
        try:
            self.result = self.run()
        except Exception as e:  # noqa: BLE001 - handed to the main thread by raise_or
            self.error = e
            self._abort(EXIT_CONFIG if isinstance(e, JobConfigError) else EXIT_FAILED)

    def raise_or(self, result: JobResult | None) -> JobResult:
        if self.error is not None:
            raise self.error
        return result

    def run(self) -> JobResult:
        from jobrunner.summary import job_summary
        from jobrunner.writer import OutputError, prepare_output

        cfg = self.cfg
        loaded = self._gather("loaded", range(self.world))
        self._config_errors(loaded)
        if not loaded:
            self._abort(EXIT_FAILED)
            return self._fail("no worker started; see the workers' logs above")
        try:
            prepare_output(cfg.output_url, {"config": cfg.fingerprint_fields()}, overwrite=cfg.overwrite)
        except OutputError as e:
            self._abort(EXIT_CONFIG)
            raise JobConfigError(str(e)) from None
        members, results, lost, complete, start, manifest, rounds = sorted(loaded), [], [], False, None, {}, 0
        for r in range(MAX_ROUNDS if self.retry else 1):
            if self.stopping:
                break
            rounds = r + 1
            slots = {str(k): i for i, k in enumerate(members)}
            self.store.set(f"round/{r}", json.dumps({"op": "run", "slots": slots}))
            ready = self._gather(f"r{r}/ready", members)
            self._config_errors(ready)
            manifest = next(iter(ready.values()), manifest)
            start = start or time.time()
            self.store.set(f"r{r}/go", "{}")
            done = self._gather(f"r{r}/result", sorted(ready), progress=r)
            results += done.values()
            gone = [k for k in members if k not in done]
            lost += gone
            members = sorted(done)
            codes = {v["exit_code"] for v in done.values()}
            if self.stopping or codes & {EXIT_INTERRUPTED, EXIT_STORAGE, EXIT_CONFIG}:
                break
            if not gone:
                complete = True
                break
            log.warning("worker%s %s stopped before finishing; %s", "s" if len(gone) > 1 else "",
                        ", ".join(map(str, gone)), "the rows they had not written go to the workers left"
                        if self.retry and members else "the job ends unfinished: run it again to resume")
            if not members:
                break
        if self.bar is not None:
            self.bar.close()
        run = merge_stats(results, cfg, wall_s=time.time() - (start or time.time()), devices=self.world,
                          rounds=rounds, lost=lost)
        code = self._exit_code(results, run, complete)
        run["interrupted"] = run["interrupted"] or code == EXIT_INTERRUPTED
        summary = job_summary(cfg.output_url, cfg.fingerprint_fields(), run)     # as one worker's job does
        self._finish(summary, manifest, complete, code, rounds)
        return JobResult(code, summary, cfg.output_url)

    # -- steps

    def _gather(self, prefix: str, ranks, progress: int | None = None) -> dict[int, dict]:
        """Each rank's `prefix/rank` value, until all have one or are gone (dead, or its heart stopped)."""
        waiting, got, poll = set(ranks), {}, 0.02
        while waiting:
            for k in sorted(waiting):
                key = f"{prefix}/{k}"
                if self.store.check([key]):
                    got[k] = json.loads(self.store.get(key))
                    waiting.discard(k)
                elif not self.alive(k) and not self.store.check([key]):
                    waiting.discard(k)
            if progress is not None and time.time() - self.last_progress >= 1.0:
                self.last_progress = time.time()
                self._progress(progress, list(got) + list(waiting))
            if waiting:
                time.sleep(poll)
                poll = min(poll * 1.5, 0.1)
        return got

    def _config_errors(self, replies: dict) -> None:
        errors = [v["error"] for v in replies.values() if v.get("error")]
        if errors:
            self._abort(EXIT_CONFIG)
            raise JobConfigError(errors[0])

    def _abort(self, code: int) -> None:
        try:
            self.store.set("abort", json.dumps({"exit_code": code}))
        except Exception:  # noqa: BLE001 - the store is gone: nobody is waiting
            pass

    def _fail(self, message: str) -> JobResult:
        log.error("%s", message)
        return JobResult(EXIT_FAILED, {}, self.cfg.output_url)

    def _progress(self, r: int, ranks: list[int]) -> None:
        rows = skipped = failed = tokens = 0
        total = None
        for k in ranks:
            key = f"r{r}/progress/{k}"
            if self.store.check([key]):
                p = json.loads(self.store.get(key))
                rows, failed, tokens = rows + p["rows"], failed + p["failed"], tokens + p["tokens"]
                skipped, total = max(skipped, p["skipped"]), p["total"]
        done = rows + skipped
        if self.bar is None and sys.stderr.isatty() and threading.current_thread() is threading.main_thread():
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="row", dynamic_ncols=True)
        if self.bar is not None:
            self.bar.total = total
            self.bar.n = done
            self.bar.set_postfix_str(f"{len(ranks)} workers, {failed} errors", refresh=False)
            self.bar.refresh()
        elif time.time() - self.last_log >= 30:
            self.last_log = time.time()
            log.info("%d%s rows, %d failed, %d tokens, %d workers", done, f"/{total}" if total else "", failed,
                     tokens, len(ranks))

    def _exit_code(self, results: list[dict], summary: dict, complete: bool) -> int:
        codes = {v["exit_code"] for v in results}
        if EXIT_STORAGE in codes:
            return EXIT_STORAGE
        if EXIT_INTERRUPTED in codes or self.stopping:
            return EXIT_INTERRUPTED
        if not complete:
            return EXIT_FAILED
        rate = self.cfg.max_error_rate
        if rate is not None and summary["rows"] and summary["rows_failed"] / summary["rows"] > rate:
            log.error("%d of %d rows failed, over --max-error-rate %s", summary["rows_failed"], summary["rows"], rate)
            return EXIT_ERROR_RATE
        return EXIT_OK

    def _finish(self, summary: dict, manifest: dict, complete: bool, code: int, rounds: int) -> None:
        """Stats always; the manifest marked complete only when every round's rows were written."""
        from jobrunner.writer import ResultWriter, write_openai_batch_output, write_stats

        cfg = self.cfg
        if complete:
            m = {"config": cfg.fingerprint_fields(), **{k: manifest[k] for k in ("model_source", "dataset_format")
                                                        if k in manifest}}
            ResultWriter(cfg.output_url, m, part_rows=cfg.part_rows, part_prefix="part-merge").close(summary)
            if cfg.output_format == "openai-batch":
                write_openai_batch_output(cfg.output_url)
        else:
            write_stats(cfg.output_url, summary)
            log.warning("%d rows written; run the same command again to resume", summary["rows"])
        self.store.set(f"round/{rounds}", json.dumps({"op": "stop", "exit_code": code}))
        # the store may live in this process (torchrun without an agent): leave only once every worker has read it
        deadline = time.time() + 60
        while self.store.add("exited", 0) < len(self._members_alive()) and time.time() < deadline:
            time.sleep(0.05)

    def _members_alive(self) -> list[int]:
        return [k for k in range(self.world) if self.alive(k)]


if __name__ == "__main__":
    sys.exit(_worker_process_main())
