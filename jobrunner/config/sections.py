"""The job configuration's sections, one frozen dataclass per group of `submit --help`; each checks
its own values when built (JobConfigError, with the command line's option names). Checks across
sections live in JobConfig.__post_init__; sampling ranges are SamplingParams' own (engine).

A field's name is its option's (`max_tokens` is --max-tokens, TOML `max_tokens`, API `max_tokens=`):
names are unique over all sections, so a flat option finds its section (config.FIELD_SECTION)."""
from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from typing import ClassVar

from jobrunner.engine import KV_CACHE_DTYPES, POOLINGS, QUANTIZATIONS, SPECULATIVE_MODES, SamplingParams
from jobrunner.config.constraints import validate_constraint_options
from jobrunner.config.option_values import JobConfigError, check_device, either
from jobrunner.images.sources import DEFAULT_MAX_BYTES, DEFAULT_MAX_PIXELS, DEFAULT_TIMEOUT_S, ImageLimits
from jobrunner.models.known import DEFAULT_MODEL
from jobrunner.config.ray import RayOptions
from jobrunner.jobs.reasoning import REASONING_PARSERS
from jobrunner.jobs.schema_check import SCHEMA_MODES
from jobrunner.jobs.spec import MATCH_MODES, NORMALIZE_MODES
from jobrunner.jobs.tool_parsers import TOOL_PARSERS
from jobrunner.jobs.truncation import TRUNCATE_MODES

FORMATS = ("auto", "parquet", "jsonl", "csv", "openai-batch")
OUTPUT_FORMATS = ("parquet", "openai-batch")
# the result cache's modes (jobrunner/cache/: what each serves and stores)
CACHE_MODES = ("read-write", "read-only", "write-only", "refresh")
MAX_TOP_LOGPROBS = 20       # OpenAI's bound on top_logprobs, ours too (jobrunner/openai/request.py)
JOB_QUANTIZATIONS = QUANTIZATIONS + ("auto",)   # auto: jobrunner.job.precision picks one (and the dtype)
_HOST_PATTERN = re.compile(r"^[\w*?.-]+$")     # --image-hosts: a host name or address, * and ? as wildcards


def _bad(message: str):
    raise JobConfigError(message)


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class InputOptions:
    dataset: str = ""
    format: str = "auto"
    id_column: str = "id"
    prompt_column: str = "prompt"
    messages_column: str | None = None
    served_model_name: tuple[str, ...] = ()     # OpenAI batch: more names a line's body.model may give the model
    any_model: bool = False                 # OpenAI batch: serve every line whatever its body.model names
    limit: int | None = None                # only the first N rows (for trying a job out)
    csv_max_lines: int = 10_000             # a CSV record over more lines: an unclosed quote (exit 2)
    max_row_bytes: int = 4 << 20            # a longer line, record or row is an error row (dataset.files' default)
    csv_delimiter: str | None = None        # None: a tab for .tsv, else sniffed from the header (csv_reader)
    # a row's images (jobrunner/images): a column of image structs, bytes, paths or URLs (or lists of them)
    image_column: str | None = None
    max_image_pixels: int = DEFAULT_MAX_PIXELS      # an image over this many pixels fails its row (bombs)
    max_image_bytes: int = DEFAULT_MAX_BYTES        # an encoded image over this many bytes fails its row
    image_timeout: float = DEFAULT_TIMEOUT_S        # seconds one download of an http(s) image may take, all of it
    image_hosts: tuple[str, ...] = ()               # http(s) image hosts allowed (names, *.patterns); empty: any
    image_allow_private: bool = False               # http(s) images from private hosts too (loopback, 10/8, ...)
    image_root: tuple[str, ...] = ()                # folders or store prefixes image paths may be under, past the dataset's

    def __post_init__(self):
        if self.format not in FORMATS:
            _bad(f"--format must be one of {', '.join(FORMATS)}, not {self.format!r}")
        if self.limit is not None and self.limit < 0:
            _bad("--limit must be >= 0 (a number of rows)")
        if self.max_row_bytes < 1:
            _bad("--max-row-bytes must be >= 1 (the bytes of a dataset's line, CSV record or Parquet row)")
        if self.csv_max_lines < 1:
            _bad("--csv-max-lines must be >= 1 (the lines a CSV record may span)")
        if self.max_image_pixels < 1 or self.max_image_bytes < 1:
            _bad("--max-image-pixels and --max-image-bytes must be >= 1")
        if not self.image_timeout > 0:
            _bad("--image-timeout must be > 0 seconds")
        for host in self.image_hosts:
            if not _HOST_PATTERN.match(host) and not _is_address(host):
                _bad(f"--image-hosts takes host names or patterns such as images.example.com or *.example.com "
                     f"(repeat the option for more), not {host!r}")
        if self.csv_delimiter is not None and (len(self.csv_delimiter) != 1 or self.csv_delimiter in '"\r\n'):
            _bad(f"--csv-delimiter must be one character other than a quote or newline (a tab: $'\\t'), "
                 f"not {self.csv_delimiter!r}")

    def image_limits(self) -> ImageLimits:
        """How far the job goes for one image (jobrunner/images)."""
        return ImageLimits(max_pixels=self.max_image_pixels, max_bytes=self.max_image_bytes,
                           timeout_s=self.image_timeout, hosts=self.image_hosts,
                           allow_private=self.image_allow_private, roots=self.image_root)


@dataclass(frozen=True)
class PromptOptions:
    template: str | None = None
    system: str | None = None
    chat: bool | None = None                # None: by kind (jobs.base.uses_chat): generate chats, classify/score don't
    chat_template_kwargs: str | None = None     # a JSON object of extra chat template variables
    truncate_prompt: str = "none"           # none | left | right (jobs.truncation); generate only
    show_prompt: bool = False               # submit logs the first row's rendered prompt

    def __post_init__(self):
        self.template_kwargs()
        if self.truncate_prompt not in TRUNCATE_MODES:
            _bad(f"--truncate-prompt must be {either(TRUNCATE_MODES)}, not {self.truncate_prompt!r}")

    def template_kwargs(self) -> dict:
        """--chat-template-kwargs as a dict; JobConfigError when it is not a JSON object."""
        if not self.chat_template_kwargs:
            return {}
        try:
            value = json.loads(self.chat_template_kwargs)
        except ValueError as e:
            raise JobConfigError(f"--chat-template-kwargs is not valid JSON ({e}); "
                                 'write an object, e.g. \'{"enable_thinking": false}\'') from None
        if not isinstance(value, dict):
            raise JobConfigError('--chat-template-kwargs must be a JSON object, e.g. \'{"enable_thinking": false}\'')
        return value


_SAMPLING_WORD = re.compile(r"\b(max_tokens|temperature|top_p|top_k|min_p|n|presence_penalty|frequency_penalty|"
                            r"repetition_penalty|min_tokens)\b")


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int = 256
    # None: the model's generation_config.json value, else SamplingParams' (greedy; JobConfig.sampling_params)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: bool = False                  # a `logprobs` column: each generated token's logprob
    top_logprobs: int = 0                   # and its k most likely alternatives (implies logprobs)

    def __post_init__(self):
        try:        # the ranges are SamplingParams'; an unset value is checked once the model's is known
            self.params({})
        except ValueError as e:
            raise JobConfigError(_SAMPLING_WORD.sub(lambda m: "--" + m.group(1).replace("_", "-"), str(e))) from None
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            _bad(f"--top-logprobs must be in [0, {MAX_TOP_LOGPROBS}]")

    def params(self, chosen: dict) -> SamplingParams:
        """SamplingParams of these options, the checkpoint-tunable ones (temperature, top_p, top_k,
        min_p) from `chosen` where given there, else this section's where set."""
        tunable = {k: v for k in ("temperature", "top_p", "top_k", "min_p")
                   if (v := chosen.get(k, getattr(self, k))) is not None}
        return SamplingParams(max_tokens=self.max_tokens, seed=self.seed, stop=tuple(self.stop),
                              ignore_eos=self.ignore_eos, n=self.n, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              min_tokens=self.min_tokens,
                              logprobs=self.top_logprobs if self.logprobs or self.top_logprobs else None, **tunable)


# --- the job kind: a tagged union, one dataclass per kind, its `name` the tag (--kind) ---------------

@dataclass(frozen=True)
class _Evaluated:
    reference_column: str | None = None     # per-row `correct`, summary accuracy
    match: str = "normalized"               # exact | normalized | contains

    def __post_init__(self):
        if self.match not in MATCH_MODES:
            _bad(f"--match must be {either(MATCH_MODES)}")


@dataclass(frozen=True)
class GenerateKind(_Evaluated):
    name: ClassVar[str] = "generate"
    reasoning_parser: str | None = None     # a name of jobs.reasoning.REASONING_PARSERS
    # structured output: at most one of these five, or a schema per row (jobrunner/config/constraints.py)
    json_schema: str | None = None          # a JSON schema: its text, or a file (path or fsspec URL)
    json: bool = False                      # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] = ()            # the output is exactly one of these
    grammar: str | None = None              # a Lark or GBNF-style EBNF grammar file
    schema_column: str | None = None        # a JSON schema per row (an OpenAI row's response_format wins)
    json_schema_mode: str = "strict"        # strict | validate (jobs/schema_check.py)
    tools: str | None = None                # function tools offered to every row: JSON text, or a file (jobs/tools.py)
    tool_choice: str | None = None          # none | auto | required | a function's name; None: auto
    tool_call_parser: str | None = None     # a name of jobs.tool_parsers.TOOL_PARSERS; None: the chat template's

    def __post_init__(self):
        super().__post_init__()
        if self.tool_choice is not None and not self.tools:
            _bad("--tool-choice needs --tools (the functions the model may call)")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            _bad(f"--tool-call-parser must be {either(tuple(TOOL_PARSERS))}, not {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            _bad(f"--reasoning-parser must be {either(tuple(REASONING_PARSERS))}, not {self.reasoning_parser!r}")
        if self.json_schema_mode not in SCHEMA_MODES:
            _bad(f"--json-schema-mode must be strict or validate, not {self.json_schema_mode!r}")
        validate_constraint_options(self)


@dataclass(frozen=True)
class ClassifyKind(_Evaluated):
    name: ClassVar[str] = "classify"
    labels: tuple[str, ...] = ()
    labels_column: str | None = None
    normalize: str = "sum"                  # sum | mean of label token logprobs
    label_delimiter: str = " "              # between prompt and label (jobs/classify.py: when not)

    def __post_init__(self):
        super().__post_init__()
        if bool(self.labels) == bool(self.labels_column):
            _bad("classify needs exactly one of --labels a,b,c or --labels-column COL")
        if self.labels and len(set(self.labels)) != len(self.labels):
            _bad("--labels has duplicates")
        if self.normalize not in NORMALIZE_MODES:
            _bad(f"--normalize must be {either(NORMALIZE_MODES)}")


@dataclass(frozen=True)
class ScoreKind(_Evaluated):
    name: ClassVar[str] = "score"
    score_column: str | None = None         # the text whose log-likelihood after the prompt is measured

    def __post_init__(self):
        super().__post_init__()
        if not self.score_column:
            _bad("--kind score needs --score-column COL (the text whose log-likelihood is measured)")


@dataclass(frozen=True)
class EmbedKind:
    name: ClassVar[str] = "embed"
    pooling: str | None = None              # last | mean | cls; None: the checkpoint's, else last
    normalize_embeddings: bool | None = None    # L2-normalize; None: the checkpoint's, else yes
    dimensions: int | None = None           # keep the first N values (Matryoshka), then normalize

    def __post_init__(self):
        if self.pooling is not None and self.pooling not in POOLINGS:
            _bad(f"--pooling must be {either(POOLINGS)}, not {self.pooling!r}")
        if self.dimensions is not None and self.dimensions < 1:
            _bad("--dimensions must be >= 1 (the embedding's first N values are kept)")


@dataclass(frozen=True)
class TokensKind:
    """Rows of token ids (jobs/tokens.py, the lm-eval backend's): scored continuations, or generation with
    the sampling section's options. No options of its own."""
    name: ClassVar[str] = "tokens"


KindOptions = GenerateKind | ClassifyKind | ScoreKind | EmbedKind | TokensKind
KIND_OPTIONS: dict[str, type] = {k.name: k for k in (GenerateKind, ClassifyKind, ScoreKind, EmbedKind, TokensKind)}

# An option of another kind than the job's, given: the message (None: ignored, as it always was)
FOREIGN_KIND_OPTION = {
    "labels": "--labels/--labels-column need --kind classify", "labels_column": "--labels/--labels-column need "
    "--kind classify", "normalize": None, "label_delimiter": None,
    "score_column": "--score-column needs --kind score",
    **dict.fromkeys(("pooling", "normalize_embeddings", "dimensions"),
                    "--pooling, --normalize-embeddings and --dimensions need --kind embed"),
    "reference_column": "--n and --reference-column apply to generate and classify, not to embed", "match": None,
    "reasoning_parser": "--reasoning-parser applies to --kind generate only",
    **{name: f"--{name.replace('_', '-')} constrains generated text: it needs --kind generate"
       for name in ("json_schema", "json", "regex", "choice", "grammar", "schema_column")},
    "json_schema_mode": "--json-schema-mode applies to --kind generate only",
    **dict.fromkeys(("tools", "tool_choice", "tool_call_parser"),
                    "--tools, --tool-choice and --tool-call-parser apply to --kind generate only"),
}


# --- the engine, the output, reuse, parallelism ----------------------------------------------------

@dataclass(frozen=True)
class EngineOptions:
    model: str = DEFAULT_MODEL
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    kv_cache_memory: int | None = None
    block_size: int = 16
    max_num_seqs: int | None = None         # None: by device (256 on CPU, 1024 on a GPU)
    max_batched_tokens: int | None = None   # None: by device (2048 on CPU, 8192 on a GPU)
    plan: bool = True                       # order rows so shared prefixes run back to back
    prefix_cache: bool = True
    cuda_graphs: bool = True                # replay CUDA graphs for decode steps (GPUs only)
    async_scheduling: bool = True           # schedule the next step while the current one runs
    threads: int | None = None              # CPU compute threads; None: the cores nothing else is busy on
    packed_weights: bool = True             # float32/bfloat16 CPU linears on oneDNN over weights packed once
    deterministic: bool = False             # batch-invariant results: a row's bits whatever shares its batch (CPU)
    speculative: str = "off"                # off | ngram | draft | auto: draft tokens from each row's own prompt and
                                            # output, or from a draft model
    speculative_tokens: int = 4             # drafted tokens a row verifies a step, at most
    draft_model: str | None = None          # --speculative draft (or auto): the model that drafts, as --model names one
    grammar_timeout: float = 30.0           # seconds a constraint may take to compile

    def __post_init__(self):
        if self.threads is not None and self.threads < 1:
            _bad("--threads must be >= 1 (leave it out to use the cores nothing else is busy on)")
        if self.block_size < 1 or any(v is not None and v < 1 for v in (self.max_num_seqs, self.max_batched_tokens)):
            _bad("--block-size, --max-num-seqs and --max-batched-tokens must be >= 1")
        if self.quantization not in JOB_QUANTIZATIONS:
            _bad(f"--quantization must be one of {', '.join(JOB_QUANTIZATIONS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            _bad(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}")
        if not self.grammar_timeout > 0:
            _bad("--grammar-timeout must be > 0 seconds")
        if self.speculative not in SPECULATIVE_MODES:
            _bad(f"--speculative must be one of {', '.join(SPECULATIVE_MODES)}, not {self.speculative!r}")
        if not 1 <= self.speculative_tokens <= 16:
            _bad("--speculative-tokens must be between 1 and 16")
        if self.speculative == "draft" and not self.draft_model:
            _bad("--speculative draft needs --draft-model (a smaller model with the same vocabulary)")
        if self.draft_model and self.speculative not in ("draft", "auto"):
            _bad(f"--draft-model drafts for --speculative draft or auto, not {self.speculative} (ngram drafts by "
                 "n-gram lookup): add --speculative draft (always) or auto (where it pays)")
        check_device(self.device)


@dataclass(frozen=True)
class OutputOptions:
    output: str | None = None               # default: <dataset>.results/ beside the dataset (JobConfig.output_url)
    output_format: str = "parquet"          # parquet | openai-batch (also writes the OpenAI batch output file)
    part_rows: int = 10_000
    flush_seconds: float = 60.0             # a part is written at least this often: what a kill can lose
    overwrite: bool = False
    max_error_rate: float | None = None
    fail_on_empty: bool = False             # an empty dataset exits 2 instead of 0 with a warning
    allow_all_failed: bool = False          # a job whose every row failed exits 0, not 3
    device_hourly_cost: float | None = None
    lease_optional: bool = False            # a lease that cannot be taken (an unknown store error) warns, not exit 4

    def __post_init__(self):
        if self.part_rows < 1:
            _bad("--part-rows must be >= 1")
        if not self.flush_seconds > 0:
            _bad("--flush-seconds must be > 0")
        if self.device_hourly_cost is not None and self.device_hourly_cost < 0:
            _bad("--device-hourly-cost must be >= 0 (USD per device-hour)")
        if self.max_error_rate is not None and not 0 <= self.max_error_rate <= 1:
            _bad("--max-error-rate is a fraction in [0, 1], e.g. 0.01")
        if self.output_format not in OUTPUT_FORMATS:
            _bad(f"--output-format must be {either(OUTPUT_FORMATS)}")


@dataclass(frozen=True)
class ReuseOptions:
    """jobrunner/cache/reuse.py: identical rows computed once; results cached across runs."""
    dedup: bool = True
    cache: str | None = None                # result cache URL (api.build_config: $JOBRUNNER_CACHE_URL by default)
    cache_mode: str = "read-write"          # read-write | read-only | write-only | refresh

    def __post_init__(self):
        if self.cache_mode not in CACHE_MODES:
            _bad(f"--cache-mode must be {either(CACHE_MODES)}, not {self.cache_mode!r}")


@dataclass(frozen=True)
class ParallelOptions:
    data_parallel: int | None = None        # None: visible GPUs // tensor_parallel; 1 on CPU
    tensor_parallel: int = 1                # devices (processes) one engine spans; its ranks share --threads
    ray: RayOptions | None = None           # --ray: the workers are Ray actors (jobrunner/config/ray.py)

    def __post_init__(self):
        if self.ray is not None and not isinstance(self.ray, RayOptions):
            _bad(f"ray must be a RayOptions (config.field_value makes one of an address or a table), "
                 f"not {self.ray!r}")
        if self.data_parallel is not None and self.data_parallel < 1:
            _bad("--data-parallel must be >= 1")
        if isinstance(self.tensor_parallel, bool) or not isinstance(self.tensor_parallel, int) \
                or self.tensor_parallel < 1:
            _bad(f"--tensor-parallel must be an integer >= 1 (the devices one engine spans), "
                 f"not {self.tensor_parallel!r}")
