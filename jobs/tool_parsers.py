"""Tool calls as model families write them, parsed out of a reply, and the wrapper each family puts
around a call (jobs/tool_grammar.py writes the same to enforce a call).

    hermes        Hermes, Qwen2.5, Qwen3:  <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    llama3_json   Llama 3.1 / 3.2 / 3.3:   {"name": "f", "parameters": {...}}   (several: joined by "; ")
    mistral       Mistral:                 [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]

    parser = TOOL_PARSERS["hermes"]
    content, calls = parser.parse(text)     # calls: [{"name": "f", "arguments": "<JSON text>"}, ...]

A reply that holds no call of the family's shape (or one whose JSON does not parse) is all content,
as vLLM's parsers answer; a reply cut inside its last call (max_tokens) keeps the calls before it, even
where the cut call's strings hold the closing tag (calls are read as JSON, not split at the tag), and a
cut call is never content: a Hermes reply cut in its first call has only the text before it.
`parser_for_template` names the parser a chat template's own tool-call
format fits, or None.
"""
from __future__ import annotations

import json

_DECODER = json.JSONDecoder()


def _call(obj, args_keys=("arguments", "parameters")) -> dict | None:
    """{"name", "arguments" (JSON text)} of one parsed call object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):           # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def _json_values(text: str, sep: str, end: str = "") -> tuple[list, str | None]:
    """(the JSON values at the start of `text`, `sep` and blanks between them, up to `end` or the text's end;
    None when that is all of it, else the rest from where they stopped)."""
    values, i = [], 0
    while True:
        i = len(text) - len(text[i:].lstrip())
        if end and text.startswith(end, i):
            return values, None if not text[i + len(end):].strip() else text[i:]
        if i == len(text):
            return values, None if not end else ""
        if values:
            if not text.startswith(sep, i):
                return values, text[i:]
            i += len(sep)
            i = len(text) - len(text[i:].lstrip())
        try:
            value, i = _DECODER.raw_decode(text, i)
        except ValueError:
            return values, text[i:]
        values.append(value)


def _calls_of(values: list, rest: str | None) -> list[dict] | None:
    """The calls of parsed values; None unless every value is a call and nothing follows them, or only a
    last call cut short (max_tokens: the ones before it stand)."""
    calls = [_call(v) for v in values]
    cut = rest is not None and _cut_json(rest.lstrip())
    if not calls or None in calls or rest is not None and not cut:
        return None
    return calls


class HermesParser:
    name = "hermes"
    open, close = "<tool_call>", "</tool_call>"
    args_key = "arguments"

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        head, found, rest = text.partition(self.open)
        if not found:
            return text, []
        calls = []
        while rest is not None:                 # rest: the text after an opening tag
            body = rest.lstrip()
            try:
                value, end = _DECODER.raw_decode(body)
            except ValueError:
                if _cut_json(body):             # a last call cut short (max_tokens): the ones before it stand
                    break
                return text, []
            call, after = _call(value), body[end:].lstrip()
            # its closing tag, or the start of it where the reply was cut
            if call is None or not (after.startswith(self.close) or self.close.startswith(after)):
                return text, []
            calls.append(call)
            at = after.find(self.open)
            rest = after[at + len(self.open):] if at >= 0 else None
        return head.strip() or None, calls


class Llama3JsonParser:
    name = "llama3_json"
    marker = "<|python_tag|>"           # a special token: absent from decoded text, stripped when present
    args_key = "parameters"

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        body = text.strip().removeprefix(self.marker).lstrip()
        if not body.startswith("{"):
            return text, []
        calls = _calls_of(*_json_values(body, ";"))
        return (None, calls) if calls else (text, [])


class MistralParser:
    name = "mistral"
    marker = "[TOOL_CALLS]"             # a special token in Mistral's tokenizers (then absent from decoded text)
    args_key = "arguments"

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        head, found, body = text.partition(self.marker)
        if not found:                   # the marker decoded away: the reply starts with the call list
            head, body = "", text
            if not body.lstrip().startswith("[{"):
                return text, []
        list_start = body.lstrip()
        if not list_start.startswith("["):
            return text, []
        calls = _calls_of(*_json_values(list_start[1:], ",", end="]"))
        return (head.strip() or None, calls) if calls else (text, [])


def _cut_json(text: str) -> bool:
    """Whether `text` is a JSON object cut short (max_tokens): nothing of it yet, or braces and brackets
    still open at its end, counted outside strings (a string may hold any tag or brace)."""
    if not text:
        return True
    if not text.startswith("{"):
        return False
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:              # the value closed, yet did not parse: not a cut one
                return False
    return True


TOOL_PARSERS = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser())}


def parser_for_template(template: str | None) -> str | None:
    """The parser whose format a chat template writes its tool calls in, or None when none fits."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if '"parameters": ' in template and "<|start_header_id|>" in template:
        return "llama3_json"
    return None
