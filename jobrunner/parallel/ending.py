"""How a data-parallel job's output ends, whoever ran its workers (the TCPStore coordinator or Ray)."""
from __future__ import annotations

import logging

from jobrunner.config.job import JobConfig

log = logging.getLogger("jobrunner")


def write_ending(cfg: JobConfig, summary: dict, manifest: dict, complete: bool) -> None:
    """Stats always; the manifest marked complete (and an OpenAI output finished) only when every row
    was written. The workers wrote the parts: a listing, not a scan of every part, marks the job complete."""
    from jobrunner.openai.batch import finish_openai_output
    from jobrunner.output import mark_complete, prepare_output, write_stats
    if complete:
        mark_complete(cfg.output_url, summary, prepare_output(cfg.output_url, manifest))
        if cfg.output.output_format == "openai-batch":
            finish_openai_output(cfg.output_url, summary)
    else:
        write_stats(cfg.output_url, summary)
        log.warning("%d rows written; run the same command again to resume", summary["rows"])
