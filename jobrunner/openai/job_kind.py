"""The job kind a job runs: the --kind's (jobs.make_job), and for an OpenAI batch file the routed job
(jobrunner.openai.routed) whose lines' urls pick their kind and whose lines' body.model must name the job's model.

    job = job_for(fmt, cfg, spec, tokenizer, pooling, source, builder)

The names of the job's model (model_names): --model as given (a path, a Hub name with and without its
@revision, a known model's short name), the checkpoint the engine loaded, a known model's Hub name,
and every --served-model-name. --any-model: any name (None).
"""
from __future__ import annotations

import os

from jobrunner.models import hub
from jobrunner.config.job import JobConfig
from jobrunner.models.known import KNOWN_MODELS
from jobrunner.openai.batch import FORMAT
from jobrunner.openai.routed import RoutedJob
from jobrunner.jobs import make_job
from jobrunner.jobs.lora import LoraJob


def model_names(cfg: JobConfig, source: str | None = None) -> frozenset[str] | None:
    """What a line's body.model may say; None: anything (--any-model)."""
    if cfg.input.any_model:
        return None
    names = {cfg.engine.model, *cfg.input.served_model_name, *cfg.lora.names}     # a LoRA adapter's name picks it
    if cfg.engine.model in KNOWN_MODELS:
        names.add(KNOWN_MODELS[cfg.engine.model].hub_name)
    if hub.is_hub_name(cfg.engine.model):
        names.add(hub.parse(cfg.engine.model)[0])
    for path in (cfg.engine.model, source):
        if path and os.path.exists(path):
            names.update({path.rstrip("/"), os.path.abspath(path)})
    return frozenset(n for n in names if n)


def job_for(fmt: str, cfg: JobConfig, spec, tokenizer, pooling=None, source: str | None = None, builder=None):
    """The job kind (ValueError as make_job's: embed on a checkpoint pooling we don't reproduce). builder: the
    job's PromptBuilder, which renders a score line's pairs for a reranker (jobs.pairs)."""
    if fmt != FORMAT:
        job = make_job(spec, tokenizer, pooling)
        return LoraJob(job, cfg.lora.names, cfg.lora.column) if cfg.lora.adapters else job
    main = make_job(spec, tokenizer, pooling)
    routed = RoutedJob(main, spec, tokenizer, pooling, model_names(cfg, source), builder)
    return LoraJob(routed, cfg.lora.names, by_model=True) if cfg.lora.adapters else routed
