"""A Job's parts, made from its configuration and what jobrunner.job.resolve found, and the Job built
of them in one constructor call (`open_job`). The parts below the engine (`open_parts`: the kind, the
intake, the emitter, the planner, the writer) need only what the engine describes of itself (its info,
tokenizer and config): a Ray driver plans with them and no engine. A data-parallel worker is the same
Job with another work source (jobrunner/parallel/worker.py: SharedUnits) and progress;
`jobrunner.generate` the same Job with another reader and its rows kept in memory (output.RowSink)."""
from __future__ import annotations

import json
import logging
import posixpath
import threading
from dataclasses import dataclass, replace
from functools import partial

import fsspec

from jobrunner.engine import ConfigError, ModelError
from jobrunner.cache.key import job_model_key
from jobrunner.cache.reuse import Reuse
from jobrunner.config.job import JobConfig, JobConfigError
from jobrunner.config.sections import InputOptions, OutputOptions, ParallelOptions
from jobrunner.dataset import input_types, read_rows, rows_to_read
from jobrunner.images import ImagePrep
from jobrunner.pipeline import checks
from jobrunner.pipeline.contracts import RowWriter
from jobrunner.pipeline.emit import Emitter
from jobrunner.pipeline.ending import JobResult, verdict
from jobrunner.pipeline.intake import Intake
from jobrunner.pipeline.loop import Job
from jobrunner.pipeline.manifest_entries import job_manifest
from jobrunner.pipeline.plan import WINDOW_ROWS, AllUnits, JobPlanner
from jobrunner.pipeline.progress import Progress
from jobrunner.pipeline.resolve import Resolved, open_cache, resolve, resolve_engine
from jobrunner.models.known import describe
from jobrunner.openai.job_kind import job_for
from jobrunner.output import ResultWriter, RowSink, mark_complete, read_manifest
from jobrunner.output.schema import result_schema
from jobrunner.output.summary import job_summary, summary_of
from jobrunner.common.run_stats import JobStats
from jobrunner.common.threads import FixedThreads, ThreadGovernor, available_cores
from jobrunner.jobs import PromptBuilder
from jobrunner.jobs.kind import JobKind
from jobrunner.jobs.template import PromptTemplate

log = logging.getLogger("jobrunner")


@dataclass
class JobParts:
    """A job's parts below its engine and work source: what the loop (pipeline.loop.Job) runs on, and what a
    Ray driver plans with; and the sections of its configuration that its end reads (the output at
    `output_url`, its options; the dataset's options; the engine's ranks). in_memory: the writer is a
    RowSink (no output directory)."""
    manifest: dict
    kind: JobKind                   # the jobs kind (or an OpenAI batch's routed kind)
    intake: Intake
    emit: Emitter
    planner: JobPlanner
    reuse: Reuse
    writer: RowWriter               # output.ResultWriter, or output.RowSink where in_memory
    stats: JobStats
    input: InputOptions
    output: OutputOptions
    output_url: str                 # JobConfig.output_url
    parallel: ParallelOptions
    in_memory: bool = False

    def summary(self, run: dict) -> dict:
        """The summary of every row of the output (its parts and earlier runs; or the RowSink's rows)."""
        if self.in_memory:
            return summary_of(self.writer.tables, self.manifest["config"], [run])
        return job_summary(self.output_url, self.manifest["config"], run)


def open_parts(cfg: JobConfig, resolved: Resolved, info, tokenizer, engine_config, *, rank: int = 0,
               part_prefix: str = "part", hits_now: bool = True, reader=None, done_ids=None,
               in_memory: bool = False, schema_from_rows: bool = False, fingerprint: dict | None = None,
               stop=None, image_processor=None) -> JobParts:
    """The parts of cfg's job on an engine of `info`, `tokenizer` and `engine_config` (engine.EngineInfo,
    its tokenizer, engine.EngineConfig). rank, part_prefix, hits_now: the work source's; reader: batches
    of Rows (else the dataset's); done_ids: the ids to skip (else those in the output's parts);
    in_memory: rows kept in a RowSink, cfg's output never touched (schema_from_rows: rows with no file
    behind them, typed from the first written, else declared from the dataset's columns); fingerprint: the output's (a Ray
    worker's: its driver's, whose paths are as given where the worker's are absolute), else cfg's;
    stop: the threading.Event that stops the intake between batches; image_processor: the engine's
    (Engine.image_processor: a vision-language model's, else None; where no engine is at hand and info
    says it takes images, read from the checkpoint: engine.load_image_processor)."""
    kind, builder = job_kind(cfg, resolved, info, tokenizer, engine_config.model)
    images = _image_prep(cfg, info, engine_config, tokenizer, image_processor)
    sampling = cfg.sampling_sources(info.generation.sampling) if cfg.kind.name == "generate" else None
    manifest = job_manifest(fingerprint if fingerprint is not None else resolved.fingerprint(cfg), resolved, info,
                            engine_config.model, cfg.engine.model, cfg.lora, sampling, rank)
    stats = JobStats()
    writer = _writer(cfg, resolved.fmt, manifest, kind, info, part_prefix, done_ids, in_memory, schema_from_rows,
                     run_record=partial(_time_record, stats, info, cfg))
    reuse = _reuse(cfg, resolved, info, engine_config, stats)
    emit = Emitter(kind, writer, stats, reuse, id_column=cfg.input.id_column, fmt=resolved.fmt, rank=rank,
                   speculative=engine_config.speculative != "off")
    i = cfg.input
    reader = reader or (lambda: read_rows(i.dataset, resolved.fmt, id_column=i.id_column, batch_rows=1024,
                                          csv_delimiter=i.csv_delimiter, max_row_bytes=i.max_row_bytes))
    intake = Intake(reader, builder=builder, kind=kind, tokenizer=tokenizer, reuse=reuse, emit=emit, stats=stats,
                    done_ids=writer.done_ids, failed_ids=writer.failed_ids, done_repeats=writer.done_repeats,
                    limit=i.limit, show_prompt=cfg.prompt.show_prompt, hits_now=hits_now, stop=stop,
                    image_column=i.image_column, images=images, context=info.max_model_len)
    planner = JobPlanner(cfg.engine.plan, cfg.engine.block_size, cfg.lora)
    return JobParts(manifest, kind, intake, emit, planner, reuse, writer, stats, cfg.input, cfg.output, cfg.output_url,
                    cfg.parallel, in_memory)


def open_job(cfg: JobConfig, resolved: Resolved | None = None, *, engine=None, work=None, progress=None,
             reader=None, max_in_flight: int | None = None, done_ids=None, stop=None, in_memory: bool = False,
             schema_from_rows: bool = False, fingerprint: dict | None = None) -> Job:
    """The Job of cfg, its parts made here but those given: `resolved` (else resolved here, without
    the output's state), `engine` (else loaded: closed again if a later part fails), `work` (else
    AllUnits), `progress` (else a Progress bar or log line), `stop` (the threading.Event that stops the
    job, else its own: its signal handlers set it); reader, done_ids, in_memory, schema_from_rows, fingerprint:
    open_parts'."""
    resolved = resolved or resolve(cfg, output_state=False)
    work = work or AllUnits()
    stop = stop if stop is not None else threading.Event()
    loaded = engine is None
    engine = engine or load_engine(cfg, resolved)
    try:
        parts = open_parts(cfg, resolved, engine.info, engine.tokenizer, engine.config, rank=work.rank,
                           part_prefix=work.part_prefix, hits_now=work.hits_now, reader=reader, done_ids=done_ids,
                           in_memory=in_memory, schema_from_rows=schema_from_rows,
                           fingerprint=fingerprint, stop=stop, image_processor=getattr(engine, "image_processor", None))
    except BaseException:
        if loaded:
            engine.close()
        raise
    return Job(parts, engine=engine, work=work, progress=progress or _progress(cfg, resolved, engine),
               max_in_flight=max_in_flight, stop=stop, threads=_threads(cfg, engine))


def _threads(cfg: JobConfig, engine):
    """A governor that follows the machine's load (jobrunner/common/threads.py) where the threads were left to
    the machine: a CPU engine of one process, no --threads; else the threads stay fixed."""
    if engine.info.device_type != "cpu" or cfg.parallel.tensor_parallel > 1:
        return FixedThreads()
    if cfg.engine.threads is not None:      # an engine kept between jobs may have followed an earlier one's load
        engine.set_threads(cfg.engine.threads)
        return FixedThreads()
    cores = available_cores()
    start = engine.config.num_threads or cores
    engine.set_threads(start)          # an engine kept between jobs (jobrunner.generate) starts where its config says
    return ThreadGovernor(engine.set_threads, start, cores)


def _time_record(stats: JobStats, info, cfg: JobConfig) -> dict:
    """The run's time so far, as each part it flushes records it (output/parts.py, RUN_METADATA)."""
    return stats.time_record(device=info.device, devices=cfg.parallel.tensor_parallel, load_s=info.load_s,
                             quantization=info.quantization, device_hourly_cost=cfg.output.device_hourly_cost)


def _writer(cfg: JobConfig, fmt: str, manifest: dict, kind: JobKind, info, part_prefix: str, done_ids,
            in_memory: bool, schema_from_rows: bool = False, run_record=None) -> RowWriter:
    """Where the job's rows go: a RowSink, or a ResultWriter writing parts into cfg's output directory
    (each part recording `run_record()`). fmt: the dataset's format as resolve found it (not sniffed again)."""
    if in_memory and schema_from_rows:
        return RowSink(None, cfg.output.part_rows)
    i = cfg.input
    columns = input_types(i.dataset, fmt, i.id_column, i.csv_delimiter)
    schema = result_schema(columns, i.id_column, kind, info.hidden_size,    # embeddings: the hidden size
                           speculative=cfg.engine.speculative != "off")
    if in_memory:
        return RowSink(schema, cfg.output.part_rows)
    checks.check_same_commit(cfg.output, cfg.output_url, cfg.engine.model, manifest)
    return checks.open_writer(cfg.output, cfg.output_url, manifest, partial(ResultWriter, run_record=run_record),
                              part_prefix, schema, done_ids)


def job_kind(cfg: JobConfig, resolved: Resolved, info, tokenizer, model: str):
    """(the job kind, the prompt builder) of cfg on this tokenizer and checkpoint (`info`: its
    engine.EngineInfo; `model`: the checkpoint's path as the engine loaded it)."""
    checks.check_dimensions(cfg.kind, info)
    # unset sampling options: the checkpoint's; the context: for truncation
    spec = replace(cfg.job_spec(info.generation.sampling), context=info.max_model_len)
    template = PromptTemplate(cfg.prompt.template) if cfg.prompt.template else None     # resolve checked it
    builder = PromptBuilder(spec, tokenizer, template, images=getattr(info, "vision", False))
    try:        # an OpenAI batch file: each line's url picks its kind (jobrunner.openai.routed)
        kind = job_for(resolved.fmt, cfg.engine, cfg.input, cfg.lora, spec, tokenizer, info.pooling, model, builder)
    except ValueError as e:         # embed: a checkpoint pooling we don't reproduce
        raise JobConfigError(str(e)) from None
    return kind, builder


def _image_prep(cfg: JobConfig, info, engine_config, tokenizer, processor) -> ImagePrep | None:
    """The job's image work (jobrunner/images) on the model's image processor; None for a model that takes
    no images (its rows with images are error rows). Without the engine's processor (a Ray driver plans
    on a worker's info), a vision model's is read from its checkpoint's config and preprocessor config."""
    if processor is None and getattr(info, "vision", False):
        processor = _checkpoint_image_processor(engine_config.model, tokenizer)
    if processor is None:
        return None
    return ImagePrep(processor, cfg.input.image_limits(), dataset=cfg.input.dataset)


def _checkpoint_image_processor(model: str, tokenizer):
    from jobrunner import engine

    def read(name: str) -> dict:
        with fsspec.open(posixpath.join(model, name), "rb") as f:
            return json.loads(f.read())
    try:
        return engine.load_image_processor(read("config.json"), read("preprocessor_config.json"), tokenizer)
    except (OSError, ValueError) as e:
        raise JobConfigError(f"model {model}: cannot read its image processor ({type(e).__name__}: {e})") from None


def _reuse(cfg: JobConfig, resolved: Resolved, info, engine_config, stats):
    store, model = open_cache(resolved.cache_url), None
    if store is not None:
        model = job_model_key(engine_config.model, info, info.quantization, cfg.engine.kv_cache_dtype)
    return Reuse(stats, cfg.kind.name, dedup=cfg.reuse.dedup, window_rows=WINDOW_ROWS, store=store,
                 mode=cfg.reuse.cache_mode, model=model, adapters=resolved.adapter_hashes)
def load_engine(cfg: JobConfig, resolved=None):
    """The engine of cfg, on the model and precision `resolved` found (jobrunner.job.resolve; without it,
    resolve.resolve_engine: the model and precision alone)."""
    if resolved is None:
        resolved = resolve_engine(cfg)
    checks.check_gpus(cfg.engine, cfg.parallel)                             # --tensor-parallel N: N GPUs from the one named
    config = cfg.engine_config(resolved)
    from jobrunner.engine import Engine       # the Engine's module loads torch: only once a job loads its model
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
    return Progress(total=rows_to_read(cfg.input, resolved.fmt), counters=engine.counters,
                    in_flight=lambda: engine.num_in_flight)


def finish_done(cfg: JobConfig, resolved: Resolved) -> JobResult:
    """The JobResult of a rerun with nothing left to do (Resolved.rows_done): the whole output's summary
    and exit code, no model loaded. An output whose run was killed after its last part is marked
    complete now."""
    rows_done = resolved.rows_done
    log.info("nothing left to do: all %d rows are in %s already (the model was not loaded)", rows_done, cfg.output_url)
    summary = job_summary(cfg.output_url, resolved.fingerprint(cfg))
    manifest = read_manifest(cfg.output_url) or {}
    if not manifest.get("complete"):
        mark_complete(cfg.output_url, summary, manifest)
    # over the whole output (a failed job stays failed)
    code, why = verdict(cfg.input, cfg.output, cfg.output_url, summary, 0, read_any=bool(rows_done))
    return JobResult(code, summary, cfg.output_url, error=why)
