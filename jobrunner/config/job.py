"""The job's configuration: one frozen JobConfig of typed sections (jobrunner/config/sections.py, one
per group of `submit --help`), built once from flat options (command line over TOML file over the
sections' defaults, or the API's keywords: `from_options`), each section checking itself as it is
built. What a configuration implies but cannot know without IO (the model's local path, `auto`
precision, the cache URL, the output's state) is found once by jobrunner.job.resolve and kept beside it.

Adding a section: a frozen dataclass in its own module (its fields' names unique over all sections,
each one an option's), a field of JobConfig with that dataclass as type and a default instance, and
its name -> class in SECTIONS; `from_options`, `options()`, TOML and the API then know its fields."""
from __future__ import annotations

import functools
import json
import logging
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from jobrunner.engine import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from jobrunner.engine import SAMPLING_KEYS as SAMPLING_DEFAULT_KEYS   # left unset: the model's generation_config.json value
from jobrunner.engine import POOLINGS, SamplingParams
from jobrunner.config.constraints import job_constraint
from jobrunner.config.tool_options import job_tools
from jobrunner.config.sections import CACHE_MODES, FOREIGN_KIND_OPTION, FORMATS, JOB_QUANTIZATIONS, KIND_OPTIONS, OUTPUT_FORMATS, ClassifyKind, EmbedKind, EngineOptions, GenerateKind, InputOptions, KindOptions, OutputOptions, ParallelOptions, PromptOptions, ReuseOptions, SamplingOptions, ScoreKind
from jobrunner.config.option_values import JobConfigError, check_device, parse_size, split_labels
from jobrunner.config.ray import RayOptions
from jobrunner.config.lora import LoraOptions, lora_pairs
from jobrunner.common.threads import threads_each
from jobrunner.jobs import KINDS
from jobrunner.jobs.spec import MATCH_MODES, NORMALIZE_MODES, ClassifySpec, EmbedSpec, EvalSpec, JobSpec, PromptSpec, ScoreSpec

log = logging.getLogger("jobrunner")

__all__ = ["CACHE_MODES", "FORMATS", "KINDS", "KV_CACHE_DTYPES", "MATCH_MODES", "NORMALIZE_MODES", "OUTPUT_FORMATS",
           "JOB_QUANTIZATIONS", "POOLINGS", "QUANTIZATIONS", "ClassifyKind", "EmbedKind", "GenerateKind",
           "JobConfig", "JobConfigError", "ScoreKind", "check_device", "config_fields", "field_value",
           "job_config", "option_defaults", "parse_size", "split_labels"]

# The sections but the job kind (a tagged union: KIND_OPTIONS by --kind), by JobConfig field name.
SECTIONS: dict[str, type] = {"input": InputOptions, "prompt": PromptOptions, "sampling": SamplingOptions,
                             "engine": EngineOptions, "output": OutputOptions, "reuse": ReuseOptions,
                             "parallel": ParallelOptions, "lora": LoraOptions}


@dataclass(frozen=True)
class JobConfig:
    input: InputOptions
    prompt: PromptOptions = PromptOptions()
    sampling: SamplingOptions = SamplingOptions()
    kind: KindOptions = GenerateKind()
    engine: EngineOptions = EngineOptions()
    output: OutputOptions = OutputOptions()
    reuse: ReuseOptions = ReuseOptions()
    parallel: ParallelOptions = ParallelOptions()
    lora: LoraOptions = LoraOptions()           # LoRA adapters per row (jobrunner/config/lora.py)
    given: frozenset = field(default=frozenset())  # the options the user set (CLI, TOML, API): checks.check_dataset

    def __post_init__(self):
        """The checks across sections."""
        kind, n = self.kind.name, self.sampling.n
        if self.prompt.template and self.input.messages_column:
            raise JobConfigError("--template and --messages-column contradict each other: a row's prompt "
                                 "comes from one of them")
        if self.input.image_column and kind == "tokens":
            raise JobConfigError("--image-column needs a prompt the job builds (a prompt column, a template or "
                                 "messages); --kind tokens takes token ids")
        if n > 1 and kind == "classify":
            raise JobConfigError("--n applies to generation, not to classify")
        if n > 1 and kind == "embed":
            raise JobConfigError(FOREIGN_KIND_OPTION["reference_column"])
        if self.prompt.truncate_prompt != "none" and kind != "generate":
            raise JobConfigError("--truncate-prompt applies to --kind generate only")
        tp = self.parallel.tensor_parallel
        if tp > 1 and self.engine.quantization.split(":")[0] == "w8a8":
            raise JobConfigError(f"--quantization w8a8 calibrates on the whole model, which no rank of "
                                 f"--tensor-parallel {tp} holds; use int8, int4 or fp8 (GPU), or --tensor-parallel 1")

    @classmethod
    def from_options(cls, options: Mapping) -> JobConfig:
        """A JobConfig of flat options (field names, as config_fields(); `given` too), each in its section.
        An option of another job kind than `kind`'s, given other than at its default, is an error."""
        options = dict(options)
        kind = options.pop("kind", "generate")
        given = frozenset(options.pop("given", ()))
        if kind not in KIND_OPTIONS:
            raise JobConfigError(f"--kind must be one of {', '.join(KINDS)}, not {kind!r}")
        kind_cls, defaults = KIND_OPTIONS[kind], option_defaults()
        own = {f.name for f in fields(kind_cls)}
        values: dict[str, dict] = {name: {} for name in (*SECTIONS, "kind")}
        for name, value in options.items():
            section = FIELD_SECTION.get(name)
            if section is None:
                raise JobConfigError(f"unknown option {name}")
            if section == "kind" and name not in own:
                if value != defaults[name] and FOREIGN_KIND_OPTION[name]:
                    raise JobConfigError(FOREIGN_KIND_OPTION[name])
                continue
            values[section][name] = value
        return cls(kind=kind_cls(**values.pop("kind")), given=given,
                   **{name: SECTIONS[name](**v) for name, v in values.items()})

    def options(self) -> dict:
        """The flat options of this configuration (from_options' inverse, bar `given`)."""
        out = {"kind": self.kind.name}
        for name in (*SECTIONS, "kind"):
            section = getattr(self, name)
            out.update((f.name, getattr(section, f.name)) for f in fields(section))
        return out

    def with_options(self, **options) -> JobConfig:
        """This configuration with some flat options changed (as dataclasses.replace, by option name)."""
        return JobConfig.from_options({**self.options(), "given": self.given, **options})

    # --- the one place the job's configuration becomes the engine's and the job kind's ----------

    def engine_config(self, resolved) -> EngineConfig:
        """The engine's configuration, with what jobrunner.job.resolve found (the model's local path, the
        dtype and quantization `auto` stands for). Reads no file."""
        e = self.engine
        return EngineConfig(
            model=resolved.model, dtype=resolved.dtype, device=e.device, quantization=resolved.quantization,
            kv_cache_dtype=e.kv_cache_dtype, kv_cache_memory=e.kv_cache_memory, block_size=e.block_size,
            max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_batched_tokens,
            enable_prefix_caching=e.prefix_cache, cuda_graphs=e.cuda_graphs,
            async_scheduling=e.async_scheduling, seed=self.sampling.seed or 0, num_threads=self.cpu_threads(),
            packed_weights=e.packed_weights, batch_invariant=e.deterministic,
            speculative=e.speculative, num_speculative_tokens=e.speculative_tokens, draft_model=resolved.draft_model,
            grammar_timeout_s=e.grammar_timeout, tensor_parallel=self.parallel.tensor_parallel,
            loras=resolved.adapter_paths, max_loras=self.lora.max_loras)

    def cpu_threads(self) -> int:
        """Threads of each process of the engine: --threads (else the free cores) shared by its
        --tensor-parallel ranks, at least one each (two busy threads on one core stall each other)."""
        return threads_each(self.engine.threads, self.parallel.tensor_parallel)

    def sampling_sources(self, model_defaults: Mapping | None = None) -> dict[str, dict]:
        """Each checkpoint-tunable sampling option's value and where it came from: the job (command
        line, TOML or API), the model's generation_config.json, or the engine's default (as vLLM)."""
        defaults = SamplingParams()
        out = {}
        for key in SAMPLING_DEFAULT_KEYS:
            if getattr(self.sampling, key) is not None:
                out[key] = {"value": getattr(self.sampling, key), "source": "job"}
            elif key in (model_defaults or {}):
                out[key] = {"value": model_defaults[key], "source": "generation_config.json"}
            else:
                out[key] = {"value": getattr(defaults, key), "source": "default"}
        return out

    def sampling_params(self, model_defaults: Mapping | None = None) -> SamplingParams:
        """What generate samples with: the job's options, each left None taken from `model_defaults`
        (the checkpoint's, engine.generation_config) or SamplingParams' default. An OpenAI batch row's
        body overrides it (jobs.base.sampling_params). JobConfigError when n > 1 would be greedy: the
        one check of that rule (preload.check_sampling calls it before any work)."""
        chosen = {k: v["value"] for k, v in self.sampling_sources(model_defaults).items()}
        n = self.sampling.n
        if n > 1 and chosen["temperature"] == 0:
            raise JobConfigError(f"--n {n} with temperature 0 gives {n} identical samples; set --temperature > 0")
        return self.sampling.params(chosen)

    def job_spec(self, model_defaults: Mapping | None = None) -> JobSpec:
        """The job kind's instructions. model_defaults: as sampling_params'."""
        k, p, i = self.kind, self.prompt, self.input
        generate = k if isinstance(k, GenerateKind) else GenerateKind()
        return JobSpec(
            kind=k.name,
            prompt=PromptSpec(prompt_column=i.prompt_column, messages_column=i.messages_column,
                              system=p.system, chat=p.chat, chat_template_kwargs=tuple(p.template_kwargs().items())),
            sampling=self.sampling_params(model_defaults),
            evaluation=EvalSpec(reference_column=getattr(k, "reference_column", None),
                                match=getattr(k, "match", "normalized")),
            classify=ClassifySpec(labels=tuple(k.labels), labels_column=k.labels_column, normalize=k.normalize,
                                  delimiter=k.label_delimiter) if isinstance(k, ClassifyKind) else None,
            score=ScoreSpec(score_column=k.score_column) if isinstance(k, ScoreKind) else None,
            embed=EmbedSpec(pooling=k.pooling, normalize=k.normalize_embeddings, dimensions=k.dimensions)
            if isinstance(k, EmbedKind) else None,
            reasoning_parser=generate.reasoning_parser, truncate_prompt=p.truncate_prompt,
            constraint=job_constraint(generate), schema_column=generate.schema_column,
            schema_mode=generate.json_schema_mode, tools=job_tools(generate),
            tool_call_parser=generate.tool_call_parser)

    @property
    def output_url(self) -> str:
        if self.output.output:
            return self.output.output
        # Keeps the format suffix, so x.csv and x.jsonl never share an output; drops compression only.
        base = self.input.dataset.rstrip("/")
        for suffix in (".gz", ".zst"):
            base = base.removesuffix(suffix)
        return base.replace("*", "_") + ".results"

    def fingerprint_fields(self, adapter_hashes: Mapping[str, str] | None = None, shipped: str | None = None) -> dict:
        """What decides the rows' outputs: a different value refuses to resume into the same output. The
        flat options (every kind's, at their defaults but this kind's), bar _NOT_FINGERPRINTED. LoRA
        adapters count by content: a job with adapters needs their hashes (jobrunner.job.resolve:
        Resolved.adapter_hashes), so an adapter changed on disk refuses the resume. shipped: a quantized
        checkpoint's scheme (Resolved.shipped), kept only where there is one (float outputs' unchanged)."""
        if self.lora.lora and adapter_hashes is None:
            raise ValueError("a job with LoRA adapters is fingerprinted with their content hashes (Resolved)")
        skip = _NOT_FINGERPRINTED | ({"label_delimiter"} if self.kind.name != "classify" else set())
        d = {k: list(v) if isinstance(v, tuple) else v
             for k, v in {**option_defaults(), **self.options()}.items() if k not in skip}
        del d["lora_column"]
        d["lora"] = {"adapters": dict(adapter_hashes), "column": self.lora.lora_column} if self.lora.lora else None
        for k in _ADDED_LATER:              # at their defaults, outputs begun before they existed still resume
            if d[k] == _DEFAULT_FINGERPRINT[k]:
                del d[k]
        if shipped is not None:
            d["checkpoint_quantization"] = shipped
        return d


def job_config(dataset: str = "", **options) -> JobConfig:
    """JobConfig.from_options with the dataset first: job_config("x.jsonl", max_tokens=8)."""
    return JobConfig.from_options({"dataset": dataset, **options})


# Options that do not decide a row's output: tensor_parallel, like data_parallel and the batch limits,
# changes where and in what order sums are taken (a float's last bits), not what the job asks for.
_NOT_FINGERPRINTED = {
    "output", "overwrite", "part_rows", "max_error_rate", "device_hourly_cost", "data_parallel", "tensor_parallel",
    "allow_all_failed", "max_num_seqs", "max_batched_tokens", "plan", "prefix_cache", "cuda_graphs", "packed_weights",
    "async_scheduling", "kv_cache_memory", "limit", "device", "block_size", "show_prompt", "fail_on_empty",
    "flush_seconds", "threads", "dedup", "cache", "cache_mode", "grammar_timeout", "csv_max_lines", "max_loras",
    "max_row_bytes", "max_image_pixels", "max_image_bytes", "image_timeout",   # limits: which rows fail, not how
    "image_hosts", "image_allow_private", "image_root",         # where images may come from: the same
    "ray",      # where the workers run (Ray), like how many, never what a row gets
    "lease_optional",
    "speculative", "speculative_tokens", "draft_model"}     # the same tokens as without: sampled as the plain engine samples
NOT_FINGERPRINTED = frozenset(_NOT_FINGERPRINTED)     # how a job runs, not what a row gets (`jobrunner repair`'s help)
# Options added after outputs were written with the fingerprint that lacks them (issues 17, 23, 29, 33).
_ADDED_LATER = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs",
                "top_logprobs", "chat_template_kwargs", "reasoning_parser", "truncate_prompt",      # issue 17
                "json_schema", "json", "regex", "choice", "grammar", "schema_column",
                "pooling", "normalize_embeddings", "dimensions", "served_model_name", "any_model",  # 23, 29
                "json_schema_mode", "lora", "csv_delimiter",    # 29, 33, 41
                "tools", "tool_choice", "tool_call_parser",     # 45
                "image_column",                                 # 44
                "deterministic")                                # 61


def _section_classes() -> list[tuple[str, type]]:
    return [*SECTIONS.items(), *(("kind", cls) for cls in KIND_OPTIONS.values())]


FIELD_SECTION: dict[str, str] = {f.name: name for name, cls in _section_classes() for f in fields(cls)}


@functools.cache
def option_defaults() -> dict:
    """Every flat option's default, read from its section's dataclass (the command line's defaults)."""
    out = {"kind": "generate"}
    for _, cls in _section_classes():
        out.update((f.name, f.default) for f in fields(cls) if f.name not in out)
    return out


_DEFAULT_FINGERPRINT = {k: list(v) if isinstance(v, tuple) else v for k, v in option_defaults().items()}
_DEFAULT_FINGERPRINT["lora"] = None            # the fingerprint's lora entry of a job without adapters


@functools.cache
def config_fields() -> dict:
    """The flat options by name: each its section's dataclass Field (types: field_value)."""
    out = {"kind": field(default="generate")}
    for _, cls in _section_classes():
        out.update((f.name, f) for f in fields(cls) if f.name not in out)
    return out


_EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
             tuple: "a string or a list of strings"}


@functools.cache
def _field_types() -> dict[str, type]:
    out = {"kind": str}
    for _, cls in _section_classes():
        out.update((k, _base_type(h)) for k, h in typing.get_type_hints(cls).items() if k != "name")
    return out


def _base_type(hint) -> type:
    """`int | None` -> int, `tuple[str, ...]` -> tuple, `bool` -> bool."""
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


def field_value(key: str, value):
    """An option's value from TOML (or the command line), checked against its field's type with the
    command line's conversions: a string `stop` is one stop string, a string `labels` is
    comma-separated, `kv_cache_memory` a size like "8GiB". Raises JobConfigError naming the key."""
    want = _field_types()[key]
    if key == "ray":
        return RayOptions.from_value(value)
    if key == "lora" and isinstance(value, (dict, list, tuple, str)):   # {name: path}, NAME=PATH strings or pairs
        return lora_pairs(value)
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
