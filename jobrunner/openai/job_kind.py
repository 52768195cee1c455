"""The job kind a job runs: the --kind's (jobs.make_job), and for an OpenAI batch file the routed job
(jobrunner.openai.routed) whose lines' urls pick their kind and whose lines' body.model must name the job's model.

    job = job_for(fmt, cfg.engine, cfg.input, cfg.lora, spec, tokenizer, pooling, source, builder)

The names of the job's model (model_names): --model as given (a path, a Hub name with and without its
@revision, a known model's short name), the checkpoint the engine loaded, a known model's Hub name,
and every --served-model-name. --any-model: any name (None).
"""
from __future__ import annotations

import os

from jobrunner.models import hub
from jobrunner.config.lora import LoraOptions
from jobrunner.config.sections import EngineOptions, InputOptions
from jobrunner.models.known import KNOWN_MODELS
from jobrunner.openai.batch import FORMAT
from jobrunner.openai.routed import RoutedJob
from jobrunner.jobs import JobSpec, PromptBuilder, make_job
from jobrunner.jobs.kind import JobKind
from jobrunner.jobs.lora import LoraJob


def model_names(model: str, input: InputOptions, lora: LoraOptions, source: str | None = None) -> frozenset[str] | None:
    """What a line's body.model may say (`model`: --model; the names --served-model-name gives, the
    adapters' names); None: anything (--any-model)."""
    if input.any_model:
        return None
    names = {model, *input.served_model_name, *lora.names}     # a LoRA adapter's name picks it
    if model in KNOWN_MODELS:
        names.add(KNOWN_MODELS[model].hub_name)
    if hub.is_hub_name(model):
        names.add(hub.parse(model)[0])
    for path in (model, source):
        if path and os.path.exists(path):
            names.update({path.rstrip("/"), os.path.abspath(path)})
    return frozenset(n for n in names if n)


def job_for(fmt: str, engine: EngineOptions, input: InputOptions, lora: LoraOptions, spec: JobSpec, tokenizer,
            pooling=None, source: str | None = None, builder: PromptBuilder | None = None) -> JobKind:
    """The job kind of a dataset of format `fmt` (ValueError as make_job's: embed on a checkpoint pooling we
    don't reproduce); its LoRA adapters (`lora`), an OpenAI batch's model names (`engine`, `input`:
    model_names). builder: the job's PromptBuilder, which renders a score line's pairs for a reranker
    (jobs.pairs)."""
    if fmt != FORMAT:
        job = make_job(spec, tokenizer, pooling)
        return LoraJob(job, lora.names, lora.column) if lora.adapters else job
    main = make_job(spec, tokenizer, pooling)
    routed = RoutedJob(main, spec, tokenizer, pooling, model_names(engine.model, input, lora, source), builder)
    return LoraJob(routed, lora.names, by_model=True) if lora.adapters else routed
