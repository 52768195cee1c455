"""Job kinds: each turns a row into an engine request and an engine output into result columns.
No file IO and no torch here. A kind is told what to do by a JobSpec (jobs.spec), never by the
CLI's configuration."""
from jobrunner.jobs.base import PromptBuilder, RowError
from jobrunner.jobs.classify import ClassifyJob
from jobrunner.jobs.embed import EmbedJob
from jobrunner.jobs.generate import GenerateJob
from jobrunner.jobs.score import ScoreJob
from jobrunner.jobs.tokens import TokensJob
from jobrunner.jobs.spec import ClassifySpec, EmbedSpec, EvalSpec, JobSpec, PromptSpec, ScoreSpec

# The job kinds, by name: the one list of them (the CLI's --kind choices are its keys).
KINDS = {"generate": GenerateJob, "classify": ClassifyJob, "score": ScoreJob, "embed": EmbedJob,
         "tokens": TokensJob}        # rows of token ids: the lm-eval backend's (jobrunner/lm_eval_model.py)


def make_job(spec: JobSpec, tokenizer, checkpoint_pooling=None):
    """The job kind; embed also reads the checkpoint's own pooling (engine.embedding_config) and raises
    ValueError when it pools in a way we don't reproduce."""
    if spec.kind == "embed":
        return EmbedJob(spec, tokenizer, checkpoint_pooling)
    return KINDS[spec.kind](spec, tokenizer)


__all__ = ["KINDS", "ClassifySpec", "EmbedSpec", "EvalSpec", "JobSpec", "PromptBuilder", "PromptSpec", "RowError", "ScoreSpec",
           "make_job"]
