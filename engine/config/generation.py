"""A checkpoint's `generation_config.json`: the sampling defaults its authors recommend.

Its EOS ids are the tokenizer's (engine/load/tokenizer.py: Tokenizer.from_hf_dir), always. Its
sampling values are defaults, as vLLM takes them (`--generation-config auto`): a job uses them
for each sampling option it leaves unset (jobrunner.config.job.JobConfig.sampling_params), and like
vLLM we read them whatever `do_sample` says.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# generation_config.json key (also the SamplingParams field) -> the range the field accepts.
_RANGES = {
    "temperature": lambda v: v >= 0,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: v >= 0 and float(v).is_integer(),
    "min_p": lambda v: 0 <= v <= 1,
}
SAMPLING_KEYS = tuple(_RANGES)
# Keys vLLM also applies as defaults that we take from the job only, with their neutral values: any
# other value is reported (the user passes it with the option of the same name).
_NOT_APPLIED = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict[str, float | int] = field(default_factory=dict)    # SamplingParams field -> value
    ignored: dict[str, str] = field(default_factory=dict)             # key -> why it is not used

    @classmethod
    def from_config(cls, gen: dict[str, Any]) -> "GenerationDefaults":
        """From a generation_config.json dict. A value out of its field's range, or not a number, is
        ignored (and said so): a checkpoint's suggestion never stops a job."""
        sampling, ignored = {}, {}
        for key, valid in _RANGES.items():
            value = gen.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not valid(value):
                ignored[key] = f"{value!r} is out of range"
            else:
                sampling[key] = int(value) if key == "top_k" else float(value)
        for key, neutral in _NOT_APPLIED.items():
            if gen.get(key) is not None and gen[key] != neutral:
                ignored[key] = f"{gen[key]!r}: not applied as a default; pass --{key.replace('_', '-')}"
        return cls(sampling, ignored)
