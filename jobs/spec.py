"""What a job kind is told: small frozen specs, built once from the job's configuration by the
CLI (jobrunner.config.JobConfig.job_spec), and the choices their fields take (the CLI offers
these same tuples). The job kinds read these, never the CLI's configuration."""
from __future__ import annotations

from dataclasses import dataclass

from engine.request import Constraint, SamplingParams

MATCH_MODES = ("exact", "normalized", "contains")   # how an output is compared with its reference (metrics.matches)
NORMALIZE_MODES = ("sum", "mean")                   # classify: a label's score from its tokens' logprobs


@dataclass(frozen=True)
class PromptSpec:
    """How a row becomes a prompt (jobs.base.PromptBuilder). The template itself, checked against
    the dataset's columns, is passed to the builder as a jobs.template.PromptTemplate."""
    prompt_column: str = "prompt"
    messages_column: str | None = None      # a row's chat messages list; always through the chat template
    system: str | None = None               # as given: the template's escapes (\n ...) still in it
    chat: bool | None = None                # None: by kind (jobs.base.uses_chat)


@dataclass(frozen=True)
class EvalSpec:
    """Evaluation against a reference column: per-row `correct`, the job's accuracy."""
    reference_column: str | None = None     # None: no evaluation
    match: str = "normalized"               # one of MATCH_MODES

    @property
    def enabled(self) -> bool:
        return self.reference_column is not None


@dataclass(frozen=True)
class ClassifySpec:
    """classify: the candidate labels, fixed or a column's per-row list, and how a label scores."""
    labels: tuple[str, ...] = ()            # the job's labels; empty: each row's from labels_column
    labels_column: str | None = None
    normalize: str = "sum"                  # one of NORMALIZE_MODES


@dataclass(frozen=True)
class ScoreSpec:
    """score: the column whose log-likelihood after the prompt is measured."""
    score_column: str


@dataclass(frozen=True)
class JobSpec:
    """One job kind's whole instructions. `classify` is set for kind classify only, `score` for
    kind score only; `sampling` is what generate samples with (an OpenAI batch row's body
    parameters override it row by row: jobs.base.sampling_params)."""
    kind: str                               # a name of jobs.KINDS
    prompt: PromptSpec = PromptSpec()
    sampling: SamplingParams = SamplingParams()
    evaluation: EvalSpec = EvalSpec()
    classify: ClassifySpec | None = None
    score: ScoreSpec | None = None
    constraint: Constraint | None = None    # generate: what every output must match (jobs/constraint.py)
    schema_column: str | None = None        # generate: a JSON schema per row, in this column
