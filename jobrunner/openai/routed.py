"""An OpenAI batch job: each line's url picks the kind that answers it, in one job and one engine.

    /v1/embeddings                         -> embed (jobs.embed; RowOptions.kind "embed": jobrunner.openai.rows)
    /score, /rerank (and /v1/...)          -> pairs (jobs.pairs; RowOptions.kind "pairs"): a yes/no reranker's
                                              labels under --kind classify, else embedding cosine where the
                                              model embeds (--kind embed, or its sentence-transformers files)
    /v1/chat/completions, /v1/completions,
    /v1/responses                          -> the job's kind: generate, or classify / score for --kind

So a file that mixes embeddings and chat lines (vLLM's run-batch takes such files) runs as one job;
its result columns are both kinds' (the union). The embed kind is made on the first embeddings line
(a checkpoint whose pooling we don't reproduce fails those lines, not the job). Every line's
body.model must be a name of the job's model (`model_names`; None: any), else it is an error line,
as vLLM answers. Under classify or score a body key that the kind cannot honour is an error line
naming it (those kinds generate nothing: max_tokens, n, response_format... mean nothing to them).
"""
from __future__ import annotations

from dataclasses import replace

from jobrunner.engine import Request, RequestOutput
from jobrunner.jobs import PromptBuilder, RowError
from jobrunner.jobs.kind import JobKind
from jobrunner.jobs.embed import EmbedJob
from jobrunner.jobs.pairs import PairScoreJob
from jobrunner.jobs.row import NO_NOTES, NO_OPTIONS, RowNotes, RowOptions
from jobrunner.jobs.spec import EmbedSpec, JobSpec

# classify and score: the body parameters (jobrunner.openai.request's names) they honour, and the values
# of the others that ask for nothing they don't do (one answer; ranking labels is greedy).
SCORING_HONOURS = ("chat_template_kwargs", "instructions")     # instructions: a /v1/responses line's system message
SCORING_NEUTRAL = {"n": (1,), "temperature": (0, 0.0), "seed": None}     # None: any value


class RoutedJob:
    def __init__(self, main: JobKind, spec: JobSpec, tokenizer, pooling=None, model_names: frozenset[str] | None = None,
                 builder: PromptBuilder | None = None):
        self.main = main                        # the job's --kind
        self.name = main.name
        self.result_columns = {**main.result_columns, **EmbedJob.result_columns, **PairScoreJob.result_columns}
        self.model_names = model_names
        self._embed_args = (replace(spec, kind="embed", embed=spec.embed or EmbedSpec()), tokenizer, pooling)
        self._embed: EmbedJob | None = main if main.name == "embed" else None
        self._embed_error: str | None = None
        self._builder, self._tokenizer, self._pooling = builder, tokenizer, pooling
        self._pairs: PairScoreJob | str | None = None      # made on the first score or rerank line; str: why not

    def vector_size(self, hidden_size: int) -> int:
        """The `embedding` column's size: the embed kind's (a line's own `dimensions` may differ)."""
        return self.main.vector_size(hidden_size) if self.main.name == "embed" else hidden_size

    def request(self, row_id: str, prompt_ids: list[int], data: dict,
                options: RowOptions = NO_OPTIONS) -> tuple[Request, RowNotes]:
        self._check_model(options)
        if options.kind is None:
            if self.name in ("classify", "score"):
                _check_scoring_params(self.name, data.get("params") or {})
            if self.name == "embed":
                raise RowError("an OpenAI chat or completions line in an embed job: --kind embed serves "
                               "/v1/embeddings, /score and /rerank lines only")
        return self._kind(options).request(row_id, prompt_ids, data, options)

    def columns(self, out: RequestOutput, data: dict, options: RowOptions = NO_OPTIONS,
                notes: RowNotes = NO_NOTES) -> list[dict]:
        return self._kind(options).columns(out, data, options, notes)     # request() made the kind: this row's ran

    def _kind(self, options: RowOptions):
        if options.kind == "pairs":
            return self._pair_kind()
        if options.kind == "embed":
            return self._embed_kind()
        return self.main

    def _embed_kind(self) -> EmbedJob:
        if self._embed is None and self._embed_error is None:
            try:
                self._embed = EmbedJob(*self._embed_args)
            except ValueError as e:         # a checkpoint pooling we don't reproduce
                self._embed_error = str(e)
        if self._embed is None:
            raise RowError(f"this model cannot embed: {self._embed_error}")
        return self._embed

    def _pair_kind(self) -> PairScoreJob:
        """A yes/no reranker's labels under --kind classify; embedding cosine under --kind embed or for a
        checkpoint whose sentence-transformers files say how it embeds; else the line fails saying why."""
        if self._pairs is None:
            if self.main.name == "classify":
                self._pairs = PairScoreJob("labels", self.main, self._builder, self._tokenizer)
            elif self.main.name == "embed" or self.main.name == "generate" and self._pooling is not None:
                try:
                    self._pairs = PairScoreJob("cosine", self._embed_kind())
                except RowError as e:
                    self._pairs = str(e)
            else:
                self._pairs = (f"this model cannot score pairs under --kind {self.main.name}: a yes/no reranker "
                               "(Qwen3-Reranker) runs them with --kind classify --labels yes,no and a --template "
                               "with {query} and {document}; an embedding model with --kind embed (cosine)")
        if isinstance(self._pairs, str):
            raise RowError(f"url: {self._pairs}")
        return self._pairs

    def _check_model(self, options: RowOptions) -> None:
        model = options.model
        if self.model_names is None or model is None or model in self.model_names:
            return
        names = ", ".join(sorted(self.model_names))
        raise RowError(f"model {model!r} is not this job's model (its names: {names}); pass "
                       f"--served-model-name {model!r} to give it that name, or --any-model to serve every line")


def _check_scoring_params(kind: str, params: dict) -> None:
    for key, value in params.items():
        if key in SCORING_HONOURS:
            continue
        neutral = SCORING_NEUTRAL.get(key, ())
        if neutral is None or value in neutral:
            continue
        raise RowError(f"parameter {key!r} is not supported by --kind {kind} (it generates nothing, it ranks or "
                       "scores); remove it, or run the file without --kind")
