"""The command line: `jobrunner submit | validate | repair | warmup | stats | report | compare | models | cache`.

Option defaults come from JobConfig's sections (jobrunner/config/sections.py); `--config job.toml` supplies any option, and the
command line wins over the file.
"""
from __future__ import annotations

import json
import logging
import signal
import sys

import click

from jobrunner.engine import ModelError
from jobrunner.cache.cli import cache as cache_commands
from jobrunner.config.cli_options import SECTIONS, GroupedCommand, job_options, some_job_options
from jobrunner.config.job import NOT_FINGERPRINTED, JobConfig, JobConfigError, config_fields
from jobrunner.config.ray import fold_cli
from jobrunner.pipeline.exit_codes import EXIT_STORAGE
from jobrunner.pipeline.progress import log_datefmt
from jobrunner.models.known import known_models, pull as pull_model
from jobrunner.cli.summary_text import dataset_rows, print_all, print_summary
from jobrunner.cli.export import export as export_command
from jobrunner.common.signal_interrupt import SignalInterrupt

# Each command imports the modules that run it inside its function (the API, the dataset readers, the
# output): they load pyarrow and fsspec, which `jobrunner --help` and a command's option parsing never need.


def build_config(ctx: click.Context, dataset: str, params: dict) -> JobConfig:
    """Command line over TOML file over JobConfig's defaults (which the options' defaults show):
    the options given on the command line, through the API's build_config."""
    from jobrunner.api.submit import build_config as build
    known = config_fields()
    given = {name: value for name, value in params.items()
             if ctx.get_parameter_source(name) not in (click.core.ParameterSource.DEFAULT, None)}
    given = fold_cli(given)         # --ray and --ray-*: the one `ray` option (JobConfigError: exit 2)
    return build(dataset, {k: v for k, v in given.items() if k in known}, params.get("config_file"))


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt=log_datefmt())


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


def _sigterm_interrupts() -> None:
    """SIGTERM before the job sets its own handlers (while the model loads, say) ends the command as
    Ctrl-C does: exit 130 with its line, not a silent 143. The job's handlers replace this one while it
    runs (Job.run, the launchers) and put it back after."""
    def on_term(signum, frame):
        raise SignalInterrupt
    signal.signal(signal.SIGTERM, on_term)


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
@job_options
@click.pass_context
def submit(ctx, dataset, **params):
    """Run a job to completion in the foreground.

    \b
    Exit codes: 0 done; 1 workers or a tensor-parallel rank lost (the rows written are kept: run
    the same command again to resume); 2 bad configuration or unreadable input (nothing run);
    3 more failed rows than --max-error-rate, or every row failed (unless --allow-all-failed),
    over every row of the output (a rerun too); 4 output storage failed;
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
    _sigterm_interrupts()
    from jobrunner.api.submit import OutputStorageError, run
    try:
        result = run(build_config(ctx, dataset, params))
    except JobConfigError as e:
        _fail_config(e)
    except OutputStorageError as e:
        _fail(EXIT_STORAGE, str(e))
    except KeyboardInterrupt:
        click.echo(err=True)    # past the ^C on the terminal
        _interrupted()
    print_summary(result.stats, result.output)
    if result.error:        # after the summary, so that it is the last line a person (or a cron mail) reads
        click.echo(f"error: {result.error}", err=True)
    sys.exit(result.exit_code)


@main.command(cls=GroupedCommand)
@click.argument("dataset")
@job_options
@click.pass_context
def validate(ctx, dataset, **params):
    """Check a dataset and options, count prompt tokens and estimate time, without generating.

    \b
    Exit codes: 0 the job can run (the report follows); 2 bad configuration, or a dataset
    or model that cannot be read; 130 interrupted.
    """
    _setup_logging(params["verbose"])
    from jobrunner.dataset import DatasetError
    from jobrunner.cli.validate import validate_job
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


# repair: the options that make the job's fingerprint, and -o; the submit command's others (how it runs) are
# accepted, so that the submit command with `repair` for `submit` works, and left out of --help
REPAIR_HIDDEN = NOT_FINGERPRINTED - {"output"}
# warmup: the options that choose the model and how the engine loads it
WARMUP_OPTIONS = (frozenset(SECTIONS["Model and engine"]) - {"plan"}) | {"lora", "max_loras", "tensor_parallel",
                                                                         "config_file"}


@main.command(cls=GroupedCommand)
@click.argument("dataset")
@some_job_options(hidden=REPAIR_HIDDEN)
@click.pass_context
def repair(ctx, dataset, **params):
    """Rebuild an output's damaged or missing _manifest.json from its part files and this job's options:
    the submit command's dataset and options, with `repair` for `submit` (the options listed here make the
    job's fingerprint; the others submit takes are accepted and ignored). Then submit again to resume.
    Reads no part and loads no model; refuses an output with an intact manifest or files not ours.

    \b
    Exit codes: 0 rebuilt; 2 bad configuration, or an output it refuses (not found, intact,
    holding files not ours); 4 the manifest could not be written.

    \b
    Example:
      jobrunner repair reviews.parquet -o out/ --kind classify --labels yes,no
    """
    _setup_logging(params["verbose"])
    from jobrunner.pipeline.manifest_entries import repair_manifest
    from jobrunner.pipeline.resolve import repair_fingerprint
    from jobrunner.output import OutputError
    try:
        cfg = build_config(ctx, dataset, params)
        manifest = repair_manifest(cfg.output_url, repair_fingerprint(cfg))
    except (JobConfigError, OutputError) as e:
        _fail_config(e)
    except OSError as e:
        _fail(4, f"cannot write the manifest of {params.get('output') or dataset}: {e}")
    click.echo(f"rebuilt {cfg.output_url}/_manifest.json over {len(manifest['parts'])} part files; "
               "submit the same job again to resume it")


@main.command(cls=GroupedCommand)
@some_job_options(only=WARMUP_OPTIONS)
@click.pass_context
def warmup(ctx, **params):
    """Prepare the model once, before the first job: fetch and convert it and, on CPU, compile the
    in-place decode attention kernel (about a second; a first job would do both itself). Takes the job
    options that choose the model and load the engine (-m, --quantization, --dtype, --lora, ...).
    Idempotent: a second call takes seconds.

    \b
    Exit codes: 0 ready; 2 bad configuration, or a model that cannot be found or loaded;
    130 interrupted.

    \b
    Examples:
      jobrunner warmup
      jobrunner warmup -m /models/Qwen3-0.6B
    """
    _setup_logging(params["verbose"])
    from jobrunner.cli.warmup import warmup as run_warmup
    try:
        figures = run_warmup(build_config(ctx, "", params))
    except JobConfigError as e:
        _fail_config(e)
    except KeyboardInterrupt:
        click.echo(err=True)
        _interrupted()
    for k, v in figures.items():
        click.echo(f"{k:16s} {v}")


@main.command()
@click.argument("output")
@click.option("--all", "show_all", is_flag=True, help="Print every figure (latency percentiles, prefix optimum, "
                                                     "engine counters, each run), not the ten-line summary.")
@click.option("--json", "as_json", is_flag=True, help="Print every figure as JSON (the whole _stats.json).")
def stats(output, show_all, as_json):
    """Print a job's summary; for a job killed before any run ended, a partial one from its parts.

    \b
    Exit codes: 0 printed; 2 not a jobrunner output, or its summary cannot be read.
    """
    from jobrunner.output.summary import job_summary
    from jobrunner.output import OutputError, read_manifest, read_stats
    try:
        s = read_stats(output)
        if s is None:       # no run wrote stats (killed): the rows' figures from the parts written so far
            manifest = read_manifest(output) or {}
            s = {"partial": True, **job_summary(output, manifest.get("config") or {}), **dataset_rows(manifest)}
    except OutputError as e:
        _fail_config(e)
    except (OSError, ValueError) as e:
        _fail_config(f"cannot read the job summary in {output}: {e}")
    if s.get("partial"):
        click.echo("partial summary: the job did not finish; figures over the rows written so far", err=True)
    if as_json:
        click.echo(json.dumps(s, indent=2))
    elif show_all:
        print_all(s, output)
    else:
        print_summary(s, output)


@main.command()
@click.argument("output")
@click.option("-o", "--out", "page", default=None, metavar="FILE",
              help="Where to write the page (any fsspec URL); default OUTPUT/report.html.")
def report(output, page):
    """Write one self-contained HTML page of a job's output: summary, the kind's metrics, latency,
    tokens, throughput, failed rows and configuration (plots inline; needs jobrunner[report]).

    \b
    Exit codes: 0 written (its path is printed); 2 not a jobrunner output, or matplotlib missing;
    4 the output could not be read or the page not written.

    \b
    Example:
      jobrunner report out/ -o /tmp/nightly.html
    """
    from jobrunner.report import MissingPlotLibrary, OutputError, write_report
    try:
        click.echo(write_report(output, page))
    except (MissingPlotLibrary, OutputError) as e:
        _fail_config(e)
    except OSError as e:
        _fail(EXIT_STORAGE, f"cannot read {output} or write the page: {e}")


@main.command()
@click.argument("base")
@click.argument("candidate")
@click.option("--json", "as_json", is_flag=True, help="Print every figure as JSON.")
@click.option("-o", "--out", "page", default=None, metavar="FILE.html",
              help="Also write the comparison as an HTML page.")
@click.option("--max-changed-rate", type=float, default=None, metavar="R",
              help="Exit 3 when more than this fraction of the common rows changed.")
@click.option("--max-missing-rate", type=float, default=None, metavar="R",
              help="Exit 3 when more than this fraction of the base's rows are absent from the candidate (an error "
                   "row is present).")
@click.option("--max-accuracy-drop", type=float, default=None, metavar="D",
              help="Exit 3 when accuracy over the common rows drops by more than D (a fraction: 0.01 = 1 point).")
@click.option("--max-cost-increase", type=float, default=None, metavar="P",
              help="Exit 3 when the cost per row rises by more than P (a fraction: 0.1 = 10%; device-hours per row "
                   "where a run is not priced).")
@click.option("--min-cosine", type=float, default=0.99, show_default=True,
              help="embed: a row changed when its embeddings' cosine is under this.")
@click.option("--score-rtol", type=float, default=0.01, show_default=True,
              help="score: a row changed when its perplexity moved by more than this, relatively.")
@click.option("--seed", type=int, default=0, show_default=True, help="The bootstrap's seed.")
def compare(base, candidate, as_json, page, max_changed_rate, max_missing_rate, max_accuracy_drop, max_cost_increase,
            min_cosine, score_rtol, seed):
    """What changed between two outputs of the same dataset, joined on id (an id's own row; a repeated
    id's duplicate error rows are counted apart): rows only in one, changed results, metric deltas with
    McNemar's test and a bootstrap interval, cost and configuration.

    \b
    Exit codes: 0 compared (every gate asked passed); 3 a gate crossed; 2 not comparable (different
    kinds or datasets, no id in common) or not an output; 4 storage failed.

    \b
    Example:
      jobrunner compare runs/yesterday runs/today --max-changed-rate 0.05 --max-accuracy-drop 0.01
    """
    from jobrunner.report import NotComparableError, OutputError, write_page
    from jobrunner.report import compare as compare_outputs
    from jobrunner.report.compare_page import lines, render
    try:
        r = compare_outputs(base, candidate, max_changed_rate=max_changed_rate, max_accuracy_drop=max_accuracy_drop,
                            max_cost_increase=max_cost_increase, max_missing_rate=max_missing_rate,
                            min_cosine=min_cosine, score_rtol=score_rtol, seed=seed)
        if page:
            write_page(render(r), page)
    except (NotComparableError, OutputError) as e:
        _fail_config(e)
    except OSError as e:
        _fail(EXIT_STORAGE, f"cannot read the outputs or write the page: {e}")
    click.echo(json.dumps(r, indent=2, default=str) if as_json else "\n".join(lines(r)))
    sys.exit(r["exit_code"])


@main.group(invoke_without_command=True)
@click.pass_context
def models(ctx):
    """List known model names and what is cached; `models pull NAME` fetches one (or org/name from the Hub);
    `models export NAME DIR` writes one as a Hugging Face directory.

    \b
    Exit codes: 0 listed.
    """
    if ctx.invoked_subcommand is None:
        for m in known_models():
            state = f"cached at {m['path']}" if m["cached"] else "not cached"
            click.echo(f"{m['name']:28s} {m['description']}  [{state}]")


@models.command()
@click.argument("name")
def pull(name):
    """Fetch a known model into the cache, or a Hugging Face Hub model (org/name[@revision]) into the HF cache.

    \b
    Exit codes: 0 fetched (its path is printed); 2 an unknown name, or a model that cannot be fetched.
    """
    try:
        path = pull_model(name)
    except ModelError as e:
        _fail_config(e)
    click.echo(str(path))


models.add_command(export_command)   # `jobrunner models export NAME DIR` (jobrunner/cli/export.py)
main.add_command(cache_commands)     # `jobrunner cache stats | prune` (jobrunner/cache/cli.py)

if __name__ == "__main__":
    main()
