"""Small helpers of the job configuration: its error, value parsing (sizes, label lists), the
device check and the `a, b or c` phrase of its messages."""
from __future__ import annotations

import re


class JobConfigError(ValueError):
    """A job configuration that cannot run; the message says what to fix."""


def either(choices: tuple[str, ...]) -> str:
    """('a', 'b', 'c') -> 'a, b or c'."""
    return f"{', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else choices[0]


_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_device(device: str) -> None:
    """auto, cpu, cuda, cuda:N, or mps where this torch has it; else JobConfigError."""
    if _DEVICE.match(device):
        return
    if device == "mps":
        import torch        # only for --device mps: the command line's start loads no torch
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


def split_labels(text: str) -> tuple[str, ...]:
    """'positive, negative,,neutral' -> ('positive', 'negative', 'neutral'), as --labels reads it."""
    return tuple(x.strip() for x in text.split(",") if x.strip())
