"""Prompt templates: plain `{column}` substitution, nothing else.

Syntax (checked once, at construction):
- `{name}` is replaced by the row's value of column `name`;
- `{{` and `}}` are a literal `{` and `}`;
- `\\n`, `\\t` and `\\\\` (backslash n, backslash t, two backslashes) are a newline, a tab and one
  backslash, wherever the template comes from: the command line, where a shell passes them
  as typed, or TOML, where a basic string has already turned "\\n" into a newline.  Any other
  backslash is kept as is.  (`unescape` applies the same rule to --system.)
- anything str.format would treat as code or formatting is refused: attribute
  access `{a.b}`, indexing `{a[0]}`, conversions `{a!r}`, format specs `{a:>5}`,
  empty `{}` placeholders, unmatched braces.  Templates come from users' job
  files, so they must never reach Python objects' attributes.
Rendering: str values as is, dict/list as JSON, bytes as UTF-8 text, other values
with str().  A missing or null value raises TemplateRowError (one bad row, not a
bad template): the caller records it as that row's error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["PromptTemplate", "TemplateRowError", "render_value", "unescape"]

_FORBIDDEN = {".": "attribute access", "[": "indexing", "]": "indexing",
              "!": "conversions", ":": "format specs", "{": "nested braces"}
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}
_ESCAPE = re.compile(r"\\([nt\\])")


def unescape(text: str) -> str:
    """Backslash n, backslash t and two backslashes -> newline, tab, one backslash (one pass,
    so an escaped backslash never starts another escape); other backslashes stay."""
    return _ESCAPE.sub(lambda m: _ESCAPES[m.group(1)], text)


class TemplateRowError(KeyError):
    """A row lacks a value the template needs. `column` names it."""

    def __init__(self, column: str, reason: str = "missing"):
        super().__init__(column)
        self.column = column
        self.reason = reason

    def __str__(self) -> str:  # KeyError would quote the whole message
        return f"template column {self.column!r} is {self.reason}"


def render_value(value: Any) -> str:
    """How one non-null cell value becomes prompt text."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def _parse(text: str) -> list[tuple[str, str | None]]:
    """Split into [(literal, column or None)], literals with braces and escapes resolved.
    Raises ValueError on bad syntax."""
    parts: list[tuple[str, str | None]] = []
    literal: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "{" and text.startswith("{{", i):
            literal.append("{")
            i += 2
        elif c == "}" and text.startswith("}}", i):
            literal.append("}")
            i += 2
        elif c == "}":
            raise ValueError(f"template: single '}}' at position {i}; write '}}}}' for a literal brace")
        elif c == "{":
            end = text.find("}", i + 1)
            if end < 0:
                raise ValueError(f"template: '{{' at position {i} is never closed; "
                                 "write '{{' for a literal brace")
            name = text[i + 1:end]
            for ch, what in _FORBIDDEN.items():
                if ch in name:
                    raise ValueError(
                        f"template: placeholder {{{name}}} at position {i} uses {what} ({ch!r}); "
                        "only plain {column} substitution is allowed (use {{ and }} for literal braces)")
            if not name.strip():
                raise ValueError(f"template: empty placeholder '{{}}' at position {i}; "
                                 "name a column, e.g. {prompt}")
            parts.append((unescape("".join(literal)), name))
            literal = []
            i = end + 1
        else:
            literal.append(c)
            i += 1
    parts.append((unescape("".join(literal)), None))
    return parts


class PromptTemplate:
    """A prompt template like "Classify: {text}\\nAnswer:"; see module doc for the rules."""

    def __init__(self, text: str):
        if not isinstance(text, str):
            raise ValueError(f"template must be a string, got {type(text).__name__}")
        self.text = text
        self._parts = _parse(text)
        # placeholder names in first-use order, without repeats
        self.columns: list[str] = list(dict.fromkeys(n for _, n in self._parts if n is not None))

    def missing_columns(self, available: Sequence[str]) -> list[str]:
        """Placeholders that name no column of the dataset (a configuration error)."""
        have = set(available)
        return [c for c in self.columns if c not in have]

    def render(self, row_data: Mapping[str, Any]) -> str:
        out: list[str] = []
        for literal, name in self._parts:
            out.append(literal)
            if name is None:
                continue
            if name not in row_data:
                raise TemplateRowError(name, "missing")
            value = row_data[name]
            if value is None:
                raise TemplateRowError(name, "null")
            out.append(render_value(value))
        return "".join(out)

    def __repr__(self) -> str:
        return f"PromptTemplate({self.text!r})"
