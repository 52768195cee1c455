"""Job kinds: each turns a row into an engine request and an engine output into result columns.
No file IO and no torch here. A kind is told what to do by a JobSpec (jobs.spec), never by the
CLI's configuration."""
from jobs.base import PromptBuilder, RowError
from jobs.classify import ClassifyJob
from jobs.generate import GenerateJob
from jobs.score import ScoreJob
from jobs.spec import ClassifySpec, EvalSpec, JobSpec, PromptSpec, ScoreSpec

# The job kinds, by name: the one list of them (the CLI's --kind choices are its keys).
KINDS = {"generate": GenerateJob, "classify": ClassifyJob, "score": ScoreJob}


def make_job(spec: JobSpec, tokenizer):
    return KINDS[spec.kind](spec, tokenizer)


__all__ = ["KINDS", "ClassifySpec", "EvalSpec", "JobSpec", "PromptBuilder", "PromptSpec", "RowError", "ScoreSpec",
           "make_job"]
