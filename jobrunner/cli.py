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

from jobrunner.config import FORMATS, KINDS, JobConfig, JobConfigError, config_fields, parse_size

D = JobConfig("")      # the defaults


def _job_options(f):
    opts = [
        click.option("-o", "--output", help="Output directory URL (default: <dataset>.results beside the dataset)."),
        click.option("-m", "--model", default=D.model, show_default=True,
                     help="Known model name, local HF directory, .gguf file, fsspec URL, or dummy:<config>."),
        click.option("--format", "format", type=click.Choice(FORMATS), default=D.format, show_default=True),
        click.option("--id-column", default=D.id_column, show_default=True, help="Row id column; else the row number."),
        click.option("--prompt-column", default=D.prompt_column, show_default=True),
        click.option("--messages-column", help="Column holding a chat messages list [{role, content}, ...]."),
        click.option("--template", help='Prompt template filled from columns, e.g. "Review: {text}\\nSentiment:".'),
        click.option("--system", help="System prompt added to every row."),
        click.option("--chat/--no-chat", default=None, help="Render through the model's chat template "
                                                             "(default: when the model has one)."),
        click.option("--max-tokens", type=int, default=D.max_tokens, show_default=True),
        click.option("--temperature", type=float, default=D.temperature, show_default=True),
        click.option("--top-p", type=float, default=D.top_p, show_default=True),
        click.option("--top-k", type=int, default=D.top_k, show_default=True),
        click.option("--min-p", type=float, default=D.min_p, show_default=True),
        click.option("--seed", type=int, help="Sampling seed (per row, so outputs don't depend on batching)."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--ignore-eos", is_flag=True, default=False, help="Generate max-tokens even past end-of-sequence."),
        click.option("--n", type=int, default=D.n, show_default=True, help="Samples per prompt (rows get sample_index)."),
        click.option("--kind", type=click.Choice(KINDS), default=D.kind, show_default=True,
                     help="generate text, classify by label scoring, or score a completion's log-likelihood."),
        click.option("--labels", help="classify: comma-separated labels, e.g. positive,negative,neutral."),
        click.option("--labels-column", help="classify: column with each row's list of labels."),
        click.option("--normalize", type=click.Choice(["sum", "mean"]), default=D.normalize, show_default=True,
                     help="classify: sum or per-token mean of a label's logprobs."),
        click.option("--reference-column", help="Evaluate against this column: per-row `correct`, summary accuracy."),
        click.option("--match", type=click.Choice(["exact", "normalized", "contains"]), default=D.match,
                     show_default=True),
        click.option("--score-column", help="score: the column whose log-likelihood after the prompt is measured."),
        click.option("--device", default=D.device, show_default=True, help="auto, cpu, cuda or cuda:N."),
        click.option("--dtype", default=D.dtype, show_default=True, help="auto, float32, float16, bfloat16."),
        click.option("--quantization", type=click.Choice(["none", "int8", "int4", "w8a8", "fp8"]),
                     default=D.quantization, show_default=True),
        click.option("--kv-cache-dtype", type=click.Choice(["auto", "int8", "fp8"]), default=D.kv_cache_dtype,
                     show_default=True),
        click.option("--kv-cache-memory", help="KV cache size, e.g. 64MB or 8GiB (default: 2GiB on CPU, "
                                               "a share of free GPU memory)."),
        click.option("--block-size", type=int, default=D.block_size, show_default=True),
        click.option("--max-num-seqs", type=int, help="Sequences in flight at once (default: 256 on CPU, 1024 on a GPU)."),
        click.option("--max-batched-tokens", type=int,
                     help="Tokens a step computes at most (default: 2048 on CPU, 8192 on a GPU)."),
        click.option("--plan/--no-plan", default=D.plan, show_default=True,
                     help="Order rows so shared prefixes run back to back."),
        click.option("--prefix-cache/--no-prefix-cache", default=D.prefix_cache, show_default=True),
        click.option("--cuda-graphs/--no-cuda-graphs", default=D.cuda_graphs, show_default=True,
                     help="On a GPU, replay captured CUDA graphs for decode steps."),
        click.option("--async-scheduling/--no-async-scheduling", default=D.async_scheduling, show_default=True,
                     help="Schedule and prepare each step while the one before runs on the device."),
        click.option("--data-parallel", type=int, help="Worker processes (default: visible GPUs; 1 on CPU)."),
        click.option("--part-rows", type=int, default=D.part_rows, show_default=True, help="Rows per output part."),
        click.option("--overwrite", is_flag=True, default=False,
                     help="Replace an existing jobrunner output (never a directory that is not one)."),
        click.option("--max-error-rate", type=float, help="Fail (exit 3) when more than this fraction of rows failed."),
        click.option("--device-hourly-cost", type=float, help="USD per device-hour, for cost figures."),
        click.option("--output-format", type=click.Choice(["parquet", "openai-batch"]), default=D.output_format,
                     show_default=True),
        click.option("--limit", type=int, help="Only the first N rows."),
        click.option("--config", "config_file", type=click.Path(dir_okay=False),
                     help="TOML job file; any option by name (e.g. max_tokens = 64); the command line wins."),
        click.option("-v", "--verbose", is_flag=True, help="Debug logging."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def build_config(ctx: click.Context, dataset: str, params: dict) -> JobConfig:
    known = config_fields()
    values: dict = {}
    if params.get("config_file"):
        try:
            with open(params["config_file"], "rb") as fh:
                values = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise JobConfigError(f"cannot read --config {params['config_file']}: {e}") from None
        values = {k.replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise JobConfigError(f"--config: unknown keys {', '.join(unknown)}")
    for name, value in params.items():
        if name in ("config_file", "verbose"):
            continue
        given = ctx.get_parameter_source(name) not in (click.core.ParameterSource.DEFAULT, None)
        if given or name not in values:
            values[name] = value
    values.setdefault("dataset", dataset)
    if dataset:
        values["dataset"] = dataset
    if isinstance(values.get("labels"), str):
        values["labels"] = tuple(x.strip() for x in values["labels"].split(",") if x.strip())
    for key in ("labels", "stop"):
        values[key] = tuple(values.get(key) or ())
    if values.get("kv_cache_memory") is not None:
        values["kv_cache_memory"] = parse_size(values["kv_cache_memory"])
    values = {k: v for k, v in values.items() if k in known}
    return JobConfig(**values)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")


def _fail_config(e: Exception) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main():
    """Batch LLM inference over Parquet, JSONL and CSV datasets.

    \b
    Examples:
      jobrunner submit examples/reviews.jsonl --max-tokens 32
      jobrunner submit s3://bucket/prompts.parquet -o s3://bucket/out/ --kind classify --labels yes,no
      jobrunner stats examples/reviews.results
    """


@main.command()
@click.argument("dataset")
@_job_options
@click.pass_context
def submit(ctx, dataset, **params):
    """Run a job to completion in the foreground.

    \b
    Exit codes: 0 done; 2 bad configuration or unreadable input (nothing run);
    3 finished with more failed rows than --max-error-rate; 4 output storage failed;
    130 interrupted (run the same command again to resume).

    \b
    Examples:
      jobrunner submit prompts.jsonl --max-tokens 64
      jobrunner submit reviews.parquet --template "Review: {text}" --kind classify --labels positive,negative
      jobrunner submit evals.csv --kind classify --labels-column choices --reference-column answer
      jobrunner submit batch.jsonl --format openai-batch --output-format openai-batch
    """
    _setup_logging(params["verbose"])
    from jobrunner.job import EXIT_STORAGE, Job
    from jobrunner.parallel import run_parallel, wants_parallel
    job = None
    try:
        cfg = build_config(ctx, dataset, params)
        if not wants_parallel(cfg):     # else one worker per device, or a rank under torchrun: jobrunner.parallel
            job = Job(cfg)
            job.prepare()
    except JobConfigError as e:
        _fail_config(e)
    try:
        result = job.run() if job is not None else run_parallel(cfg)
    except JobConfigError as e:
        _fail_config(e)
    except OSError as e:
        click.echo(f"error: writing the output failed: {e}. Nothing written is lost; "
                   f"fix the storage and run the same command again to resume.", err=True)
        sys.exit(EXIT_STORAGE)
    _print_summary(result.stats, result.output)
    sys.exit(result.exit_code)


@main.command()
@click.argument("dataset")
@_job_options
@click.pass_context
def validate(ctx, dataset, **params):
    """Check a dataset and options, count prompt tokens and estimate time, without generating."""
    _setup_logging(params["verbose"])
    from jobrunner.validate import validate_job
    try:
        cfg = build_config(ctx, dataset, params)
        report = validate_job(cfg)
    except JobConfigError as e:
        _fail_config(e)
    for k, v in report.items():
        click.echo(f"{k:28s} {v}")


@main.command()
@click.argument("output")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def stats(output, as_json):
    """Print a finished or partial job's summary."""
    from jobrunner.writer import read_stats
    try:
        s = read_stats(output)
    except Exception as e:
        _fail_config(f"no job summary in {output}: {e}")
    if as_json:
        click.echo(json.dumps(s, indent=2))
    else:
        _print_summary(s, output)


def _print_summary(s: dict, output: str) -> None:
    def show(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return json.dumps(v) if isinstance(v, (dict, list)) else v

    lines = [f"output  {output}"]
    for k, v in s.items():
        if not isinstance(v, dict):
            lines.append(f"{k:32s} {show(v)}")
    for k in ("metrics", "engine"):
        if isinstance(s.get(k), dict):
            lines.append(f"{k}:")
            lines.extend(f"  {kk:30s} {show(vv)}" for kk, vv in s[k].items())
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
