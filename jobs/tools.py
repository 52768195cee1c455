"""Tool calling: the functions a row offers the model, and how it may call them.

    req = tool_request(tools, choice="required")      # ValueError saying what is wrong
    req.functions()                                   # the functions a call may name under the choice

`tools` are function definitions in the shape chat templates take them (transformers' `tools=`, OpenAI's
chat format): {"type": "function", "function": {"name", "description", "parameters": a JSON schema}};
a flat {"type": "function", "name", ...} (OpenAI's Responses format) is turned into that shape.
The choice: none (offered, never parsed), auto (the model decides; its calls parsed from the output),
required (at least one call), or one function by name (a call of it): the last two are enforced by a
grammar (jobs/tool_grammar.py), so every call's arguments validate against its function's schema.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

TOOL_CHOICES = ("none", "auto", "required")      # or a function's name
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")     # OpenAI's rule for a function's name


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict, ...]         # as the chat template takes them
    choice: str = "auto"            # none | auto | required | function (then `name`)
    name: str | None = None         # the function a "function" choice names
    parallel: bool = True           # parallel_tool_calls: more than one call in a reply

    @property
    def forced(self) -> bool:
        """Whether the reply must be tool calls (required, or a named function): a grammar enforces it."""
        return self.choice in ("required", "function")

    @property
    def parsed(self) -> bool:
        """Whether the reply's tool calls are parsed out of it (every choice but none)."""
        return self.choice != "none"

    def functions(self) -> list[dict]:
        """The function definitions ({"name", "parameters", ...}) a call may name under this choice."""
        fns = [t["function"] for t in self.tools]
        return [f for f in fns if f["name"] == self.name] if self.choice == "function" else fns


def tool_request(tools, choice: str | None = "auto", parallel: bool = True) -> ToolRequest:
    """A checked ToolRequest; ValueError ("tools: ..." or "tool_choice ...") for what cannot run.
    choice: none, auto, required, or a function's name."""
    tools = tuple(normalize_tool(t) for t in _tool_list(tools))
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tools: function names must be unique ({', '.join(sorted(names))})")
    for t in tools:
        _check_parameters(t["function"])
    choice = choice or "auto"
    if not isinstance(parallel, bool):
        raise ValueError("parallel_tool_calls must be true or false")
    if choice in TOOL_CHOICES:
        return ToolRequest(tools, choice, None, parallel)
    if choice not in names:
        raise ValueError(f"tool_choice {choice!r} names no function of tools ({', '.join(names)}); "
                         f"give one of them, or {', '.join(TOOL_CHOICES)}")
    return ToolRequest(tools, "function", choice, parallel)


def normalize_tool(tool) -> dict:
    """A tool in the chat templates' shape; ValueError for one that is not a function tool."""
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise ValueError(f"tools: only function tools are supported, not {kind!r}")
    fn = tool.get("function")
    if fn is None and "name" in tool:           # the Responses API's flat form
        fn = {k: v for k, v in tool.items() if k != "type"}
        tool = {"type": "function", "function": fn}
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
        raise ValueError("tools: every function needs a name of letters, digits, _ . or - (at most 64)")
    return tool if "type" in tool else {"type": "function", **tool}


def _tool_list(tools) -> list:
    if not isinstance(tools, (list, tuple)) or not tools:
        raise ValueError("tools must be a non-empty list of function tools")
    return list(tools)


def _check_parameters(fn: dict) -> None:
    params = fn.get("parameters")
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError(f"tools: function {fn['name']!r}: parameters must be a JSON schema object")
    import jsonschema           # pure Python, a dependency (jobs/schema_check.py)
    cls = jsonschema.validators.validator_for(params, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(params)
    except jsonschema.SchemaError as e:
        raise ValueError(f"tools: function {fn['name']!r}: parameters is not a valid JSON schema "
                         f"({e.message})") from None
