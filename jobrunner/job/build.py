"""A Job's parts, made from its configuration and what jobrunner.job.resolve found, and the Job built of
them in one constructor call (`open_job`). A data-parallel worker is the same Job with another work
source (jobrunner/parallel/worker.py: SharedUnits) and progress; `jobrunner.generate` the same Job
with another reader and its rows kept in memory (output.RowSink) instead of an output directory."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from jobrunner.job import checks
from jobrunner.config.job import JobConfig, JobConfigError
from jobrunner.job.loop import Job, JobResult, exit_code_of
from jobrunner.config.lora import LoraOptions
from jobrunner.planner import PlanItem, PrefixStats, WorkUnit, plan, prefix_stats
from jobrunner.planner.window import split_windows
from jobrunner.job.resolve import Resolved, open_cache, resolve, resolve_engine

log = logging.getLogger("jobrunner")

# A planning window: rows read, tokenized and ordered together. Rows bound it for usual prompts
# (~80 MB at 50,000 rows); tokens bound it for long ones (~8 bytes a token while a row waits:
# its encoding for the planner and its packed token ids; ~0.5 GB at 64M tokens).
WINDOW_ROWS = 50_000
WINDOW_TOKENS = 64_000_000


@dataclass
class JobPlanner:
    """Plan items -> work units: ordered so shared prefixes run back to back (--plan), or in dataset
    order; either way the prefix figures of each window are measured into `prefix`."""
    ordered: bool
    block_size: int
    lora: LoraOptions = LoraOptions()      # its adapters' rows are grouped, each apart (LoraOptions.plan_tokens)
    prefix: PrefixStats = field(init=False)

    def __post_init__(self):
        self.prefix = PrefixStats(block_size=self.block_size)

    def item(self, key, adapter: str | None, tokens) -> PlanItem:
        """A row's plan item: its tokens, after its LoRA adapter's mark."""
        return PlanItem(key, self.lora.plan_tokens(adapter, tokens))

    def units(self, items):
        if self.ordered:
            yield from plan(items, window_rows=WINDOW_ROWS, block_size=self.block_size, stats=self.prefix,
                            window_tokens=WINDOW_TOKENS)
            return
        for window in split_windows(items, WINDOW_ROWS, WINDOW_TOKENS, lambda it: len(it.tokens)):
            self.prefix.merge(prefix_stats([it.tokens for it in window], block_size=self.block_size))
            for i, it in enumerate(window, 1):
                yield WorkUnit([it.key], len(it.tokens), len(it.tokens), window_end=i == len(window))


class AllUnits:
    """The work source of a job in one process: every unit, in the planner's order; a result-cache hit
    is written as soon as it is found. A work source names its parts' prefix, and whether its engine
    runs rows (runs_rows: the Ray driver's ships every unit and runs none)."""
    rank, world, part_prefix, hits_now, runs_rows = 0, 1, "part", True, True

    def units(self, units, tokens_of):
        for unit in units:
            yield unit, True


def open_job(cfg: JobConfig, resolved: Resolved | None = None, *, engine=None, work=None, progress=None,
             reader=None, max_in_flight: int | None = None, done_ids=None, stop=None, in_memory: bool = False,
             fingerprint: dict | None = None) -> Job:
    """The Job of cfg, its parts made here but those given: `resolved` (else resolved here, without
    the output's state), `engine` (else loaded: closed again if a later part fails), `work` (else
    AllUnits), `progress` (else a Progress bar or log line), `reader` (else the dataset's rows),
    `done_ids` (the ids to skip, else those in the output's parts), `stop` (the threading.Event that
    stops the job, else its own: its signal handlers set it). in_memory: the result rows are kept in a
    RowSink (job.writer.table()), and cfg's output directory is never touched. fingerprint: the output's
    (a Ray worker's: its driver's, whose paths are as given where the worker's are absolute), else cfg's."""
    from jobrunner.dataset import read_rows
    from jobrunner.job.manifest import job_manifest
    from jobrunner.stats import JobStats
    resolved = resolved or resolve(cfg, output_state=False)
    work = work or AllUnits()
    loaded = engine is None
    engine = engine or load_engine(cfg, resolved)
    try:
        kind, builder = job_kind(cfg, resolved, engine)
        manifest = job_manifest(cfg, resolved, engine.info, engine.config.model, work.rank, fingerprint)
        writer = _writer(cfg, manifest, kind, engine, work, done_ids, in_memory)
        stats = JobStats()
        reuse = _reuse(cfg, resolved, engine, stats)
    except BaseException:
        if loaded:
            engine.close()
        raise
    i = cfg.input
    return Job(cfg, reader=reader or (lambda: read_rows(i.dataset, resolved.fmt, id_column=i.id_column,
                                                         batch_rows=1024, csv_delimiter=i.csv_delimiter)),
               kind=kind, builder=builder, planner=JobPlanner(cfg.engine.plan, cfg.engine.block_size, cfg.lora),
               engine=engine, reuse=reuse, writer=writer, work=work,
               progress=progress or _progress(cfg, resolved, engine), stats=stats, manifest=manifest,
               fmt=resolved.fmt, max_in_flight=max_in_flight, stop=stop, threads=_threads(cfg, engine, work))


def _threads(cfg: JobConfig, engine, work):
    """A governor that follows the machine's load (jobrunner/threads.py) where the threads were left to
    the machine: a CPU engine of one process that runs rows, no --threads; else the threads stay fixed."""
    from jobrunner.threads import FixedThreads, ThreadGovernor, available_cores
    if engine.info.device_type != "cpu" or cfg.parallel.tensor_parallel > 1 or not work.runs_rows:
        return FixedThreads()
    if cfg.engine.threads is not None:      # an engine kept between jobs may have followed an earlier one's load
        engine.set_threads(cfg.engine.threads)
        return FixedThreads()
    cores = available_cores()
    start = engine.config.num_threads or cores
    engine.set_threads(start)          # an engine kept between jobs (jobrunner.generate) starts where its config says
    return ThreadGovernor(engine.set_threads, start, cores)


def _writer(cfg: JobConfig, manifest: dict, kind, engine, work, done_ids, in_memory: bool):
    """Where the job's rows go: a RowSink, or a ResultWriter writing parts into cfg's output directory."""
    from jobrunner.output import ResultWriter, RowSink
    if in_memory:
        return RowSink(checks.declared_schema(cfg, kind, engine), cfg.output.part_rows)
    checks.check_same_commit(cfg, manifest)
    return checks.open_writer(cfg, manifest, ResultWriter, work.part_prefix, kind, engine, done_ids)


def job_kind(cfg: JobConfig, resolved: Resolved, engine):
    """(the job kind, the prompt builder) of cfg on this engine's tokenizer and checkpoint."""
    from jobrunner.openai.kinds import job_for
    from jobs import PromptBuilder
    from jobs.template import PromptTemplate
    checks.check_dimensions(cfg, engine.info)
    # unset sampling options: the checkpoint's; the context: for truncation
    spec = replace(cfg.job_spec(engine.info.generation.sampling), context=engine.info.max_model_len)
    try:        # an OpenAI batch file: each line's url picks its kind (jobrunner.openai.routed)
        kind = job_for(resolved.fmt, cfg, spec, engine.tokenizer, engine.info.pooling, engine.config.model)
    except ValueError as e:         # embed: a checkpoint pooling we don't reproduce
        raise JobConfigError(str(e)) from None
    template = PromptTemplate(cfg.prompt.template) if cfg.prompt.template else None     # resolve checked it
    return kind, PromptBuilder(spec, engine.tokenizer, template)


def _reuse(cfg: JobConfig, resolved: Resolved, engine, stats):
    from jobrunner.cache import job_model_key
    from jobrunner.cache.reuse import Reuse
    store, model = open_cache(resolved.cache_url), None
    if store is not None:
        model = job_model_key(engine.config.model, engine.info, engine.config.quantization, cfg.engine.kv_cache_dtype)
    return Reuse(stats, cfg.kind.name, dedup=cfg.reuse.dedup, window_rows=WINDOW_ROWS, store=store,
                 mode=cfg.reuse.cache_mode, model=model, adapters=resolved.adapter_hashes)


def load_engine(cfg: JobConfig, resolved=None):
    """The engine of cfg, on the model and precision `resolved` found (jobrunner.job.resolve; without it,
    resolve.resolve_engine: the model and precision alone)."""
    if resolved is None:
        resolved = resolve_engine(cfg)
    from engine import ConfigError, Engine, ModelError
    from jobrunner.models import describe
    from jobrunner.parallel.world import check_gpus
    check_gpus(cfg)                             # --tensor-parallel N: N GPUs from the one named
    config = cfg.engine_config(resolved)
    try:
        engine = Engine(config)
    except (ModelError, ConfigError) as e:
        raise JobConfigError(str(e)) from None
    except OSError as e:    # a checkpoint file gone or unreadable: the model's failure, not the output's storage
        raise JobConfigError(f"model {cfg.engine.model} failed to load: {type(e).__name__}: {e}") from None
    info = engine.info
    threads = f", {config.num_threads} threads" if info.device_type == "cpu" else ""
    split = f" x {config.tensor_parallel} tensor-parallel ranks" if config.tensor_parallel > 1 else ""
    log.info("model %s on %s%s%s (%s), %d KV blocks of %d tokens, loaded in %.1fs",
             describe(cfg.engine.model, info.source), info.device, split, threads, info.dtype.removeprefix("torch."),
             info.num_blocks, cfg.engine.block_size, info.load_s)
    if cfg.prompt.chat and not engine.tokenizer.has_chat_template:
        engine.close()
        raise JobConfigError(f"--chat was asked for but model {cfg.engine.model} has no chat template; use --no-chat")
    return engine


def _progress(cfg: JobConfig, resolved: Resolved, engine):
    from jobrunner.dataset import count_rows
    from jobrunner.job.progress import Progress
    try:
        n = count_rows(cfg.input.dataset, resolved.fmt)
    except Exception:
        n = None
    limit = cfg.input.limit
    return Progress(total=min(n, limit) if (n is not None and limit) else n, counters=engine.counters)


def finish_done(cfg: JobConfig, resolved: Resolved) -> JobResult:
    """The JobResult of a rerun with nothing left to do (Resolved.rows_done): the whole output's summary
    and exit code, no model loaded. An output whose run was killed after its last part is marked
    complete now."""
    from jobrunner.output import mark_complete, read_manifest
    from jobrunner.stats import JobStats
    from jobrunner.output.summary import job_summary
    stats = JobStats()
    stats.rows_skipped = rows_done = resolved.rows_done
    log.info("nothing left to do: all %d rows are in %s already (the model was not loaded)", rows_done, cfg.output_url)
    summary = job_summary(cfg.output_url, cfg.fingerprint_fields(resolved.adapter_hashes))
    manifest = read_manifest(cfg.output_url) or {}
    if not manifest.get("complete"):
        mark_complete(cfg.output_url, summary, manifest)
    code, why = exit_code_of(cfg, summary, stats)        # over the whole output (a failed job stays failed)
    return JobResult(code, summary, cfg.output_url, error=why)
