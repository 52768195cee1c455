"""The one step that does the IO a job's configuration implies, before any work: the dataset's format
and columns (and every check that needs them), the output's state, the model name's local path (a
known model or a Hub name may download here), each LoRA adapter's local directory (an fsspec URL is
copied, a Hub name downloaded) and content hash, what `--quantization auto` and the dtype default stand
for on this machine, and the result cache's URL. What it finds is a `Resolved`, kept beside the
JobConfig (never written into it), run once per job: by api.run in one process, by the launcher or
each torchrun rank before its workers start (they get it with the config), by `jobrunner validate`.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass

from jobrunner import engine
from jobrunner.engine import ConfigError, ModelError, check_adapter
from jobrunner.cache import ENV_URL
from jobrunner.cache.store import open_store
from jobrunner.config.job import JobConfig, JobConfigError
from jobrunner.config.lora import LoraOptions
from jobrunner.config.tool_options import check_job_tools
from jobrunner.pipeline import checks, preload
from jobrunner.pipeline.calibration import cpu_auto, output_begun, output_record, summary
from jobrunner.pipeline.precision import auto_precision, measures, on_gpu
from jobrunner.models.known import resolve_adapter, resolve_model

log = logging.getLogger("jobrunner")


@dataclass(frozen=True)
class Resolved:
    fmt: str                    # the input's format, detected (never "auto")
    columns: tuple[str, ...]    # the input's columns; () when a format has none to list
    model: str                  # what the engine loads (a local path, URL or dummy:)
    dtype: str                  # the engine's dtype option (auto stays auto: the engine picks by device)
    float_dtype: str            # the float dtype weights are computed in, for estimates (model_split)
    quantization: str           # never "auto"
    cache_url: str | None       # the result cache: --cache, else $JOBRUNNER_CACHE_URL, else None
    rows_done: int | None = None    # a rerun with every row in the output already: the rows read; else None
    lora: tuple[tuple[str, str, str], ...] = ()     # (name, local directory, content hash) of each adapter
    shipped: str | None = None  # a quantized checkpoint's scheme (engine.checkpoint_quantization), else None
    calibration: dict | None = None     # how `--quantization auto` chose on this CPU (jobrunner.job.calibration's
                                        # record, plain JSON); None: auto not asked, or decided without it
    draft_model: str | None = None      # --draft-model as the engine loads it, like `model`

    @property
    def adapter_paths(self) -> tuple[tuple[str, str], ...]:
        """(name, local directory) of each LoRA adapter: what the engine loads."""
        return tuple((name, path) for name, path, _ in self.lora)

    @property
    def adapter_hashes(self) -> dict[str, str]:
        """name -> content hash: the resume fingerprint and the result cache's keys."""
        return {name: digest for name, _, digest in self.lora}

    def fingerprint(self, cfg: JobConfig) -> dict:
        """cfg's resume fingerprint with what was resolved of it: adapters' hashes, the checkpoint's scheme."""
        return cfg.fingerprint_fields(self.adapter_hashes, self.shipped)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Resolved:
        d = json.loads(text)
        return cls(**{**d, "columns": tuple(d["columns"]), "lora": tuple(tuple(a) for a in d.get("lora", ()))})


def resolve(cfg: JobConfig, *, parallel: bool = False, output_state: bool = True, dry: bool = False) -> Resolved:
    """Every check that needs a file, in the order that fails cheapest first (the dataset, the template,
    a constraint, the cache URL, the model's path, the output): JobConfigError (exit 2) before any work.
    parallel: for a data-parallel launch, whose workers each see a share (an empty dataset warns here,
    and the output's state is the coordinator's to find). output_state False: for a job on an engine
    already loaded (tests, `jobrunner.generate`), which runs whatever the output holds. dry: for
    `jobrunner validate`, which writes nothing: the output is neither checked nor created."""
    i, o = cfg.input, cfg.output
    named = checks.named_columns(cfg.options(), cfg.given, cfg.kind.name, cfg.prompt.template)
    fmt, columns = checks.check_dataset(i, named)
    checks.check_template(cfg.prompt.template, i.dataset, columns, fmt)
    checks.check_constraint(cfg.kind, cfg.engine.grammar_timeout)
    check_job_tools(cfg.kind, cfg.prompt.chat)
    url = cache_url(cfg)
    open_cache(url)                   # a URL that cannot be opened: exit 2, before the output exists
    if parallel:
        checks.check_not_empty(i, o, fmt)
    elif not dry:
        preload.check_empty(i, o, fmt)      # --fail-on-empty: exit 2 before the output directory exists
    model = model_path(cfg.engine.model)    # a known name or a Hub name: pulled here, on first use
    draft = draft_path(cfg)
    check_sampling(cfg, model)              # --n > 1 at the checkpoint's greedy default
    shipped = shipped_scheme(cfg, model)
    lora = adapters(cfg.lora)
    if not dry:     # before the model loads: loading one can take minutes
        checks.check_output(cfg.output_url, cfg.fingerprint_fields({name: digest for name, _, digest in lora}, shipped),
                            o.overwrite)
    rows_done = (preload.rows_all_done(i, o, cfg.output_url, cfg.engine.model, fmt)
                 if output_state and not (parallel or dry) else None)
    resumes = None if dry or cfg.output.overwrite else cfg.output_url   # an output begun under auto keeps its mode
    dtype, quantization, calibration = precision(cfg, shipped, model, measure=not dry and rows_done is None,
                                                 resumes=resumes)
    return Resolved(fmt=fmt, columns=tuple(columns or ()), model=model, dtype=dtype,
                    float_dtype=float_dtype(cfg.engine.device, dtype), quantization=quantization,
                    cache_url=url, rows_done=rows_done, lora=lora, shipped=shipped, calibration=calibration,
                    draft_model=draft)


def check_sampling(cfg: JobConfig, model: str) -> None:
    """--n > 1 at temperature 0, given or left to the checkpoint (`model`: its resolved path) whose default
    is greedy: JobConfigError now (JobConfig.sampling_params' own check), not once the model is up."""
    defaults = preload.sampling_defaults(cfg.kind.name, cfg.sampling, model)
    if defaults is not None:
        cfg.sampling_params(defaults)


def shipped_scheme(cfg: JobConfig, model: str) -> str | None:
    """A quantized checkpoint's scheme, None for a float one; JobConfigError (exit 2) for a scheme the
    engine does not run, or --quantization asked of a checkpoint quantized already."""
    try:
        shipped = engine.checkpoint_quantization(model)     # reads config.json (loads torch: the engine will)
    except (ModelError, ConfigError) as e:
        raise JobConfigError(str(e)) from None
    q = cfg.engine.quantization
    if shipped is not None and q not in ("none", "auto", "w4a8"):    # w4a8: int4 weights' own (the engine checks)
        raise JobConfigError(f"--quantization {q}: the checkpoint is quantized already ({shipped}) and runs as "
                             f"shipped; drop --quantization (w4a8 runs an int4 one's weights with int8 "
                             f"activations), or give a float checkpoint")
    if shipped is not None and cfg.lora.lora:
        raise JobConfigError(f"LoRA adapters apply to float checkpoints; this one is quantized ({shipped})")
    return shipped


def repair_fingerprint(cfg: JobConfig) -> dict:
    """cfg's resume fingerprint as `jobrunner repair` rebuilds a manifest with it: its adapters' hashes and
    the checkpoint's scheme resolved, no dataset read (manifest_entries.repair_manifest)."""
    hashes = {name: digest for name, _, digest in adapters(cfg.lora)}
    return cfg.fingerprint_fields(hashes, shipped_scheme(cfg, model_path(cfg.engine.model)))


def cache_url(cfg: JobConfig) -> str | None:
    """The result cache's URL: --cache, else $JOBRUNNER_CACHE_URL, else None (no cache)."""
    return cfg.reuse.cache or os.environ.get(ENV_URL) or None


def model_path(name: str) -> str:
    """A model name as the engine loads it (jobrunner.models: a known name is pulled into the cache on
    first use, a Hub name through huggingface_hub); JobConfigError when it can't be."""
    try:
        return resolve_model(name)
    except ModelError as e:
        raise JobConfigError(str(e)) from None


def draft_path(cfg: JobConfig) -> str | None:
    """--draft-model found as --model is (pulled on first use), or None."""
    return model_path(cfg.engine.draft_model) if cfg.engine.draft_model else None


def adapters(lora: LoraOptions) -> tuple[tuple[str, str, str], ...]:
    """(name, local directory, content hash) of each --lora adapter (the job's `lora` section): its path resolved as a base model's
    is (jobrunner.models.resolve_adapter), its config checked by the engine (engine.check_adapter) before
    any weight is read. JobConfigError (exit 2) when one cannot be found or is refused."""
    out = []
    for name, given in lora.adapters:
        try:
            path = resolve_adapter(given)
            out.append((name, path, check_adapter(name, path).content_hash))
        except (ModelError, ConfigError) as e:
            raise JobConfigError(str(e)) from None
    return tuple(out)


def precision(cfg: JobConfig, shipped: str | None = None, model: str | None = None, *, measure: bool = True,
              resumes: str | None = None) -> tuple[str, str, dict | None]:
    """(dtype, quantization, calibration record or None) for the engine. `--quantization auto` on CPU with
    the dtype left to auto: the fastest mode within 1% of float32's perplexity, measured once per model
    and machine (jobrunner.job.calibration; `measure` False, for a dry resolve: the cached figures, else
    the flag rule); an output it `resumes` (its URL) that recorded a choice keeps that one, so no output
    mixes modes. A GPU keeps the model's 16-bit dtype and a chosen --dtype is kept (precision.auto_precision);
    w8a8 does not split over tensor-parallel ranks, so auto takes a float mode there; a quantized
    checkpoint (`shipped`) runs as shipped, or on CPU, where it is int4 weight-only (GPTQ, AWQ, W4A16), as
    measured among calibration.SHIPPED_MODES (w4a8: its weights times int8 activations). model: the resolved
    path (default: cfg's, as given)."""
    e = cfg.engine
    if e.quantization != "auto":
        return e.dtype, e.quantization, None
    tp = cfg.parallel.tensor_parallel > 1
    if shipped is not None and (tp or not measures(e.device, e.dtype) or not engine.ships_int4(model or e.model)):
        log.info("--quantization auto: the checkpoint's own (%s)", shipped)
        return e.dtype, "none", None
    if not measures(e.device, e.dtype):
        dtype, quantization, why = auto_precision(e.device, e.dtype)
        if quantization == "w8a8" and tp:
            quantization, why = "none", f"{why}, but w8a8 does not split over --tensor-parallel ranks"
        log.info("--quantization auto: dtype %s, quantization %s (%s)", dtype, quantization, why)
        return dtype, quantization, None
    kept = output_record(resumes) if resumes is not None else None
    if shipped is not None and kept is None and resumes is not None and output_begun(resumes):
        # begun before auto measured shipped checkpoints (no record): it ran as shipped, and goes on so
        log.info("--quantization auto: the checkpoint's own (%s), as the output it resumes ran it", shipped)
        return e.dtype, "none", None
    if kept is not None and not (tp and kept["quantization"] == "w8a8"):
        record = {**kept, "resumed": True}      # the figures it rested on, where they were measured
    else:
        record = cpu_auto(model or e.model, e.threads, measure=measure, float_only=tp,
                          packed_weights=e.packed_weights, shipped=shipped is not None)
    log.info("--quantization auto: %s", summary(record))
    return record["dtype"], record["quantization"], record


def float_dtype(device: str, dtype: str) -> str:
    """The float dtype's name: dtype auto is bfloat16 on a GPU and float32 on CPU (as the engine picks)."""
    if dtype != "auto":
        return dtype            # checked where it is used (the engine, model_split)
    return "bfloat16" if on_gpu(device) else "float32"


def resolve_engine(cfg: JobConfig) -> Resolved:
    """For a command that loads the job's model without a dataset (`jobrunner warmup`): the model's path
    and the precision only (fmt and columns empty, no output)."""
    model = model_path(cfg.engine.model)
    shipped = shipped_scheme(cfg, model)
    dtype, quantization, calibration = precision(cfg, shipped, model)
    return Resolved(fmt="", columns=(), model=model, dtype=dtype,
                    float_dtype=float_dtype(cfg.engine.device, dtype), quantization=quantization, cache_url=None,
                    lora=adapters(cfg.lora), shipped=shipped, calibration=calibration, draft_model=draft_path(cfg))


def open_cache(url: str | None):
    """The result cache's store (None without one); a URL that cannot be opened exits 2."""
    try:
        return open_store(url)
    except ValueError as e:
        raise JobConfigError(str(e)) from None
