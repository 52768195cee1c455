"""Pre-flight checks: every way a job's configuration can fail, found before any row runs.
Each raises JobConfigError with a message that says what to fix."""
from __future__ import annotations

import logging

from jobrunner.config import JobConfig, JobConfigError

log = logging.getLogger("jobrunner")


def check_dataset(cfg: JobConfig) -> tuple[str, list[str]]:
    from jobrunner.dataset import DatasetError, dataset_columns, detect_format
    try:
        fmt = detect_format(cfg.dataset, cfg.format)
        columns = dataset_columns(cfg.dataset, fmt)
    except DatasetError as e:
        raise JobConfigError(str(e)) from None
    except (OSError, ValueError) as e:
        raise JobConfigError(f"cannot read dataset {cfg.dataset}: {e}") from None
    if fmt == "openai-batch":
        return fmt, columns
    wanted = {"--messages-column": cfg.messages_column, "--labels-column": cfg.labels_column,
              "--reference-column": cfg.reference_column, "--score-column": cfg.score_column}
    if not cfg.template and not cfg.messages_column:
        wanted["--prompt-column"] = cfg.prompt_column
    for option, column in wanted.items():
        if column and columns and column not in columns:
            raise JobConfigError(f"{option} {column!r} is not a column of {cfg.dataset}; "
                                 f"its columns are: {', '.join(columns)}")
    return fmt, columns


def check_template(cfg: JobConfig, columns: list[str]):
    if not cfg.template:
        return None
    from jobrunner.template import PromptTemplate
    try:
        template = PromptTemplate(cfg.template)
    except ValueError as e:
        raise JobConfigError(f"--template: {e}") from None
    missing = template.missing_columns(columns) if columns else []
    if missing:
        raise JobConfigError(f"--template uses {', '.join(missing)}, not columns of {cfg.dataset}; "
                             f"its columns are: {', '.join(columns)}")
    return template


def load_engine(cfg: JobConfig):
    from engine.config import ConfigError
    from engine.engine import Engine
    from engine.errors import ModelError
    try:
        engine = Engine(cfg.engine_config())
    except (ModelError, ConfigError) as e:
        raise JobConfigError(str(e)) from None
    rt = engine.rt
    log.info("model %s on %s (%s), %d KV blocks of %d tokens, loaded in %.1fs", rt.source, rt.device,
             str(rt.dtype).removeprefix("torch."), rt.num_blocks, cfg.block_size, rt.load_s)
    if cfg.chat and not getattr(engine.tokenizer, "has_chat_template", False):
        raise JobConfigError(f"--chat was asked for but model {cfg.model} has no chat template; use --no-chat")
    return engine


def open_writer(cfg: JobConfig, manifest: dict, writer_cls, part_prefix: str = "part"):
    from jobrunner.writer import OutputError
    try:
        return writer_cls(cfg.output_url, manifest, part_rows=cfg.part_rows, overwrite=cfg.overwrite,
                          part_prefix=part_prefix)
    except OutputError as e:
        raise JobConfigError(str(e)) from None
