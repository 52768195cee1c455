"""The job's LoRA adapters: --lora NAME=PATH (repeatable; TOML lora = {name = "path"}), --lora-column,
--max-loras, as one frozen section of JobConfig (its `lora` field).

    LoraOptions.parse(values)     the option values (CLI, TOML or API keys lora, lora_column, max_loras)
    lora.validate()               JobConfigError for a malformed name or a column without adapters
    lora.resolved()               (name, local directory) each, a path through the base models' resolution
                                  (a local directory, an fsspec URL, a Hub name); may download
    lora.records()                name, path and content hash each: the manifest, the fingerprint, cache keys

An adapter's config is checked by the engine (engine.check_adapter) before any weight is read.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

KEYS = ("lora", "lora_column", "max_loras")     # the option names folded into this section
_NAME = re.compile(r"^[A-Za-z0-9_.:/@-]+$")
PLAN_MARK = 2**32 - 1                          # planner tokens: an adapter's rows start with PLAN_MARK - index


class LoraConfigError(ValueError):
    """Raised as the job's JobConfigError by the caller."""


@dataclass(frozen=True)
class LoraOptions:
    adapters: tuple[tuple[str, str], ...] = ()     # (name, path as given), in the order given
    column: str | None = None                      # the column whose value names a row's adapter
    max_loras: int | None = None                   # adapters on the device at once (None: all)

    @classmethod
    def parse(cls, values: dict, base: LoraOptions | None = None) -> LoraOptions:
        """From option values: lora as NAME=PATH strings (the CLI), a {name: path} table (TOML, API) or
        pairs; a key absent keeps base's value."""
        base = base or cls()
        adapters = base.adapters
        if "lora" in values:
            adapters = _pairs(values["lora"])
        column = values.get("lora_column", base.column)
        max_loras = values.get("max_loras", base.max_loras)
        if column is not None and not isinstance(column, str):
            raise LoraConfigError(f"lora_column must be a column name, not {column!r}")
        if max_loras is not None and (isinstance(max_loras, bool) or not isinstance(max_loras, int)):
            raise LoraConfigError(f"max_loras must be an integer, not {max_loras!r}")
        return cls(adapters, column, max_loras)

    @classmethod
    def from_json(cls, d: dict) -> LoraOptions:
        """From dataclasses.asdict's dict after a JSON round trip (data-parallel workers' configs)."""
        return cls(tuple((n, p) for n, p in d.get("adapters") or ()), d.get("column"), d.get("max_loras"))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.adapters)

    def validate(self) -> None:
        names = self.names
        for name in names:
            if not _NAME.match(name):
                raise LoraConfigError(f"--lora {name}=...: a name is letters, digits and _ . : / @ - only")
        if len(set(names)) != len(names):
            raise LoraConfigError(f"--lora names must differ: {', '.join(names)}")
        if self.column and not names:
            raise LoraConfigError("--lora-column needs adapters: --lora NAME=PATH")
        if self.max_loras is not None and self.max_loras < 1:
            raise LoraConfigError("--max-loras must be >= 1")

    def resolved(self) -> tuple[tuple[str, str], ...]:
        return tuple((name, _local(path)) for name, path in self.adapters)

    def records(self) -> list[dict]:
        """{name, path, content_hash} of each adapter (read once per process)."""
        return [{"name": n, "path": p, "content_hash": h} for (n, p), h in zip(self.adapters, _hashes(self))]

    def content_hashes(self) -> dict[str, str]:
        return {r["name"]: r["content_hash"] for r in self.records()}

    def plan_tokens(self, adapter: str | None, tokens):
        """What the planner sorts a row by: its adapter's mark, then its tokens, so rows are grouped by
        adapter and share prefixes only with rows of the same adapter (KV never crosses adapters)."""
        if adapter is None:
            return tokens
        return [PLAN_MARK - self.names.index(adapter), *tokens]


def fold_lora(values: dict, base: LoraOptions | None = None) -> dict:
    """Option values with lora, lora_column and max_loras folded into one LoraOptions under "lora"
    (over `base`, e.g. the TOML file's, for the keys not given). JobConfigError naming a bad value."""
    given = {k: values.pop(k) for k in KEYS if k in values}
    if not given:
        return values
    if isinstance(given.get("lora"), LoraOptions):
        base, given = given.pop("lora"), given
    try:
        values["lora"] = LoraOptions.parse(given, base if isinstance(base, LoraOptions) else None)
    except LoraConfigError as e:
        from jobrunner.config import JobConfigError
        raise JobConfigError(str(e)) from None
    return values


def _pairs(value) -> tuple[tuple[str, str], ...]:
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
                raise LoraConfigError(f"--lora {item!r}: write NAME=PATH (a directory, fsspec URL or Hub name)")
            item = (name, path)
        if len(item) != 2 or not all(isinstance(x, str) and x for x in item):
            raise LoraConfigError(f"lora: {item!r} is not a name and a path")
        out.append((item[0], item[1]))
    return tuple(out)


@functools.cache
def _local(path: str) -> str:
    """A local directory holding the adapter: the base models' resolution (jobrunner.models)."""
    from engine import ModelError
    from jobrunner.config import JobConfigError
    from jobrunner.models import resolve_adapter
    try:
        return resolve_adapter(path)
    except ModelError as e:
        raise JobConfigError(str(e)) from None


def _hashes(options: LoraOptions) -> tuple[str, ...]:
    """Each adapter's content hash, its config checked (engine.check_adapter) on the way: called by the
    fingerprint, before the output directory or the model is touched. JobConfigError when refused.
    Hashed once per process while its files' sizes and times stay the same."""
    from engine import ConfigError
    from jobrunner.config import JobConfigError
    try:
        return tuple(_hash(name, path, _stamp(path)) for name, path in options.resolved())
    except ConfigError as e:
        raise JobConfigError(str(e)) from None


def _stamp(path: str) -> tuple:
    import os
    stats = [os.stat(os.path.join(path, f)) for f in ("adapter_config.json", "adapter_model.safetensors")
             if os.path.exists(os.path.join(path, f))]
    return tuple((s.st_size, s.st_mtime_ns) for s in stats)


@functools.cache
def _hash(name: str, path: str, stamp: tuple) -> str:
    from engine import check_adapter
    return check_adapter(name, path).content_hash
