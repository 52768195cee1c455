"""The exit codes of a job, and the policy that turns its failed rows into one.

The rows' verdict is over the whole output (the job summary: every row of every run), never this
run's rows alone: a rerun of a job whose output breaks --max-error-rate, or whose every row failed,
has nothing left to compute and must not exit 0 (a scheduler's retry would turn the failure into a
success). A row is an input row: a row of n > 1 samples counts once (jobrunner/output/summary.py).
"""
from __future__ import annotations

import logging

from typing import TYPE_CHECKING

from jobrunner.config.option_values import JobConfigError

if TYPE_CHECKING:
    from jobrunner.config.sections import InputOptions, OutputOptions

log = logging.getLogger("jobrunner")

EXIT_OK, EXIT_CONFIG, EXIT_ERROR_RATE, EXIT_STORAGE, EXIT_INTERRUPTED = 0, 2, 3, 4, 130
EXIT_FAILED = 1     # workers, or a rank of a tensor-parallel engine, lost: the job could not finish; rerun to resume


def rows_verdict(policy: OutputOptions, summary: dict, output: str, run_rows: int,
                 options: str = "cli") -> tuple[int, str | None]:
    """(EXIT_OK or EXIT_ERROR_RATE, why it is not ok) for a finished job from its summary's rows and
    rows_failed, under the job's output options (`policy`: --max-error-rate, --allow-all-failed); run_rows: the rows this run wrote (fewer: earlier runs wrote the others); options:
    "cli" names the options as flags, "api" as arguments. Warns of failed rows either way (cli)."""
    rate, allow = ("--max-error-rate", "--allow-all-failed") if options == "cli" else ("max_error_rate",
                                                                                         "allow_all_failed=True")
    rows, failed = summary.get("rows") or 0, summary.get("rows_failed") or 0
    if not failed:
        return EXIT_OK, None
    if options == "cli":
        log.warning("%d of %d rows failed; their errors are in the `error` column of %s", failed, rows, output)
    earlier = f" (in the whole output: {rows - run_rows} of its rows were written before this run)" \
        if rows > run_rows else ""
    if policy.max_error_rate is not None and failed / rows > policy.max_error_rate:
        return EXIT_ERROR_RATE, f"{failed} of {rows} rows failed, over {rate} {policy.max_error_rate}{earlier}"
    if failed == rows and not policy.allow_all_failed:
        return EXIT_ERROR_RATE, (f"every row failed ({failed} of {rows}){earlier}: see the `error` column; "
                                 f"{allow} exits 0 for such a job")
    return EXIT_OK, None


def empty_verdict(input: InputOptions, output: OutputOptions, code: int) -> int:
    """A job that read no row: a warning (in a cron job an upstream failure looks like success), or
    with --fail-on-empty EXIT_CONFIG (the pre-flight checks find most empty datasets before this)."""
    try:
        on_empty_dataset(input, output)
    except JobConfigError as e:
        log.error("%s", e)
        return EXIT_CONFIG
    return code


def on_empty_dataset(input: InputOptions, output: OutputOptions) -> None:
    """No rows to read: a warning (in a cron job an upstream failure looks like success), or with
    --fail-on-empty a JobConfigError (exit 2)."""
    what = f"dataset {input.dataset} has no rows" + (" (--limit 0)" if input.limit == 0 else "")
    if output.fail_on_empty:
        raise JobConfigError(f"{what}; failing, as --fail-on-empty asks")
    log.warning("%s: nothing to do (--fail-on-empty makes this exit 2)", what)
