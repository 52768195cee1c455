"""`jobrunner validate`: check everything a job needs and count its tokens, without running the model."""
from __future__ import annotations

from dataclasses import replace

from jobrunner import engine       # engine.load_model_bundle: the loader (torch) loads at its first read
from jobrunner.engine import ImageInput, ModelError
from jobrunner.cli.model_split import fit_report
from jobrunner.config.job import JobConfig, JobConfigError
from jobrunner.dataset import read_rows
from jobrunner.images import NO_PIXELS, ImageError, ImagePrep, column_images
from jobrunner.pipeline import checks
from jobrunner.pipeline.intake import images_refused
from jobrunner.pipeline.precision import cuda_count
from jobrunner.pipeline.resolve import resolve
from jobrunner.models.known import describe
from jobrunner.openai.errors import error_object
from jobrunner.openai.job_kind import job_for
from jobrunner.jobs import PromptBuilder, RowError

# Rough sustained rates for the estimate (float32 matmul on a 2-core CPU; bf16 on a modern GPU).
CPU_FLOPS, GPU_FLOPS = 100e9, 300e12


def flops_per_token(mc) -> float:
    """2 x the parameters each token multiplies through (attention over the context not counted)."""
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    layer = mc.hidden_size * (q + 2 * kv) + q * mc.hidden_size + 3 * mc.hidden_size * mc.intermediate_size
    return 2.0 * (mc.num_layers * layer + mc.vocab_size * mc.hidden_size)


def validate_job(cfg: JobConfig) -> dict:
    resolved = resolve(cfg, dry=True)       # a known model name is pulled here, on first use
    fmt, columns, source = resolved.fmt, list(resolved.columns), resolved.model
    template = checks.check_template(cfg.prompt.template, cfg.input.dataset, columns, fmt)
    try:
        bundle = engine.load_model_bundle(source)
    except ModelError as e:
        raise JobConfigError(str(e)) from None
    checks.check_dimensions(cfg.kind, bundle.config)
    split = fit_report(cfg.engine, cfg.parallel, bundle.config, resolved)      # JobConfigError when --tensor-parallel does not divide the model
    tok = bundle.tokenizer
    # unset sampling options: the checkpoint's; the context: truncation as submit does
    spec = replace(cfg.job_spec(bundle.generation.sampling), context=bundle.config.max_position_embeddings)
    try:
        builder = PromptBuilder(spec, tok, template, images=getattr(bundle, "image_processor", None) is not None)
        job = job_for(fmt, cfg.engine, cfg.input, cfg.lora, spec, tok, bundle.pooling, source, builder)
    except ValueError as e:         # embed: a checkpoint pooling we don't reproduce
        raise JobConfigError(str(e)) from None
    # a vision-language checkpoint's image processor (its preprocessor config: no weights needed)
    processor = getattr(bundle, "image_processor", None)
    images = _RowImages(cfg.input.image_column, cfg.input.messages_column, None if processor is None else
                        ImagePrep(processor, cfg.input.image_limits(), dataset=cfg.input.dataset, workers=1))
    t = _Tally(openai=fmt == "openai-batch")
    for batch in read_rows(cfg.input.dataset, fmt, id_column=cfg.input.id_column, csv_delimiter=cfg.input.csv_delimiter,
                           max_row_bytes=cfg.input.max_row_bytes):
        for row in batch[:None if cfg.input.limit is None else max(0, cfg.input.limit - t.rows)]:
            t.add(row, builder, job, bundle.config.max_position_embeddings, images)
    rows, bad, prompt_tokens, longest, dup, errors = t.rows, t.bad, t.prompt_tokens, t.longest, t.dup, t.errors
    first_prompt = t.first_prompt
    ok = rows - bad
    out_tokens = t.out_tokens if cfg.kind.name == "generate" else 0
    rate = GPU_FLOPS if cuda_count(cfg.engine.device) > 0 else CPU_FLOPS
    seconds = flops_per_token(bundle.config) * (prompt_tokens + out_tokens) / rate
    report = {
        "dataset": cfg.input.dataset, "format": fmt, "columns": ", ".join(columns),
        "model": describe(cfg.engine.model, bundle.source),
        **({"quantization": bundle.quantization.name} if bundle.quantization is not None else {}),
        "kind": cfg.kind.name, "rows": rows, "rows_ok": ok, "rows_with_errors": bad, "duplicate_ids": dup,
        "prompt_tokens": prompt_tokens, "longest_prompt_tokens": longest,
        **({"images": t.images, "image_tokens": t.image_tokens} if t.images else {}),
        "max_output_tokens_total": out_tokens, "output": cfg.output_url,
        "estimated_seconds_upper": round(seconds, 1),
        **split,
    }
    if cfg.kind.name == "generate":
        report["sampling"] = ", ".join(f"{k} {v['value']} ({v['source']})"
                                       for k, v in cfg.sampling_sources(bundle.generation.sampling).items())
    if cfg.output.device_hourly_cost is not None:
        report["estimated_cost_usd_upper"] = round(seconds / 3600 * cfg.output.device_hourly_cost, 4)
    for i, (msg, n) in enumerate(sorted(errors.items(), key=lambda kv: -kv[1])[:5], 1):
        report[f"error {i} (x{n})"] = msg       # two messages with one count: both shown
    report.update(t.failed_lines)       # an OpenAI batch file: every line that would fail, by its number
    if first_prompt is not None:
        report["first_prompt_id"], report["first_prompt"] = first_prompt
    return report


class _Tally:
    """Rows, error rows by message, prompt tokens, duplicates and the first good prompt."""

    def __init__(self, openai: bool = False):
        self.rows = self.bad = self.prompt_tokens = self.longest = self.dup = self.out_tokens = 0
        self.images = self.image_tokens = 0     # in the rows that would run (prompt_tokens holds the image tokens)
        self.errors: dict[str, int] = {}
        self.openai = openai
        self.failed_lines: dict[str, str] = {}      # "line N" -> why (OpenAI batch files)
        self.seen: set[str] = set()
        self.first_prompt: tuple[str, str] | None = None

    def add(self, row, builder, job, context: int, images=None) -> None:
        self.rows += 1
        if row.id in self.seen:         # submit writes it as an error row (jobrunner/pipeline/loop.py): counted so here
            self.dup += 1
            self._failed(row, "duplicate id: an earlier row has the same id")
            return
        self.seen.add(row.id)
        try:
            text, n_tokens, out_tokens, req = _check_row(builder, job, row, context, images)
        except RowError as e:
            self._failed(row, str(e))
            return
        self.out_tokens += out_tokens
        self.images += len(req.images)
        self.image_tokens += sum(im.length for im in req.images)
        if self.first_prompt is None:
            self.first_prompt = (row.id, text)
        self.prompt_tokens += n_tokens
        self.longest = max(self.longest, n_tokens)

    def _failed(self, row, why: str) -> None:
        self.bad += 1
        self.errors[why[:80]] = self.errors.get(why[:80], 0) + 1
        if self.openai:
            self.failed_lines.update([openai_failed_line(row, why)])


class _RowImages:
    """A row's images as submit makes them (jobrunner/pipeline/intake.py): the --image-column's values and the
    messages' image parts, each fetched, decoded and prepared (so a bad image is counted as the row's error
    here too), the prompt's image tokens expanded. prep: None for a model that takes no images."""

    def __init__(self, column: str | None, messages_column: str | None, prep: ImagePrep | None):
        self.column, self.messages_column, self.prep = column, messages_column, prep

    def values(self, row) -> tuple:
        try:
            values = column_images((row.data or {}).get(self.column)) if self.column else ()
        except ImageError as e:
            raise RowError(f"--image-column {self.column!r}: {e}") from None
        if self.prep is None and (why := images_refused(row, values, self.column, self.messages_column)):
            raise RowError(why)
        return values

    def expanded(self, ids: list[int], values: tuple) -> tuple[list[int], tuple]:
        """(the prompt's ids with its image tokens expanded, each image's (offset, tokens)); RowError as
        submit's error row."""
        if not values:
            return ids, ()
        try:
            prepared = self.prep.prepared(values)
        except ImageError as e:
            raise RowError(str(e)) from None
        processor = self.prep.processor
        try:
            ids, offsets = processor.expand(ids, [p.image for p in prepared])
        except ValueError as e:
            raise RowError(f"images: {e}") from None
        return ids, tuple((off, p.num_tokens) for off, p in zip(offsets, prepared))


def _check_row(builder, job, row, context: int, images: _RowImages | None = None) -> tuple[str, int, int, object]:
    """The row's rendered prompt (the text the tokenizer gets), its token count, the most tokens it may
    generate (its own max_tokens, an OpenAI line's body's, x n; 0 for an embedding) and its request (its
    images: offsets and lengths only); RowError where submit would record an error row."""
    if row.error:
        raise RowError(row.error.split(": ", 1)[-1])
    images = images or _RowImages(None, None, None)
    prompt = builder.prompt(row.data, row.options, images.values(row))
    ids = builder.tokenizer.encode(prompt.text, add_special_tokens=prompt.special)
    ids, runs = images.expanded(ids, prompt.images)
    req, notes = job.request(row.id, ids, row.data, row.options)
    too_long = req.context_error(context)      # the engine's own rule, so submit fails the same rows
    if too_long:
        raise RowError(too_long)
    if runs:
        req = replace(req, images=tuple(ImageInput(NO_PIXELS, (0, 0, 0), 0, off, n) for off, n in runs))
    most = req.sampling.max_tokens * req.sampling.n if req.embed is None and req.sampling is not None else 0
    return prompt.text, prompt_tokens(req, notes), most, req


def prompt_tokens(req, notes) -> int:
    """The row's prompt_tokens as submit writes them: the engine's count (an embedding's every input), or a
    score line's pairs' whole prompts (jobs/pairs.py)."""
    return notes.pair_prompt_tokens or len(req.prompt_token_ids) + sum(map(len, req.more_inputs or ()))


def openai_failed_line(row, error: str) -> tuple[str, str]:
    """("line N", why) of an OpenAI batch line that would be an error line (its number as the error file's)."""
    e = error_object(row.error or error, (row.data or {}).get("line"))       # row.error: "line N: why"
    return f"line {e['line'] if e['line'] is not None else '?'}", e["message"]
