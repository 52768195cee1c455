"""`jobrunner submit --ray [ADDRESS]`: the driver of a job whose workers are Ray actors.

    driver (this process)                     Ray cluster
    ---------------------                     -----------
    resolve once (no model), connect          RayWorker actors (ray_worker.py), one engine each,
    start up to max_workers actors (the       placed by Ray with num_gpus = --tensor-parallel
      config and Resolved as JSON),
      wait for min_workers (--ray-timeout)    (GPU clusters) or CPUs, and --ray-resources
    prepare the output once                   WorkQueue actor (ray_queue.py): tickets, progress
    rounds: the done ids snapshot (object
      store) -> every member's run_round      a round: every member plans the rows not in the
    late workers join the open round          snapshot identically and claims units from the queue
    merged _stats.json, complete manifest     parts written with today's atomic protocol

A worker whose actor dies (node lost, OOM, kill -9) fails its run_round with RayActorError; the
others finish the round, and the next round (with the survivors and the restarted actor, Ray's
max_restarts) plans exactly the rows still missing from the parts. Every id is written once.
"""
from __future__ import annotations

import hashlib
import logging
import os
import signal
import time

from jobrunner.config import JobConfig, JobConfigError
from jobrunner.exit_codes import rows_verdict
from jobrunner.job import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_STORAGE, JobResult
from jobrunner.parallel.ending import write_ending
from jobrunner.parallel.stats import merge_stats
from jobrunner.parallel.world import preflight

log = logging.getLogger("jobrunner")

MAX_ROUNDS = 8              # passes over the remaining rows after workers died
NAMESPACE = "jobrunner"
PROGRESS_LOG_S = 10.0       # the driver's progress line when not on a terminal


def import_ray(address: str):
    """Ray, or JobConfigError naming the extra. A private local cluster (or one on a loopback address) stays
    on loopback: Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import (0: every address 127.0.0.1)."""
    if address == "local" or address.split("://")[-1].startswith(("127.", "localhost")):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError:
        raise JobConfigError("--ray needs Ray: pip install 'jobrunner[ray]'") from None
    return ray


def connect(ray, address: str) -> None:
    kwargs = dict(namespace=NAMESPACE, log_to_driver=True, logging_level=logging.WARNING)
    try:
        if address == "local":
            ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", **kwargs)
        else:
            ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise JobConfigError(f"--ray {address}: cannot join the Ray cluster ({e}); start one with "
                             "`ray start --head`, give its address, or use --ray local") from None


def run_ray(cfg: JobConfig) -> JobResult:
    """The job over Ray actors. Raises JobConfigError (exit 2) for a configuration that can't run, and for a
    cluster that can't place --ray-min-workers workers within --ray-timeout."""
    device = cfg.engine.device
    if device.startswith("cuda:"):
        raise JobConfigError(f"--device {device} names one GPU; on Ray use --device cuda (Ray picks the GPUs)")
    resolved = preflight(cfg)       # jobrunner.resolve, once for the job: its workers get it as JSON
    address = cfg.parallel.ray.address
    ray = import_ray(address)
    joined = not ray.is_initialized()       # else: a caller already connected (a Ray Data pipeline) keeps it
    if joined:
        connect(ray, address)
    driver = RayDriver(cfg, resolved, ray)
    try:
        return driver.run()
    finally:
        driver.end()
        if joined:
            ray.shutdown()


class RayDriver:
    def __init__(self, cfg: JobConfig, resolved, ray):
        from jobrunner.parallel.ray_queue import WorkQueue
        self.cfg, self.resolved, self.ray, self.opts = cfg, resolved, ray, cfg.parallel.ray
        self.fingerprint = cfg.fingerprint_fields(resolved.adapter_hashes)
        self.tag = hashlib.blake2b(cfg.output_url.encode(), digest_size=6).hexdigest()
        self.queue = ray.remote(WorkQueue).options(name=f"{self.tag}-queue", num_cpus=0).remote()
        self.stopping = False
        self.last_log = 0.0

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
        from jobrunner.parallel.launcher import config_to_json
        from jobrunner.parallel.ray_worker import RayWorker
        opts, threads, n = self.worker_options()
        config, resolved = config_to_json(self.cfg), self.resolved.to_json()
        self.asks = {k: v for k, v in opts.items() if k in ("num_cpus", "num_gpus", "resources", "memory") and v}
        self._kill_leftovers(n)
        cls = self.ray.remote(RayWorker)
        self.workers = {k: cls.options(name=f"{self.tag}-w{k}", **opts).remote(config, resolved, k, threads)
                        for k in range(n)}
        self.loading = {self.workers[k].ready.remote(): k for k in range(n)}     # ready() ref -> rank
        self.world = max(2, n)      # every round plans for this many workers (worker.SharedUnits' spread)
        log.info("ray: %d workers asked for (each %s), at least %d within %.0f s", n,
                 ", ".join(f"{k} {v:g}" if not isinstance(v, dict) else str(v) for k, v in self.asks.items()),
                 self.opts.min_workers, self.opts.timeout_s)

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
                log.warning("ray: worker %d died while loading: %s", k, _first_line(e))
                continue
            if info["error"]:
                raise JobConfigError(info["error"])
            log.info("ray: worker %d loaded on %s (node %s, pid %d)", k, info["device"], info["node"][:8], info["pid"])
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
        for actor in [*getattr(self, "workers", {}).values(), self.queue]:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    # -- the job

    def run(self) -> JobResult:
        from jobrunner.output import OutputError, prepare_output
        cfg = self.cfg
        self.start_workers()
        members = self.wait_placed()
        try:
            prepare_output(cfg.output_url, {"config": self.fingerprint}, overwrite=cfg.output.overwrite)
        except OutputError as e:
            raise JobConfigError(str(e)) from None
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._rounds(members)
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _rounds(self, members: list[int]) -> JobResult:
        results, lost, complete, manifest, rounds, start = [], [], False, None, 0, time.time()
        ever = set(members)
        for r in range(MAX_ROUNDS):
            members = sorted(set(members) | set(self.poll_loaded(0)))
            if not members:         # every worker died: wait for a restarted one
                members = self.poll_loaded(self.opts.timeout_s) if self.loading else []
            if self.stopping or not members:
                break
            rounds = r + 1
            done, gone = self._round(r, members)
            ever |= set(done) | set(gone)
            results += done.values()
            lost += gone
            errors = [v["error"] for v in done.values() if v.get("config_error")]
            if errors:
                raise JobConfigError(errors[0])
            manifest = next((v["manifest"] for v in done.values() if v.get("manifest")), manifest)
            codes = {v["exit_code"] for v in done.values()}
            if self.stopping or codes & {EXIT_INTERRUPTED, EXIT_STORAGE}:
                break
            if not gone:
                complete = True
                break
            log.warning("ray: worker%s %s lost; the rows %s not written go to another round", "s" * (len(gone) > 1),
                        ", ".join(map(str, gone)), "they had" if len(gone) > 1 else "it had")
            members = sorted(done)
            for k in gone:          # a restarted actor (max_restarts) loads again, then joins
                self.loading[self.workers[k].ready.remote()] = k
        return self._finish(results, lost, complete, manifest, rounds, len(ever), start)

    def _round(self, r: int, members: list[int]) -> tuple[dict[int, dict], list[int]]:
        """Round r with `members` (rank -> slot by order); workers that finish loading meanwhile join it
        with a slot past every member's. Returns (rank -> payload, ranks lost)."""
        from jobrunner.output import ResultWriter
        cfg = self.cfg
        # nobody writes between rounds: the parts now are what this round skips, for every member alike
        snapshot = ResultWriter(cfg.output_url, {"config": self.fingerprint}, part_prefix="part-r0").done_ids
        ref = self.ray.put(snapshot)
        running = {}

        def launch(k: int, slot: int) -> None:
            running[self.workers[k].run_round.remote(r, slot, len(members), self.world, self.queue, ref)] = k
        for slot, k in enumerate(members):
            launch(k, slot)
        done, gone, joined = {}, [], 0
        while running:
            for k in self.poll_loaded(0):
                log.info("ray: worker %d joins round %d", k, r)
                launch(k, self.world + joined)
                joined += 1
            finished, _ = self.ray.wait(list(running), num_returns=len(running), timeout=1.0)
            for f in finished:
                k = running.pop(f)
                try:
                    done[k] = self.ray.get(f)
                except (self.ray.exceptions.RayActorError, self.ray.exceptions.RayTaskError) as e:
                    log.error("ray: worker %d stopped in round %d: %s", k, r, _first_line(e))
                    gone.append(k)
                    if not isinstance(e, self.ray.exceptions.RayActorError):    # alive, its engine broken
                        self.ray.kill(self.workers[k], no_restart=False)       # Ray restarts it (max_restarts)
            self._progress(r)
        return done, gone

    def _progress(self, r: int) -> None:
        now = time.time()
        if now - self.last_log < PROGRESS_LOG_S:
            return
        first = self.last_log == 0.0
        self.last_log = now
        try:
            status = self.ray.get(self.queue.status.remote(r), timeout=5)
        except Exception:  # noqa: BLE001 - the queue's answer is informative only
            return
        p = status["progress"].values()
        rows, failed, tokens = (sum(x[k] for x in p) for k in ("rows", "failed", "tokens"))
        skipped = max((x["skipped"] for x in p), default=0)
        total = next((x["total"] for x in p if x.get("total")), None)
        if not hasattr(self, "_t0") or first:
            self._t0, self._rows0 = now, rows
        rate = (rows - self._rows0) / max(now - self._t0, 1e-9)
        left = (total - rows - skipped) if total else None
        eta = f", ETA {left / rate:.0f} s" if left is not None and rate > 0 else ""
        log.info("round %d: %d%s rows, %d failed, %d tokens, %.1f rows/s%s, %d workers, %d units handed out",
                 r, rows + skipped, f"/{total}" if total else "", failed, tokens, rate, eta, len(p),
                 sum(status["tickets"].values()))

    def _on_signal(self, signum, frame):
        if self.stopping:
            raise KeyboardInterrupt
        self.stopping = True
        log.warning("signal %d: workers finish what is written, then stop", signum)
        self.queue.stop.remote()

    def _finish(self, results, lost, complete, manifest, rounds, workers, start) -> JobResult:
        from jobrunner.summary import job_summary
        cfg = self.cfg
        run = merge_stats(results, cfg, wall_s=time.time() - start, devices=workers, rounds=rounds, lost=lost)
        codes = {v["exit_code"] for v in results}
        code = (EXIT_STORAGE if EXIT_STORAGE in codes else EXIT_INTERRUPTED
                if EXIT_INTERRUPTED in codes or self.stopping else EXIT_OK if complete else EXIT_FAILED)
        run["interrupted"] = run["interrupted"] or code == EXIT_INTERRUPTED
        summary = job_summary(cfg.output_url, self.fingerprint, run)
        why = None
        if code == EXIT_OK:
            code, why = rows_verdict(cfg, summary, cfg.output_url, run["rows"])
        elif code == EXIT_FAILED:
            why = "every Ray worker was lost; the rows written are kept: run the same command again to resume"
        ctx = self.ray.get_runtime_context()
        m = {"config": self.fingerprint, **(manifest or {}),
             "ray": {"job_id": ctx.get_job_id(), "address": self.opts.address, "workers": workers,
                     "submission_id": os.environ.get("RAY_JOB_SUBMISSION_ID")}}
        write_ending(cfg, summary, m, complete)
        return JobResult(code, summary, cfg.output_url, error=why)


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]

