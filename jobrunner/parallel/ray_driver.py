"""`jobrunner submit --ray [ADDRESS]`: the driver of a job whose workers are Ray actors.

    driver (this process)                     Ray cluster
    ---------------------                     -----------
    connect, start up to max_workers actors   RayWorker actors (ray_worker.py), one engine each,
    resolve once (no model) meanwhile; the    placed by Ray with num_gpus = --tensor-parallel
      actors load their engine with it        (GPU clusters) or CPUs, and --ray-resources
    wait for min_workers (--ray-timeout)
    prepare the output once                   WorkQueue actor (ray_queue.py): bundle refs in plan
    plan once (ray_plan.py: a worker's          order, who holds which, progress
      tokenizer and figures; the done ids,
      errors and cache hits here), window     workers take bundles as their engine has room and
      by window into the object store         write parts with today's atomic protocol
    late workers join as they load
    merged _stats.json, complete manifest

A worker whose actor dies (node lost, OOM, kill -9) fails its run with RayActorError: the bundles it
held go back to the queue less the rows its parts have (ray_plan.refill), and the others (or its
restarted actor, Ray's max_restarts) run them. Every id is written once, in one pass.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import threading
import time
from dataclasses import replace

from jobrunner.config.job import JobConfig, JobConfigError
from jobrunner.dataset import rows_to_read
from jobrunner.pipeline.build import open_parts
from jobrunner.pipeline.checks import check_spread_device
from jobrunner.pipeline.ending import JobResult, verdict, write_ending
from jobrunner.pipeline.exit_codes import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_STORAGE
from jobrunner.pipeline.plan import WINDOW_ROWS
from jobrunner.output import OutputError, prepare_output
from jobrunner.output.summary import job_summary
from jobrunner.pipeline.resolve import Resolved, resolve
from jobrunner.parallel.launcher import config_to_json
from jobrunner.parallel.ray_cluster import absolute_if_here, absolute_url, connect, first_line, import_ray, worker_env
from jobrunner.parallel.ray_plan import Shipper, refill
from jobrunner.parallel.ray_queue import WorkQueue
from jobrunner.parallel.merged_stats import merge_stats
from jobrunner.common.signal_interrupt import SignalInterrupt

log = logging.getLogger("jobrunner")

PROGRESS_LOG_S = 10.0       # the driver's progress line when not on a terminal


def run_ray(cfg: JobConfig) -> JobResult:
    """The job over Ray actors. Raises JobConfigError (exit 2) for a configuration that can't run, and for a
    cluster that can't place --ray-min-workers workers within --ray-timeout."""
    check_spread_device(cfg.engine.device, "on Ray use --device cuda (Ray picks the GPUs)")
    address = cfg.parallel.ray.address
    ray = import_ray(address)
    joined = not ray.is_initialized()       # else: a caller already connected (a Ray Data pipeline) keeps it
    if joined:
        connect(ray, address)
    driver = RayDriver(cfg, ray)
    try:
        driver.start_workers()      # their processes start (Python, torch) while the job is checked here
        # jobrunner.job.resolve, once for the job: its workers get it as JSON, and load their engine
        driver.load_workers(resolve(cfg, parallel=True))
        return driver.run()
    finally:
        driver.end()
        if joined:
            ray.shutdown()


class RayDriver:
    def __init__(self, cfg: JobConfig, ray):
        self.cfg, self.ray, self.opts = cfg, ray, cfg.parallel.ray
        self.tag = hashlib.blake2b(cfg.output_url.encode(), digest_size=6).hexdigest()
        self.queue = ray.remote(WorkQueue).options(name=f"{self.tag}-queue", num_cpus=0).remote()
        self.stop = threading.Event()       # a signal (here or in the planning Job), or no worker left
        self.stop_sent = self.no_workers = False
        self.last_log = 0.0
        self.runs: dict = {}                # run ref -> (rank, slot)
        self.next_slot, self.launched = 0, {}
        self.idle: list[int] = []           # ranks whose last run ended normally
        self.results: list[dict] = []
        self.lost: list[int] = []
        self.lost_rows = 0
        self.first_error: str | None = None     # the first worker failure, type and message: in the job's error
        self.parts = None                   # the job's parts the driver plans with (job.build.open_parts)
        self.workers, self.loading = {}, {}     # rank -> actor; load() ref -> rank

    # -- workers

    def worker_options(self) -> tuple[dict, int, int]:
        """(actor options, threads of each worker's engine, how many workers at most)."""
        cfg, res = self.cfg, self.opts.resource_dict
        device, threads, tp = cfg.engine.device, cfg.engine.threads, cfg.parallel.tensor_parallel
        gpus_in_cluster = int(self.ray.cluster_resources().get("GPU", 0))
        on_gpu = device == "cuda" or (device == "auto" and gpus_in_cluster > 0)
        num_gpus = res.pop("GPU", float(tp) if on_gpu else 0.0)
        num_cpus = res.pop("CPU", float(threads or 1))
        memory = res.pop("memory", None)
        opts = dict(num_cpus=num_cpus, num_gpus=num_gpus, resources=res or None,
                    max_restarts=self.opts.max_restarts, max_task_retries=0)
        if memory:
            opts["memory"] = memory
        most = (self.opts.max_workers or cfg.parallel.data_parallel
                or (max(1, gpus_in_cluster // tp) if on_gpu else 1))
        return opts, threads or max(1, int(num_cpus)), max(most, self.opts.min_workers)

    def start_workers(self) -> None:
        from jobrunner.parallel.ray_worker import RayWorker     # it imports Ray: a driver has it by now
        opts, self.threads, n = self.worker_options()
        opts["runtime_env"] = {"env_vars": worker_env()}    # the driver's cache and kernel settings
        self.asks = {k: v for k, v in opts.items() if k in ("num_cpus", "num_gpus", "resources", "memory") and v}
        self._kill_leftovers(n)
        cls = self.ray.remote(RayWorker)
        self.workers = {k: cls.options(name=f"{self.tag}-w{k}", **opts).remote(k) for k in range(n)}
        self.world = max(2, n)      # the plan spreads each window for this many workers (worker.spread_windows)
        log.info("ray: %d workers asked for (each %s), at least %d within %.0f s", n,
                 ", ".join(f"{k} {v:g}" if not isinstance(v, dict) else str(v) for k, v in self.asks.items()),
                 self.opts.min_workers, self.opts.timeout_s)

    def load_workers(self, resolved) -> None:
        """Each worker loads its engine (a restarted one again: _lost) with the job's config and Resolved."""
        self.resolved = resolved
        self.fingerprint = resolved.fingerprint(self.cfg)
        self.total = rows_to_read(self.cfg.input, resolved.fmt)
        cfg, resolved = for_workers(self.cfg, resolved)
        self.load_args = (config_to_json(cfg), resolved.to_json(), self.threads, json.dumps(self.fingerprint))
        for k in self.workers:
            self.loading[self.workers[k].load.remote(*self.load_args)] = k

    def _kill_leftovers(self, n: int) -> None:
        """Workers of an earlier driver of this output still alive (their owner died a moment ago) would race
        this run's workers for the same rows: end them first."""
        for k in range(n):
            try:
                old = self.ray.get_actor(f"{self.tag}-w{k}")
            except ValueError:
                continue
            log.warning("ray: ending worker %d left by an earlier run of this output", k)
            self.ray.kill(old, no_restart=True)
        for k in range(n):
            deadline = time.time() + 30
            while time.time() < deadline:
                try:
                    self.ray.get_actor(f"{self.tag}-w{k}")
                except ValueError:
                    break
                time.sleep(0.2)

    def poll_loaded(self, timeout: float) -> list[int]:
        """Ranks whose engine finished loading within `timeout` s (0: only those done already); a config error
        (a model that can't load) raises JobConfigError."""
        if not self.loading:
            return []
        done, _ = self.ray.wait(list(self.loading), num_returns=len(self.loading), timeout=timeout)
        ranks = []
        for ref in done:
            k = self.loading.pop(ref)
            try:
                info = self.ray.get(ref)
            except self.ray.exceptions.RayActorError as e:
                log.warning("ray: worker %d died while loading: %s", k, first_line(e))
                continue
            if info["error"]:
                raise JobConfigError(f"ray: worker {k} could not load the model: {info['error']}")
            log.info("ray: worker %d loaded on %s (node %s, pid %d, cache %s)", k, info["device"], info["node"][:8],
                     info["pid"], info["cache"])
            ranks.append(k)
        return ranks

    def wait_placed(self) -> list[int]:
        """The first --ray-min-workers loaded workers, or JobConfigError once --ray-timeout has passed."""
        deadline, ready = time.time() + self.opts.timeout_s, []
        while len(ready) < self.opts.min_workers:
            left = deadline - time.time()
            if left <= 0 or not self.loading:
                break
            ready += self.poll_loaded(min(left, 1.0))
        if len(ready) < self.opts.min_workers:
            have = {k: v for k, v in self.ray.cluster_resources().items() if not k.startswith("node:")}
            raise JobConfigError(
                f"--ray: the cluster placed {len(ready)} of the {self.opts.min_workers} workers needed within "
                f"{self.opts.timeout_s:g} s (--ray-timeout); each asks for {self.asks}, the cluster has {have}. "
                "Lower --ray-resources or --tensor-parallel, add nodes, or raise --ray-timeout")
        return sorted(ready)

    def end(self) -> None:
        """The job's actors go (their engines with them), whether or not this process stays connected."""
        for actor in [*self.workers.values(), self.queue]:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    # -- the job

    def run(self) -> JobResult:
        cfg = self.cfg
        members = self.wait_placed()
        try:
            prepare_output(cfg.output_url, {"config": self.fingerprint}, overwrite=cfg.output.overwrite)
        except OutputError as e:
            raise JobConfigError(str(e)) from None
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._job(members)
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _job(self, members: list[int]) -> JobResult:
        """Plans here (the workers run meanwhile), then watches the workers until every unit is written."""
        cfg, start = self.cfg, time.time()
        info, tokenizer, engine_config = self.ray.get(self.workers[members[0]].face.remote())
        self.ship = Shipper(self.ray, self.queue, self.world, cfg.sampling.n * cfg.sampling.max_tokens,
                            WINDOW_ROWS, self.wait_room)
        # the driver's parts read the done ids (the one scan of the parts) and write the rows that need no
        # engine (errors, result-cache hits): in `part-plan` parts
        self.parts = open_parts(cfg, self.resolved, info, tokenizer, engine_config, part_prefix="part-plan",
                                stop=self.stop)
        for k in members:
            self.launch(k)
        planned = self.ship.ship(self.parts, info)
        self.queue.close.remote()
        log.info("ray: planned %d rows in %d bundles in %.1f s", self.ship.shipped_rows, self.ship.bundles,
                 time.time() - start)
        while self.runs or (self.queued() and not self.stop.is_set() and self._relaunch()):
            self.watch(1.0)
        return self._finish(planned, start)

    def launch(self, k: int) -> None:
        slot = self.next_slot
        self.next_slot += 1
        self.runs[self.workers[k].run.remote(self.launched.get(k, 0), slot, self.world, self.queue)] = (k, slot)
        self.launched[k] = self.launched.get(k, 0) + 1

    def _relaunch(self) -> bool:
        """Units came back after the workers left (a lost worker's): the idle ones run again, else a
        restarted one within --ray-timeout. False: none is left (the job ends, exit 1)."""
        if not self.idle and self.loading:
            self.idle += self.poll_loaded(self.opts.timeout_s)
        for k in self.idle:
            self.launch(k)
        self.idle = []
        return bool(self.runs)

    def queued(self) -> int:
        return self.ray.get(self.queue.status.remote())["queued"]

    def wait_room(self, rows: int) -> None:
        """Shipper's wait: until the queue holds under `rows` (or the job stops: no worker is left)."""
        while self.ray.get(self.queue.status.remote())["queued_rows"] >= rows and not self.stop.is_set():
            if not self.runs and not self._relaunch():
                self.no_workers = True
                self.stop.set()
                break
            self.watch(0.5)
        self.watch(0)

    def watch(self, timeout: float) -> None:
        """Late workers join, ended runs are collected, a lost worker's unwritten rows go back to the
        queue, progress is logged; waits up to `timeout` s for a run to end."""
        if self.stop.is_set() and not self.stop_sent:
            self.stop_sent = True
            self.queue.stop.remote()
        for k in self.poll_loaded(0):
            log.info("ray: worker %d joins", k)
            self.launch(k)
        finished = []
        if self.runs:
            finished, _ = self.ray.wait(list(self.runs), num_returns=len(self.runs), timeout=timeout)
        for f in finished:
            k, slot = self.runs.pop(f)
            try:
                v = self.ray.get(f)
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.RayTaskError) as e:
                self._lost(k, slot, e)
                continue
            if v.get("config_error"):
                raise JobConfigError(v["error"])
            self.results.append(v)
            if v["exit_code"] == EXIT_OK:
                self.idle.append(k)
        self._progress()

    def _lost(self, k: int, slot: int, e: Exception) -> None:
        log.error("ray: worker %d stopped: %s", k, first_line(e))
        self.first_error = self.first_error or f"worker {k}: {first_line(e)}"
        if not isinstance(e, self.ray.exceptions.RayActorError):    # alive, its engine broken: it wrote nothing since
            self.ray.kill(self.workers[k], no_restart=False)       # Ray restarts it (max_restarts)
        self.lost.append(k)
        written = self.parts.writer.written_ids(f"part-r{slot}")
        self.lost_rows += len(written)
        rows, bundles = refill(self.ray, self.queue, self.ray.get(self.queue.take.remote(slot)), written)
        log.warning("ray: worker %d had written %d rows; its %d unwritten rows (%d bundles) go back to the queue",
                    k, len(written), rows, bundles)
        self.loading[self.workers[k].load.remote(*self.load_args)] = k     # restarted (max_restarts), it joins

    def _progress(self) -> None:
        now = time.time()
        if now - self.last_log < PROGRESS_LOG_S:
            return
        first = self.last_log == 0.0
        self.last_log = now
        try:
            status = self.ray.get(self.queue.status.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - the queue's answer is informative only
            return
        p = list(status["progress"].values())
        plan = self.parts.stats if self.parts is not None else None
        rows, failed, tokens = (sum(x[k] for x in p) for k in ("rows", "failed", "tokens"))
        if plan is not None:
            rows += plan.rows
        skipped = plan.rows_skipped if plan is not None else 0
        if first:
            self._t0, self._rows0 = now, rows
        rate = (rows - self._rows0) / max(now - self._t0, 1e-9)
        left = (self.total - rows - skipped) if self.total else None
        eta = f", ETA {left / rate:.0f} s" if left is not None and rate > 0 else ""
        log.info("%d%s rows, %d failed, %d tokens, %.1f rows/s%s, %d workers, %d bundles handed out, %d queued",
                 rows + skipped, f"/{self.total}" if self.total else "", failed, tokens, rate, eta, len(self.runs),
                 status["handed"], status["queued"])

    def _on_signal(self, signum, frame):
        if self.stop.is_set():
            raise SignalInterrupt
        self.stop.set()
        log.warning("signal %d: workers finish what is written, then stop", signum)
        self.queue.stop.remote()

    def _finish(self, planned: dict, start: float) -> JobResult:
        cfg, results = self.cfg, self.results
        ever = {v["rank"] for v in results} | set(self.lost)
        run = merge_stats(results, cfg.engine, cfg.parallel, cfg.output, wall_s=time.time() - start, devices=len(ever),
                          rounds=1, lost=self.lost,
                          planner=planned, lost_rows=self.lost_rows)
        codes = {v["exit_code"] for v in results}
        interrupted = self.stop.is_set() and not self.no_workers       # a signal, here or in the plan's Job
        # every row shipped comes back in a part: the live runs' rows and the lost workers' parts
        unwritten = self.ship.shipped_rows - (run["rows"] - planned.get("rows", 0)) - self.lost_rows
        complete = not self.stop.is_set() and not self.queued() and unwritten <= 0
        code = (EXIT_STORAGE if EXIT_STORAGE in codes else EXIT_INTERRUPTED if interrupted
                else EXIT_OK if complete else EXIT_FAILED)
        run["interrupted"] = run["interrupted"] or code == EXIT_INTERRUPTED
        summary = job_summary(cfg.output_url, self.fingerprint, run)
        why = None
        if code == EXIT_OK:
            code, why = verdict(cfg.input, cfg.output, cfg.output_url, summary, run["rows"])
        elif code == EXIT_FAILED and unwritten > 0 and not self.no_workers:
            why = (f"{unwritten} of the {self.ship.shipped_rows} rows shipped to the Ray workers came back in no "
                   "part; the rows written are kept: run the same command again to write the others"
                   + (f" (the first worker error: {self.first_error})" if self.first_error else ""))
            log.error("ray: %s", why)
        elif code == EXIT_FAILED:
            why = ("every Ray worker was lost; the rows written are kept: run the same command again to resume"
                   + (f" (the first worker error: {self.first_error})" if self.first_error else ""))
        ctx = self.ray.get_runtime_context()
        m = {**self.parts.manifest, "config": self.fingerprint,
             "ray": {"job_id": ctx.get_job_id(), "address": self.opts.address, "workers": len(ever),
                     "submission_id": os.environ.get("RAY_JOB_SUBMISSION_ID")}}
        write_ending(cfg.output, cfg.output_url, summary, m, complete, interrupted=code == EXIT_INTERRUPTED, by_workers=True)
        return JobResult(code, summary, cfg.output_url, error=why)


def for_workers(cfg: JobConfig, resolved: Resolved) -> tuple[JobConfig, Resolved]:
    """(cfg, resolved) as a worker in another working directory reads them: local paths (the dataset, the
    output, the model, the adapters, the result cache) made absolute here. Only what is shipped: the
    driver's own config keeps them as given (the output's fingerprint has them so)."""
    i, o = cfg.input, cfg.output
    cfg = replace(cfg, input=replace(i, dataset=absolute_url(i.dataset)),
                  output=replace(o, output=absolute_url(cfg.output_url)))
    resolved = replace(resolved, model=absolute_if_here(resolved.model),
                       cache_url=resolved.cache_url and absolute_url(resolved.cache_url),
                       lora=tuple((n, absolute_if_here(p), h) for n, p, h in resolved.lora))
    return cfg, resolved
