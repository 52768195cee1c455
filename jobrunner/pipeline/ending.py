"""How a job ends, however it ran (one process, the data-parallel coordinator, the Ray driver): its
result, the output's stats and completion, and the exit code over every row of the output."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jobrunner.pipeline.exit_codes import empty_verdict, rows_verdict
from jobrunner.openai.batch import finish_openai_output
from jobrunner.output import mark_complete, prepare_output, write_stats

if TYPE_CHECKING:
    from jobrunner.config.sections import InputOptions, OutputOptions

log = logging.getLogger("jobrunner")


@dataclass
class JobResult:
    exit_code: int
    stats: dict
    output: str
    error: str | None = None        # why the job could not finish (exit 1) or failed (exit 3), in one line


def write_ending(output: OutputOptions, url: str, summary: dict, manifest: dict, complete: bool, *,
                 interrupted: bool = False, by_workers: bool = False) -> None:
    """Stats always, into the output at `url` (JobConfig.output_url); the manifest marked complete (and
    an OpenAI output finished, per `output`'s format) only when every row was written. `manifest`: the
    writer's; by_workers: workers wrote the parts, and `manifest` is merged into the one they left (a
    listing, not a scan of every part, marks the job complete)."""
    if complete:
        mark_complete(url, summary, prepare_output(url, manifest) if by_workers else manifest)
        if output.output_format == "openai-batch":
            finish_openai_output(url, summary)
    else:
        write_stats(url, summary)
        log.warning("%s%d rows written; run the same command again to resume", "interrupted: " if interrupted else "",
                    summary["rows"])


def verdict(input: InputOptions, output: OutputOptions, url: str, summary: dict, run_rows: int,
            read_any: bool = True, where: str | None = None) -> tuple[int, str | None]:
    """(code, why not ok) of a finished job over every row of the output at `url` (exit_codes.rows_verdict,
    under `output`'s error policy); read_any false (this run read no row, nor skipped one: an empty
    dataset) warns or fails (--fail-on-empty). where: the failed rows' place for the warning, else `url`."""
    code, why = rows_verdict(output, summary, where or url, run_rows)
    if not read_any:
        code = empty_verdict(input, output, code)
    return code, why
