"""Job kinds: each turns a row into an engine request and an engine output into result columns.
No file IO and no torch here."""
from jobs.base import PromptBuilder, RowError
from jobs.classify import ClassifyJob
from jobs.generate import GenerateJob
from jobs.score import ScoreJob

KINDS = {"generate": GenerateJob, "classify": ClassifyJob, "score": ScoreJob}


def make_job(cfg, tokenizer):
    return KINDS[cfg.kind](cfg, tokenizer)


__all__ = ["KINDS", "PromptBuilder", "RowError", "make_job"]
