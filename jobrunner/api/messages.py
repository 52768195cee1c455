"""The Python API's errors in its own words: keyword arguments, not command-line flags, and for
`generate` the caller's rows, not the memory:// file they are written to."""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from jobrunner.config.job import JobConfigError, config_fields

_FLAG = re.compile(r"--(no-)?([a-z][a-z0-9-]*)")


def check_known(options: Mapping, not_options: Iterable[str]) -> None:
    """JobConfigError naming the options that are not JobConfig fields, and the ones there are
    (bar not_options: those the caller takes otherwise, or refuses)."""
    known = config_fields()
    unknown = sorted(set(options) - set(known))
    if unknown:
        skip = set(not_options)
        raise JobConfigError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                             f"the options are {', '.join(k for k in known if k not in skip)}")


def api_message(text: str, rows_url: str | None = None) -> str:
    """A CLI message for an API caller: --max-tokens -> max_tokens (--no-chat -> chat=False); with
    rows_url (generate's memory:// dataset), the file becomes "the rows"."""
    fields = set(config_fields()) | {"config"}

    def option(m: re.Match) -> str:
        name = m.group(2).replace("-", "_")
        if name not in fields:
            return m.group(0)
        return f"{name}=False" if m.group(1) else name

    if rows_url is not None:
        text = text.replace(f"dataset {rows_url}", "the rows").replace(rows_url, "the rows")
    return _FLAG.sub(option, text)
