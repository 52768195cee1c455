"""The job's LoRA adapters: --lora NAME=PATH (repeatable; TOML and API lora = {name = "path"}),
--lora-column, --max-loras, as one frozen section of JobConfig (its `lora` field), checking itself
when built. Finding each adapter's local directory and content hash is IO: jobrunner.job.resolve does it
once per job (Resolved.lora); an adapter's config is checked there by the engine (engine.check_adapter)
before any weight is read."""
from __future__ import annotations

import re
from dataclasses import dataclass

from jobrunner.config.option_values import JobConfigError

_NAME = re.compile(r"^[A-Za-z0-9_.:/@-]+$")
PLAN_MARK = 2**32 - 1                          # planner tokens: an adapter's rows start with PLAN_MARK - index


@dataclass(frozen=True)
class LoraOptions:
    # (name, path as given), in the order given; built from NAME=PATH strings (the CLI), a {name: path}
    # table (TOML, API) or pairs (a JSON round trip)
    lora: tuple[tuple[str, str], ...] = ()
    lora_column: str | None = None                 # the column whose value names a row's adapter
    max_loras: int | None = None                   # adapters on the device at once (None: all)

    def __post_init__(self):
        object.__setattr__(self, "lora", lora_pairs(self.lora))
        names = self.names
        for name in names:
            if not _NAME.match(name):
                raise JobConfigError(f"--lora {name}=...: a name is letters, digits and _ . : / @ - only")
        if len(set(names)) != len(names):
            raise JobConfigError(f"--lora names must differ: {', '.join(names)}")
        if self.lora_column is not None and not isinstance(self.lora_column, str):
            raise JobConfigError(f"lora_column must be a column name, not {self.lora_column!r}")
        if self.lora_column and not names:
            raise JobConfigError("--lora-column needs adapters: --lora NAME=PATH")
        m = self.max_loras
        if m is not None and (isinstance(m, bool) or not isinstance(m, int)):
            raise JobConfigError(f"max_loras must be an integer, not {m!r}")
        if m is not None and m < 1:
            raise JobConfigError("--max-loras must be >= 1")

    @property
    def adapters(self) -> tuple[tuple[str, str], ...]:
        return self.lora

    @property
    def column(self) -> str | None:
        return self.lora_column

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.lora)

    def plan_tokens(self, adapter: str | None, tokens):
        """What the planner sorts a row by: its adapter's mark, then its tokens, so rows are grouped by
        adapter and share prefixes only with rows of the same adapter (KV never crosses adapters)."""
        if adapter is None:
            return tokens
        return [PLAN_MARK - self.names.index(adapter), *tokens]


def lora_pairs(value) -> tuple[tuple[str, str], ...]:
    """--lora values as (name, path) pairs: NAME=PATH strings (the CLI), a {name: path} table (TOML,
    API) or pairs (a JSON round trip). JobConfigError naming the bad one."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, str):
        items = [value]
    else:
        items = list(value)
    out = []
    for item in items:
        if isinstance(item, str):
            name, eq, path = item.partition("=")
            if not eq or not name or not path:
                raise JobConfigError(f"--lora {item!r}: write NAME=PATH (a directory, fsspec URL or Hub name)")
            item = (name, path)
        item = tuple(item) if isinstance(item, (list, tuple)) else item
        if not isinstance(item, tuple) or len(item) != 2 or not all(isinstance(x, str) and x for x in item):
            raise JobConfigError(f"lora: {item!r} is not a name and a path")
        out.append(item)
    return tuple(out)
