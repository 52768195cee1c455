"""The grammar that makes a reply tool calls: tool_choice required (one call or more) or a named
function (one call of it), in the wrapper the model family writes (jobs/tool_parsers.py), each call's
arguments valid under its function's parameters schema (llguidance's %json inside a Lark grammar).

    hermes:  start: call ("\\n" call)*     call: "<tool_call>\\n" %json{...} "\\n</tool_call>"
    mistral: start: <[TOOL_CALLS]> " [" %json{...} (", " %json{...})* "]"

A marker that is one special token of the tokenizer (Mistral's [TOOL_CALLS]) is matched as that token
(`<[id]>`); any other as its text. The call schema is {"name": const, <args key>: parameters}, one per
function (anyOf); each function's $defs move to the schema's root, where its "#/$defs/..." refs point.
"""
from __future__ import annotations

import json

from jobrunner.engine import Constraint
from jobrunner.jobs.schema_check import LENIENT
from jobrunner.jobs.tools import ToolRequest

# JSON on one line, as chat templates write calls (the engine's JSON_STYLE for json_schema constraints)
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
_DEFS = ("$defs", "definitions")
_SEPARATORS = {"hermes": "\n", "llama3_json": "; "}     # between two calls
_EMPTY = {"type": "object", "properties": {}, "additionalProperties": False}   # a function without parameters


def tool_call_constraint(parser, req: ToolRequest, mode: str, tokenizer) -> Constraint:
    """The grammar constraint of a forced choice; ValueError ("tools: ...") for $defs that clash."""
    args = "%json " + json.dumps(call_schema(parser.args_key, req.functions(), mode), ensure_ascii=False)
    call = "args"
    if parser.name == "hermes":
        call = f"{json.dumps(parser.open + chr(10))} args {json.dumps(chr(10) + parser.close)}"
    many = req.parallel and req.choice == "required"
    if parser.name == "mistral":
        start = f'{_literal(parser.marker, tokenizer)} " [" ' + ('call (", " call)*' if many else "call") + ' "]"'
    else:
        start = f"call ({json.dumps(_SEPARATORS[parser.name])} call)*" if many else "call"
    lark = f"start: {start}\ncall: {call}\nargs: {args}\n"
    return Constraint("grammar", lark)


def call_schema(args_key: str, functions: list[dict], mode: str) -> dict:
    """One call's JSON schema: an object naming one of `functions` and its arguments."""
    defs: dict[str, dict] = {}
    options = []
    for fn in functions:
        params = dict(fn.get("parameters") or _EMPTY)
        for key in _DEFS:
            for name, sub in (params.pop(key, None) or {}).items():
                if defs.setdefault(key, {}).setdefault(name, sub) != sub:
                    raise ValueError(f"tools: two functions define {key} {name!r} differently; rename one")
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
                        "required": ["name", args_key], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    style = {**JSON_STYLE, **(LENIENT if mode == "validate" else {})}
    return {**schema, **defs, "x-guidance": style}


def _literal(text: str, tokenizer) -> str:
    """A Lark item matching `text`: the token itself where it is one special token (decoding drops it)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and not tokenizer.decode(ids, skip_special_tokens=True):
        return f"<[{ids[0]}]>"
    return json.dumps(text)
