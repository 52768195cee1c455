"""What a job kind is told: small frozen specs, built once from the job's configuration by the
CLI (jobrunner.config.job.JobConfig.job_spec), and the choices their fields take (the CLI offers
these same tuples). The job kinds read these, never the CLI's configuration."""
from __future__ import annotations

from dataclasses import dataclass

from jobrunner.engine import POOLINGS, CheckpointPooling, Constraint, EmbedParams, SamplingParams
from jobrunner.jobs.tools import ToolRequest

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
    chat_template_kwargs: tuple[tuple[str, object], ...] = ()   # extra template variables (enable_thinking)


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
    delimiter: str = " "                    # between the prompt and a label (jobs/classify.py says when)


@dataclass(frozen=True)
class ScoreSpec:
    """score: the column whose log-likelihood after the prompt is measured."""
    score_column: str


@dataclass(frozen=True)
class EmbedSpec:
    """embed: how hidden states become a row's vector. None: what the checkpoint's sentence-transformers
    files say (engine.embedding_config), else last-token pooling, L2-normalized."""
    pooling: str | None = None              # one of POOLINGS
    normalize: bool | None = None
    dimensions: int | None = None           # Matryoshka: keep the first N, then normalize

    def params(self, checkpoint: CheckpointPooling | None) -> EmbedParams:
        """The engine's parameters, the checkpoint's defaults filled in. ValueError, saying what to pass,
        when the checkpoint pools in a way we don't reproduce and no --pooling overrides it."""
        if checkpoint is not None and checkpoint.unsupported and self.pooling is None:
            raise ValueError(f"the checkpoint's embedding pipeline has {checkpoint.unsupported}, which jobrunner "
                             f"does not apply; pass --pooling {'|'.join(POOLINGS)} to embed anyway")
        pooling = self.pooling or (checkpoint.pooling if checkpoint else None) or "last"
        normalize = self.normalize if self.normalize is not None else (checkpoint.normalize if checkpoint else True)
        return EmbedParams(pooling, normalize, self.dimensions)


@dataclass(frozen=True)
class JobSpec:
    """One job kind's whole instructions. `classify` is set for kind classify only, `score` for
    kind score only, `embed` for kind embed only; `sampling` is what generate samples with (a row's own
    settings override it row by row: jobs.row.RowOptions.sampling, jobs.base.sampling_params)."""
    kind: str                               # a name of jobs.KINDS
    prompt: PromptSpec = PromptSpec()
    sampling: SamplingParams = SamplingParams()
    evaluation: EvalSpec = EvalSpec()
    classify: ClassifySpec | None = None
    score: ScoreSpec | None = None
    embed: EmbedSpec | None = None
    reasoning_parser: str | None = None     # generate: a name of jobs.reasoning.REASONING_PARSERS
    truncate_prompt: str = "none"           # generate: one of jobs.truncation.TRUNCATE_MODES
    context: int | None = None              # the engine's context in tokens, set once it is up (truncation)
    constraint: Constraint | None = None    # generate: what every output must match (jobs/constraint.py)
    schema_column: str | None = None        # generate: a JSON schema per row, in this column
    schema_mode: str = "strict"             # generate: how JSON schemas compile (jobs.schema_check.SCHEMA_MODES)
    tools: ToolRequest | None = None        # functions offered to every row (a row's own win: RowOptions.tools)
    tool_call_parser: str | None = None     # a name of jobs.tool_parsers.TOOL_PARSERS; None: the chat template's
