"""The job's configuration: one frozen dataclass, built once by the CLI (command line over TOML file
over these defaults) and validated before any work starts."""
from __future__ import annotations

import functools
import json
import logging
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from engine import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
# sampling options that, left unset, take the model's generation_config.json value
from engine import SAMPLING_KEYS as SAMPLING_DEFAULT_KEYS
from engine import POOLINGS, SamplingParams
from jobrunner.cache import CACHE_MODES
from jobrunner.constraint_options import job_constraint, validate_constraint_options
from jobrunner.lora_options import LoraConfigError, LoraOptions
from jobrunner.models import DEFAULT_MODEL
from jobrunner.openai_request import MAX_TOP_LOGPROBS
from jobs import KINDS
from jobs.reasoning import REASONING_PARSERS
from jobs.spec import MATCH_MODES, NORMALIZE_MODES, ClassifySpec, EmbedSpec, EvalSpec, JobSpec, PromptSpec, ScoreSpec
from jobs.truncation import TRUNCATE_MODES

log = logging.getLogger("jobrunner")

# The choices of the options that take one; the command line's click.Choice lists are these same tuples
# (KINDS: the job kinds by name, jobs.KINDS; QUANTIZATIONS, KV_CACHE_DTYPES: engine.config; MATCH_MODES,
# NORMALIZE_MODES: jobs.spec; POOLINGS: engine.request).
FORMATS = ("auto", "parquet", "jsonl", "csv", "openai-batch")
OUTPUT_FORMATS = ("parquet", "openai-batch")
JOB_QUANTIZATIONS = QUANTIZATIONS + ("auto",)   # auto: jobrunner.precision picks one (and the dtype)
__all__ = ["CACHE_MODES", "FORMATS", "KINDS", "KV_CACHE_DTYPES", "MATCH_MODES", "NORMALIZE_MODES", "OUTPUT_FORMATS",
           "JOB_QUANTIZATIONS", "POOLINGS", "QUANTIZATIONS",
           "JobConfig", "JobConfigError", "check_device", "config_fields", "field_value", "parse_size",
           "split_labels"]


class JobConfigError(ValueError):
    """A job configuration that cannot run; the message says what to fix."""


@dataclass(frozen=True)
class JobConfig:
    dataset: str
    output: str | None = None               # default: <dataset>.results/ beside the dataset (see output_url)
    model: str = DEFAULT_MODEL
    format: str = "auto"
    id_column: str = "id"
    prompt_column: str = "prompt"
    messages_column: str | None = None
    template: str | None = None
    system: str | None = None
    chat: bool | None = None                # None: by kind (jobs.base.uses_chat): generate chats, classify/score don't
    show_prompt: bool = False               # submit logs the first row's rendered prompt
    # sampling
    max_tokens: int = 256
    # None: the model's generation_config.json value, else SamplingParams' (greedy; see sampling_params)
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
    # reasoning models and long prompts
    chat_template_kwargs: str | None = None     # a JSON object of extra chat template variables
    reasoning_parser: str | None = None         # a name of jobs.reasoning.REASONING_PARSERS
    truncate_prompt: str = "none"               # none | left | right (jobs.truncation)
    # job kinds
    kind: str = "generate"
    labels: tuple[str, ...] = ()
    labels_column: str | None = None
    normalize: str = "sum"                  # classify: sum | mean of label token logprobs
    label_delimiter: str = " "              # classify: between prompt and label (jobs/classify.py: when not)
    reference_column: str | None = None
    match: str = "normalized"               # exact | normalized | contains
    score_column: str | None = None
    pooling: str | None = None              # embed: last | mean | cls; None: the checkpoint's, else last
    normalize_embeddings: bool | None = None    # embed: L2-normalize; None: the checkpoint's, else yes
    dimensions: int | None = None           # embed: keep the first N values (Matryoshka), then normalize
    # structured output (generate): at most one of these five, or a schema per row
    json_schema: str | None = None          # a JSON schema: its text, or a file (path or fsspec URL)
    json: bool = False                      # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] = ()            # the output is exactly one of these
    grammar: str | None = None              # a Lark or GBNF-style EBNF grammar file
    schema_column: str | None = None        # a JSON schema per row (an OpenAI row's response_format wins)
    grammar_timeout: float = 30.0           # seconds a constraint may take to compile
    json_schema_mode: str = "strict"        # strict | validate (jobs/schema_check.py)
    # engine
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
    data_parallel: int | None = None
    tensor_parallel: int = 1                # devices (processes) one engine spans; its ranks share --threads
    # output
    part_rows: int = 10_000
    flush_seconds: float = 60.0             # a part is written at least this often: what a kill can lose
    overwrite: bool = False
    max_error_rate: float | None = None
    fail_on_empty: bool = False             # an empty dataset exits 2 instead of 0 with a warning
    allow_all_failed: bool = False          # a job whose every row failed exits 0, not 3
    device_hourly_cost: float | None = None
    output_format: str = "parquet"          # parquet | openai-batch (also writes the OpenAI batch output file)
    served_model_name: tuple[str, ...] = ()     # OpenAI batch: more names a line's body.model may give the model
    any_model: bool = False                 # OpenAI batch: serve every line whatever its body.model names
    limit: int | None = None                # only the first N rows (for trying a job out)
    # reuse (jobrunner/reuse.py): identical rows computed once; results cached across runs
    dedup: bool = True
    cache: str | None = None                # result cache URL (api.build_config: $JOBRUNNER_CACHE_URL by default)
    cache_mode: str = "read-write"          # read-write | read-only | write-only | refresh
    csv_max_lines: int = 10_000             # a CSV record over more lines: an unclosed quote (exit 2)
    lora: LoraOptions = LoraOptions()       # LoRA adapters per row (jobrunner/lora_options.py)
    given: frozenset = frozenset()          # the options the user set (CLI, TOML, API); not an option

    # --- the one place the job's configuration becomes the engine's and the job kind's ----------

    def engine_config(self) -> EngineConfig:
        """The engine's configuration. A known model name becomes its local file here, pulled into
        the cache on first use (jobrunner.models: this may download); JobConfigError when it can't."""
        from engine import ModelError
        from jobrunner.models import resolve_model
        try:
            model = resolve_model(self.model)
        except ModelError as e:
            raise JobConfigError(str(e)) from None
        dtype, quantization = self.dtype, self.quantization
        if quantization == "auto":
            from jobrunner.precision import auto_precision
            dtype, quantization, why = auto_precision(self.device, self.dtype)
            if quantization == "w8a8" and self.tensor_parallel > 1:    # not splittable: the exact float path
                quantization, why = "none", f"{why}, but w8a8 does not split over --tensor-parallel ranks"
            log.info("--quantization auto: dtype %s, quantization %s (%s)", dtype, quantization, why)
        return EngineConfig(
            model=model, dtype=dtype, device=self.device, quantization=quantization,
            kv_cache_dtype=self.kv_cache_dtype, kv_cache_memory=self.kv_cache_memory, block_size=self.block_size,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_batched_tokens,
            enable_prefix_caching=self.prefix_cache, cuda_graphs=self.cuda_graphs,
            async_scheduling=self.async_scheduling, seed=self.seed or 0, num_threads=self.cpu_threads(),
            grammar_timeout_s=self.grammar_timeout, tensor_parallel=self.tensor_parallel,
            loras=self._resolved_loras(), max_loras=self.lora.max_loras)

    def _resolved_loras(self) -> tuple[tuple[str, str], ...]:
        from engine import ModelError
        try:
            return self.lora.resolved()
        except ModelError as e:
            raise JobConfigError(str(e)) from None

    def cpu_threads(self) -> int:
        """Threads of each process of the engine: --threads (else the free cores) shared by its
        --tensor-parallel ranks, at least one each (two busy threads on one core stall each other)."""
        from jobrunner.threads import free_cores
        return max(1, (self.threads or free_cores()) // self.tensor_parallel)

    def sampling_sources(self, model_defaults: Mapping | None = None) -> dict[str, dict]:
        """Each checkpoint-tunable sampling option's value and where it came from: the job (command
        line, TOML or API), the model's generation_config.json, or the engine's default (as vLLM)."""
        defaults = SamplingParams()
        out = {}
        for key in SAMPLING_DEFAULT_KEYS:
            if getattr(self, key) is not None:
                out[key] = {"value": getattr(self, key), "source": "job"}
            elif key in (model_defaults or {}):
                out[key] = {"value": model_defaults[key], "source": "generation_config.json"}
            else:
                out[key] = {"value": getattr(defaults, key), "source": "default"}
        return out

    def sampling_params(self, model_defaults: Mapping | None = None) -> SamplingParams:
        """What generate samples with: the job's options, each left None taken from `model_defaults`
        (the checkpoint's, engine.generation_config) or SamplingParams' default. An OpenAI batch row's
        body overrides it (jobs.base.sampling_params). JobConfigError when n > 1 would be greedy."""
        chosen = {k: v["value"] for k, v in self.sampling_sources(model_defaults).items()}
        if self.n > 1 and chosen["temperature"] == 0:
            raise JobConfigError(f"--n {self.n} with temperature 0 gives {self.n} identical samples; "
                                 "set --temperature > 0")
        return SamplingParams(max_tokens=self.max_tokens, seed=self.seed, stop=tuple(self.stop),
                              ignore_eos=self.ignore_eos, n=self.n, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              min_tokens=self.min_tokens,
                              logprobs=self.top_logprobs if self.logprobs or self.top_logprobs else None, **chosen)

    def job_spec(self, model_defaults: Mapping | None = None) -> JobSpec:
        """The job kind's instructions; call after validate(). model_defaults: as sampling_params'."""
        return JobSpec(
            kind=self.kind,
            prompt=PromptSpec(prompt_column=self.prompt_column, messages_column=self.messages_column,
                              system=self.system, chat=self.chat,
                              chat_template_kwargs=tuple(self.template_kwargs().items())),
            sampling=self.sampling_params(model_defaults),
            evaluation=EvalSpec(reference_column=self.reference_column, match=self.match),
            classify=ClassifySpec(labels=tuple(self.labels), labels_column=self.labels_column,
                                  normalize=self.normalize, delimiter=self.label_delimiter)
            if self.kind == "classify" else None,
            score=ScoreSpec(score_column=self.score_column) if self.kind == "score" else None,
            embed=EmbedSpec(pooling=self.pooling, normalize=self.normalize_embeddings,
                            dimensions=self.dimensions) if self.kind == "embed" else None,
            reasoning_parser=self.reasoning_parser, truncate_prompt=self.truncate_prompt,
            constraint=job_constraint(self), schema_column=self.schema_column, schema_mode=self.json_schema_mode)

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

    @property
    def output_url(self) -> str:
        if self.output:
            return self.output
        # Keeps the format suffix, so x.csv and x.jsonl never share an output; drops compression only.
        base = self.dataset.rstrip("/")
        for suffix in (".gz", ".zst"):
            base = base.removesuffix(suffix)
        return base.replace("*", "_") + ".results"

    def fingerprint_fields(self) -> dict:
        """What decides the rows' outputs: a different value refuses to resume into the same output."""
        # tensor_parallel, like data_parallel and the batch limits, changes where and in what order sums are
        # taken (a float's last bits), not what the job asks for: a job may resume on another split
        skip = {"output", "overwrite", "part_rows", "max_error_rate", "device_hourly_cost", "data_parallel",
                "tensor_parallel", "allow_all_failed",
                "max_num_seqs", "max_batched_tokens", "plan", "prefix_cache", "cuda_graphs", "async_scheduling",
                "kv_cache_memory", "limit", "device", "block_size", "show_prompt",
                "fail_on_empty", "flush_seconds", "threads", "dedup", "cache", "cache_mode", "grammar_timeout",
                "csv_max_lines", "given"} | ({"label_delimiter"} if self.kind != "classify" else set())
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if k not in skip}
        d["lora"] = {"adapters": self.lora.content_hashes(), "column": self.lora.column} if self.lora.adapters else None
        for k in _ADDED_LATER:              # at their defaults, outputs begun before they existed still resume
            if d[k] == _DEFAULT_FINGERPRINT[k]:
                del d[k]
        return d

    def validate(self) -> None:
        """Checks that need no file or model; raises JobConfigError."""
        def bad(msg):
            raise JobConfigError(msg)
        if self.kind not in KINDS:
            bad(f"--kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if self.format not in FORMATS:
            bad(f"--format must be one of {', '.join(FORMATS)}, not {self.format!r}")
        if self.max_tokens < 0:
            bad("--max-tokens must be >= 0")
        if self.temperature is not None and self.temperature < 0:
            bad("--temperature must be >= 0")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            bad("--top-p must be in (0, 1]")
        if (self.top_k or 0) < 0 or not 0 <= (self.min_p or 0) <= 1:
            bad("--top-k must be >= 0 and --min-p in [0, 1]")
        if self.n < 1:
            bad("--n must be >= 1")
        if self.n > 1 and self.temperature == 0:
            bad(f"--n {self.n} with --temperature 0 gives {self.n} identical samples; set --temperature > 0")
        self._validate_generation(bad)
        if self.part_rows < 1 or (self.limit is not None and self.limit < 0):
            bad("--part-rows must be >= 1" if self.part_rows < 1 else "--limit must be >= 0 (a number of rows)")
        if not self.flush_seconds > 0:
            bad("--flush-seconds must be > 0")
        if self.device_hourly_cost is not None and self.device_hourly_cost < 0:
            bad("--device-hourly-cost must be >= 0 (USD per device-hour)")
        if self.max_error_rate is not None and not 0 <= self.max_error_rate <= 1:
            bad("--max-error-rate is a fraction in [0, 1], e.g. 0.01")
        if self.template and self.messages_column:
            bad("--template and --messages-column contradict each other: a row's prompt comes from one of them")
        if self.kind == "classify":
            if bool(self.labels) == bool(self.labels_column):
                bad("classify needs exactly one of --labels a,b,c or --labels-column COL")
            if self.labels and len(set(self.labels)) != len(self.labels):
                bad("--labels has duplicates")
            if self.n > 1:
                bad("--n applies to generation, not to classify")
        elif self.labels or self.labels_column:
            bad("--labels/--labels-column need --kind classify")
        if self.kind == "score" and not self.score_column:
            bad("--kind score needs --score-column COL (the text whose log-likelihood is measured)")
        if self.score_column and self.kind != "score":
            bad("--score-column needs --kind score")
        self._validate_embed(bad)
        if self.normalize not in NORMALIZE_MODES:
            bad(f"--normalize must be {_either(NORMALIZE_MODES)}")
        if self.match not in MATCH_MODES:
            bad(f"--match must be {_either(MATCH_MODES)}")
        if self.threads is not None and self.threads < 1:
            bad("--threads must be >= 1 (leave it out to use the cores nothing else is busy on)")
        if self.block_size < 1 or any(v is not None and v < 1 for v in (self.max_num_seqs, self.max_batched_tokens)):
            bad("--block-size, --max-num-seqs and --max-batched-tokens must be >= 1")
        if self.output_format not in OUTPUT_FORMATS:
            bad(f"--output-format must be {_either(OUTPUT_FORMATS)}")
        if self.quantization not in JOB_QUANTIZATIONS:
            bad(f"--quantization must be one of {', '.join(JOB_QUANTIZATIONS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}")
        validate_constraint_options(self)
        if self.data_parallel is not None and self.data_parallel < 1:
            bad("--data-parallel must be >= 1")
        if isinstance(self.tensor_parallel, bool) or not isinstance(self.tensor_parallel, int) \
                or self.tensor_parallel < 1:
            bad(f"--tensor-parallel must be an integer >= 1 (the devices one engine spans), "
                f"not {self.tensor_parallel!r}")
        if self.tensor_parallel > 1 and self.quantization.split(":")[0] == "w8a8":
            bad(f"--quantization w8a8 calibrates on the whole model, which no rank of --tensor-parallel "
                f"{self.tensor_parallel} holds; use int8, int4 or fp8 (GPU), or --tensor-parallel 1")
        if self.cache_mode not in CACHE_MODES:
            bad(f"--cache-mode must be {_either(CACHE_MODES)}, not {self.cache_mode!r}")
        check_device(self.device)
        try:
            self.lora.validate()
        except LoraConfigError as e:
            bad(str(e))


    def _validate_embed(self, bad) -> None:
        if self.kind == "embed":
            if self.pooling is not None and self.pooling not in POOLINGS:
                bad(f"--pooling must be {_either(POOLINGS)}, not {self.pooling!r}")
            if self.dimensions is not None and self.dimensions < 1:
                bad("--dimensions must be >= 1 (the embedding's first N values are kept)")
            if self.n > 1 or self.reference_column:
                bad("--n and --reference-column apply to generate and classify, not to embed")
        elif self.pooling is not None or self.normalize_embeddings is not None or self.dimensions is not None:
            bad("--pooling, --normalize-embeddings and --dimensions need --kind embed")

    def _validate_generation(self, bad) -> None:
        """The logits processing, logprobs, reasoning and truncation options."""
        if not (-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2):
            bad("--presence-penalty and --frequency-penalty must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            bad("--repetition-penalty must be > 0 (1 is off)")
        if not 0 <= self.min_tokens <= self.max_tokens:
            bad("--min-tokens must be in [0, --max-tokens]")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            bad(f"--top-logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        self.template_kwargs()
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            bad(f"--reasoning-parser must be {_either(tuple(REASONING_PARSERS))}, not {self.reasoning_parser!r}")
        if self.truncate_prompt not in TRUNCATE_MODES:
            bad(f"--truncate-prompt must be {_either(TRUNCATE_MODES)}, not {self.truncate_prompt!r}")
        for name, on in (("--reasoning-parser", self.reasoning_parser), ("--truncate-prompt",
                                                                        self.truncate_prompt != "none")):
            if on and self.kind != "generate":
                bad(f"{name} applies to --kind generate only")


# Options added after outputs were written with the fingerprint that lacks them (issues 17 and 23).
_ADDED_LATER = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs",
                "top_logprobs", "chat_template_kwargs", "reasoning_parser", "truncate_prompt",      # issue 17
                "json_schema", "json", "regex", "choice", "grammar", "schema_column",
                "pooling", "normalize_embeddings", "dimensions", "served_model_name", "any_model",  # 23, 29
                "json_schema_mode", "lora")  # 29, 33
_DEFAULT_FINGERPRINT = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(JobConfig("")).items()} | {
    "lora": None}


def _either(choices: tuple[str, ...]) -> str:
    """('a', 'b', 'c') -> 'a, b or c'."""
    return f"{', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else choices[0]


_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_device(device: str) -> None:
    """auto, cpu, cuda, cuda:N, or mps where this torch has it; else JobConfigError."""
    if _DEVICE.match(device):
        return
    if device == "mps":
        import torch
        if torch.backends.mps.is_available():
            return
        raise JobConfigError("--device mps: this torch build or machine has no MPS (Apple GPU); "
                             "use auto, cpu or cuda")
    gpu = str(device).lower().split(":")[0] in ("gpu", "nvidia")
    hint = "; for an NVIDIA GPU write --device cuda (or cuda:N)" if gpu else ""
    raise JobConfigError(f"--device must be auto, cpu, cuda or cuda:N, not {device!r}{hint}")


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str | int) -> int:
    """'64MB' -> 64_000_000, '8GiB' -> 8 * 2**30, 1024 -> 1024."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _UNITS:
        raise JobConfigError(f"cannot read size {text!r}; write e.g. 512MB, 8GiB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[unit])


def config_fields() -> dict:
    return {f.name: f for f in fields(JobConfig) if f.name != "given"}


def split_labels(text: str) -> tuple[str, ...]:
    """'positive, negative,,neutral' -> ('positive', 'negative', 'neutral'), as --labels reads it."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


_EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
             tuple: "a string or a list of strings"}


@functools.cache
def _field_types() -> dict[str, type]:
    return {k: _base_type(h) for k, h in typing.get_type_hints(JobConfig).items()}


def _base_type(hint) -> type:
    """`int | None` -> int, `tuple[str, ...]` -> tuple, `bool` -> bool."""
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


def field_value(key: str, value):
    """A JobConfig field's value from TOML (or the command line), checked against the field's type
    with the command line's conversions: a string `stop` is one stop string, a string `labels` is
    comma-separated, `kv_cache_memory` a size like "8GiB". Raises JobConfigError naming the key."""
    want = _field_types()[key]
    if key == "lora" and not isinstance(value, LoraOptions):      # {name: path}: the adapters alone
        try:
            return LoraOptions.parse({"lora": value})
        except (LoraConfigError, TypeError) as e:
            raise JobConfigError(f"lora: {e}") from None
    if key == "chat_template_kwargs" and isinstance(value, dict):
        return json.dumps(value)
    if key == "kv_cache_memory" and isinstance(value, (str, int)) and not isinstance(value, bool):
        try:
            return parse_size(value)
        except JobConfigError as e:
            raise JobConfigError(f"{key}: {e}") from None
    if want is tuple and isinstance(value, str):
        if key not in ("labels", "choice"):
            return (value,)
        if not (items := split_labels(value)):     # given, yet nothing in it: never run as if not given
            raise JobConfigError(f"{key}: {value!r} holds no value; give comma-separated values, e.g. a,b,c")
        return items
    if want is tuple and isinstance(value, (list, tuple)) and all(isinstance(x, str) for x in value):
        return tuple(value)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    # bool is a subclass of int: an integer field refuses true/false, a bool field refuses 1/0
    if isinstance(value, want) and (want is bool or not isinstance(value, bool)):
        return value
    expected = 'a size such as "8GiB" or a number of bytes' if key == "kv_cache_memory" else _EXPECTED[want]
    raise JobConfigError(f"{key} must be {expected}, not {value!r} ({type(value).__name__})")
