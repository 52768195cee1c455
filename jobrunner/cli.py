"""The command line: `jobrunner submit | validate | stats | models`.

Option defaults come from JobConfig; `--config job.toml` supplies any option, and the
command line wins over the file.
"""
from __future__ import annotations

import json
import logging
import sys
import tomllib

import click

from jobrunner.config import FORMATS, KINDS, JobConfig, JobConfigError, config_fields, field_value

D = JobConfig("")      # the defaults


def _job_options(f):
    opts = [
        # input
        click.option("--format", "format", type=click.Choice(FORMATS), default=D.format, show_default=True,
                     help="Input format; auto: from the file extension (a JSONL of OpenAI batch requests is "
                          "openai-batch)."),
        click.option("--id-column", default=D.id_column, show_default=True, help="Row id column; else the row number."),
        click.option("--prompt-column", default=D.prompt_column, show_default=True,
                     help="Column holding each row's prompt text."),
        click.option("--messages-column", help="Column holding a chat messages list [{role, content}, ...] "
                                               "(always rendered through the chat template)."),
        click.option("--limit", type=int, help="Only the first N rows."),
        click.option("--config", "config_file", type=click.Path(dir_okay=False),
                     help="TOML job file; any option by name (e.g. max_tokens = 64); the command line wins."),
        # prompt
        click.option("--template", help="Prompt template filled from columns: {column}; {{ and }} are braces; "
                                        "\\n, \\t and \\\\ are a newline, a tab and a backslash, here as in TOML. "
                                        'E.g. "Review: {text}\\nSentiment:".'),
        click.option("--system", help="System prompt for every row (same escapes as --template); without the chat "
                                      "template it goes before the prompt and a blank line."),
        click.option("--chat/--no-chat", default=None,
                     help="Render plain prompts through the model's chat template. Default by kind: generate "
                          "does when the model has one; classify and score use raw text (as lm-eval and vLLM's "
                          "prompt logprobs do). Messages always use it."),
        click.option("--show-prompt", is_flag=True, default=False,
                     help="submit: log the first row's rendered prompt (the text the tokenizer gets)."),
        # generation
        click.option("--max-tokens", type=int, default=D.max_tokens, show_default=True,
                     help="Tokens to generate at most per sample."),
        click.option("--temperature", type=float, default=D.temperature, show_default=True,
                     help="Sampling temperature; 0 is greedy."),
        click.option("--top-p", type=float, default=D.top_p, show_default=True,
                     help="Nucleus sampling: keep the smallest set of tokens with this much probability."),
        click.option("--top-k", type=int, default=D.top_k, show_default=True,
                     help="Keep the k most likely tokens; 0 keeps all."),
        click.option("--min-p", type=float, default=D.min_p, show_default=True,
                     help="Drop tokens less likely than this fraction of the most likely one."),
        click.option("--seed", type=int, help="Sampling seed (per row, so outputs don't depend on batching)."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--ignore-eos", is_flag=True, default=False, help="Generate max-tokens even past end-of-sequence."),
        click.option("--n", type=int, default=D.n, show_default=True, help="Samples per prompt (rows get sample_index)."),
        # job kinds
        click.option("--kind", type=click.Choice(KINDS), default=D.kind, show_default=True,
                     help="generate text, classify by label scoring, or score a completion's log-likelihood."),
        click.option("--labels", help="classify: comma-separated labels, e.g. positive,negative,neutral."),
        click.option("--labels-column", help="classify: column with each row's list of labels."),
        click.option("--normalize", type=click.Choice(["sum", "mean"]), default=D.normalize, show_default=True,
                     help="classify: sum or per-token mean of a label's logprobs."),
        click.option("--reference-column", help="Evaluate against this column: per-row `correct`, summary accuracy."),
        click.option("--match", type=click.Choice(["exact", "normalized", "contains"]), default=D.match,
                     show_default=True, help="How an output is compared with --reference-column."),
        click.option("--score-column", help="score: the column whose log-likelihood after the prompt is measured."),
        # output
        click.option("-o", "--output", help="Output directory URL (default: the dataset's path + .results, "
                                            "e.g. x.csv -> x.csv.results). Rows come in completion order, "
                                            "not input order: join on id."),
        click.option("--output-format", type=click.Choice(["parquet", "openai-batch"]), default=D.output_format,
                     show_default=True, help="openai-batch also writes an OpenAI Batch API output file."),
        click.option("--part-rows", type=int, default=D.part_rows, show_default=True, help="Rows per output part."),
        click.option("--flush-seconds", type=float, default=D.flush_seconds, show_default=True,
                     help="Write a part at least this often, so a kill loses at most this much finished work."),
        click.option("--overwrite", is_flag=True, default=False,
                     help="Replace an existing jobrunner output (never a directory that is not one)."),
        click.option("--max-error-rate", type=float, help="Fail (exit 3) when more than this fraction of rows failed."),
        click.option("--fail-on-empty", is_flag=True, default=False,
                     help="Exit 2 when the dataset has no rows (else 0, with a warning)."),
        click.option("--device-hourly-cost", type=float, help="USD per device-hour, for cost figures."),
        # model and engine
        click.option("-m", "--model", default=D.model, show_default=True,
                     help="Known model name, local HF directory, .gguf file, fsspec URL, or dummy:<config>."),
        click.option("--device", default=D.device, show_default=True, help="auto, cpu, cuda or cuda:N."),
        click.option("--dtype", default=D.dtype, show_default=True, help="auto, float32, float16, bfloat16."),
        click.option("--quantization", type=click.Choice(["none", "int8", "int4", "w8a8", "fp8"]),
                     default=D.quantization, show_default=True,
                     help="Weight quantization (w8a8: the CPU speed mode; fp8: sm_89+ GPUs)."),
        click.option("--kv-cache-dtype", type=click.Choice(["auto", "int8", "fp8"]), default=D.kv_cache_dtype,
                     show_default=True, help="KV cache storage; int8 and fp8 store it in 8 bits, so more rows fit."),
        click.option("--kv-cache-memory", help="KV cache size, e.g. 64MB or 8GiB (default: 2GiB on CPU, "
                                               "a share of free GPU memory)."),
        click.option("--block-size", type=int, default=D.block_size, show_default=True,
                     help="Tokens per KV cache block."),
        click.option("--max-num-seqs", type=int, help="Sequences in flight at once (default: 256 on CPU, 1024 on a GPU)."),
        click.option("--max-batched-tokens", type=int,
                     help="Tokens a step computes at most (default: 2048 on CPU, 8192 on a GPU)."),
        click.option("--plan/--no-plan", default=D.plan, show_default=True,
                     help="Order rows so shared prefixes run back to back."),
        click.option("--prefix-cache/--no-prefix-cache", default=D.prefix_cache, show_default=True,
                     help="Reuse the KV cache of prompt prefixes already computed."),
        click.option("--cuda-graphs/--no-cuda-graphs", default=D.cuda_graphs, show_default=True,
                     help="On a GPU, replay captured CUDA graphs for decode steps."),
        click.option("--async-scheduling/--no-async-scheduling", default=D.async_scheduling, show_default=True,
                     help="Schedule and prepare each step while the one before runs on the device."),
        # parallel
        click.option("--data-parallel", type=int, help="Worker processes (default: visible GPUs; 1 on CPU)."),
        click.option("-v", "--verbose", is_flag=True, help="Debug logging."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


# Sections of `submit --help` and `validate --help`, in order (parameter names); "Other" takes the rest.
OPTION_GROUPS = {
    "Input": ("format", "id_column", "prompt_column", "messages_column", "limit", "config_file"),
    "Prompt": ("template", "system", "chat", "show_prompt"),
    "Generation": ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos", "n"),
    "Job kind": ("kind", "labels", "labels_column", "normalize", "reference_column", "match", "score_column"),
    "Output": ("output", "output_format", "part_rows", "overwrite", "max_error_rate", "fail_on_empty",
               "device_hourly_cost", "flush_seconds"),
    "Model and engine": ("model", "device", "dtype", "quantization", "kv_cache_dtype", "kv_cache_memory",
                         "block_size", "max_num_seqs", "max_batched_tokens", "plan", "prefix_cache", "cuda_graphs",
                         "async_scheduling"),
    "Parallel": ("data_parallel",),
}


class GroupedCommand(click.Command):
    """A command whose help lists its options in the sections of OPTION_GROUPS."""

    def format_options(self, ctx, formatter):
        records = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx) if isinstance(p, click.Option)}
        left = {name: rec for name, rec in records.items() if rec}     # shrinks as sections take options
        sections = [*OPTION_GROUPS.items(), ("Other", tuple(left))]
        for title, names in sections:
            rows = [left.pop(n) for n in names if n in left]
            if rows:
                with formatter.section(f"{title} options"):
                    formatter.write_dl(rows)


def _read_toml(path: str) -> dict:
    """The job file's values, by field name, checked and converted (config.field_value)."""
    try:
        with open(path, "rb") as fh:
            values = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise JobConfigError(f"cannot read --config {path}: {e}") from None
    values = {k.replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(values) - set(config_fields()))
    if unknown:
        raise JobConfigError(f"--config: unknown keys {', '.join(unknown)}")
    try:
        return {k: field_value(k, v) for k, v in values.items()}
    except JobConfigError as e:
        raise JobConfigError(f"--config {path}: {e}") from None


def build_config(ctx: click.Context, dataset: str, params: dict) -> JobConfig:
    """Command line over TOML file over JobConfig's defaults (which the options' defaults show)."""
    values = _read_toml(params["config_file"]) if params.get("config_file") else {}
    known = config_fields()
    for name, value in params.items():
        source = ctx.get_parameter_source(name)
        if name in known and source not in (click.core.ParameterSource.DEFAULT, None):
            values[name] = field_value(name, value)
    values["dataset"] = dataset or values.get("dataset", "")
    return JobConfig(**values)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")


def _fail_config(e: Exception) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(2)


def _fail(code: int, message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _interrupted() -> None:
    """A second Ctrl-C (Job._on_signal raises KeyboardInterrupt), or one before the job set its
    handlers: exit 130 with one line, not click's "Aborted!" and exit 1 (which means lost workers)."""
    _fail(130, "interrupted; the parts already written are kept: run the same command again to resume")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="jobrunner")
def main():
    """Batch LLM inference over Parquet, JSONL and CSV datasets.

    \b
    Examples:
      jobrunner submit examples/reviews.jsonl --max-tokens 32
      jobrunner submit s3://bucket/prompts.parquet -o s3://bucket/out/ --kind classify --labels yes,no
      jobrunner stats examples/reviews.jsonl.results
    """


@main.command(cls=GroupedCommand)
@click.argument("dataset")
@_job_options
@click.pass_context
def submit(ctx, dataset, **params):
    """Run a job to completion in the foreground.

    \b
    Exit codes: 0 done; 2 bad configuration or unreadable input (nothing run);
    3 finished with more failed rows than --max-error-rate; 4 output storage failed;
    130 interrupted (run the same command again to resume).

    Output rows are written in completion order, not input order: join on `id`.

    \b
    Examples:
      jobrunner submit prompts.jsonl --max-tokens 64
      jobrunner submit reviews.parquet --template "Review: {text}" --kind classify --labels positive,negative
      jobrunner submit evals.csv --kind classify --labels-column choices --reference-column answer
      jobrunner submit batch.jsonl --format openai-batch --output-format openai-batch
    """
    _setup_logging(params["verbose"])
    try:
        result = _submit(ctx, dataset, params)
    except KeyboardInterrupt:
        click.echo(err=True)    # past the ^C on the terminal
        _interrupted()
    _print_summary(result.stats, result.output)
    sys.exit(result.exit_code)


def _submit(ctx, dataset: str, params: dict):
    """Prepare and run the job; a failure a user can cause exits with its code and a message."""
    from jobrunner.dataset import DatasetError
    from jobrunner.job import EXIT_STORAGE, Job
    from jobrunner.parallel import run_parallel, wants_parallel
    from jobrunner.writer import OutputError
    job = None
    try:
        cfg = build_config(ctx, dataset, params)
        if not wants_parallel(cfg):     # else one worker per device, or a rank under torchrun: jobrunner.parallel
            job = Job(cfg)
            job.prepare()
    except (JobConfigError, DatasetError) as e:
        _fail_config(e)
    except OSError as e:                # the output directory can't be created (checks.check_output)
        _fail(EXIT_STORAGE, f"{e}; check the path and its permissions, or choose another --output")
    try:
        return job.run() if job is not None else run_parallel(cfg)
    except (JobConfigError, DatasetError) as e:
        _fail_config(e)
    except (OSError, OutputError) as e:  # the writer's OutputError at run time is a failed write
        _fail(EXIT_STORAGE, f"output storage failed: {e}. Nothing written is lost; "
                            "fix the storage and run the same command again to resume.")


@main.command(cls=GroupedCommand)
@click.argument("dataset")
@_job_options
@click.pass_context
def validate(ctx, dataset, **params):
    """Check a dataset and options, count prompt tokens and estimate time, without generating."""
    _setup_logging(params["verbose"])
    from jobrunner.dataset import DatasetError
    from jobrunner.validate import validate_job
    try:
        cfg = build_config(ctx, dataset, params)
        report = validate_job(cfg)
    except (JobConfigError, DatasetError) as e:
        _fail_config(e)
    except OSError as e:
        _fail(2, f"cannot read the dataset or the model: {e}")
    except KeyboardInterrupt:
        click.echo(err=True)
        _interrupted()
    prompt = report.pop("first_prompt", None)
    for k, v in report.items():
        click.echo(f"{k:28s} {v}")
    if prompt is not None:      # verbatim, so a stray \n or a missing chat template shows
        click.echo(f"first prompt, exactly as the tokenizer gets it, between the ---- lines:\n----\n{prompt}\n----")


@main.command()
@click.argument("output")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def stats(output, as_json):
    """Print a job's summary; for a job killed before any run ended, a partial one from its parts."""
    from jobrunner.summary import job_summary
    from jobrunner.writer import OutputError, read_manifest, read_stats
    try:
        s = read_stats(output)
        if s is None:       # no run wrote stats (killed): the rows' figures from the parts written so far
            s = {"partial": True, **job_summary(output, (read_manifest(output) or {}).get("config") or {})}
    except OutputError as e:
        _fail_config(e)
    except (OSError, ValueError) as e:
        _fail_config(f"cannot read the job summary in {output}: {e}")
    if s.get("partial"):
        click.echo("partial summary: the job did not finish; figures over the rows written so far", err=True)
    if as_json:
        click.echo(json.dumps(s, indent=2))
    else:
        _print_summary(s, output)


_RUN_LINE = ("started_at", "rows", "rows_skipped_done", "wall_s", "decode_tokens_per_s", "device", "interrupted")


def _print_summary(s: dict, output: str) -> None:
    def show(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return json.dumps(v) if isinstance(v, (dict, list)) else v

    lines = [f"output  {output}"]
    for k, v in s.items():
        if not isinstance(v, (dict, list)):
            lines.append(f"{k:32s} {show(v)}")
    for k in ("metrics", "engine"):
        if isinstance(s.get(k), dict):
            lines.append(f"{k}:")
            lines.extend(f"  {kk:30s} {show(vv)}" for kk, vv in s[k].items())
    if s.get("runs"):
        lines.append("runs:")
        lines.extend(f"  {i}  " + "  ".join(f"{k} {show(r[k])}" for k in _RUN_LINE if k in r)
                     for i, r in enumerate(s["runs"], 1))
    click.echo("\n".join(lines))


@main.group(invoke_without_command=True)
@click.pass_context
def models(ctx):
    """List known model names and what is cached; `models pull NAME` fetches one."""
    if ctx.invoked_subcommand is None:
        from engine.hub import known_models
        for m in known_models():
            state = f"cached at {m['path']}" if m["cached"] else "not cached"
            click.echo(f"{m['name']:28s} {m['description']}  [{state}]")


@models.command()
@click.argument("name")
def pull(name):
    """Fetch a known model into the cache."""
    from engine.errors import ModelError
    from engine.hub import pull as pull_model
    try:
        path = pull_model(name)
    except ModelError as e:
        _fail_config(e)
    click.echo(str(path))


if __name__ == "__main__":
    main()
