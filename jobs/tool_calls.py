"""A generate job's tool calling: the row's tools (its own, else the job's), the parser that reads the
model's calls (--tool-call-parser, else the one the chat template's format fits: jobs/tool_parsers.py),
the grammar of a forced choice (jobs/tool_grammar.py) and the calls parsed from a reply.

    calls = ToolCalls(spec, tokenizer)
    req = calls.request(options)                       # ToolRequest or None
    constraint = calls.constraint(req, schema_mode)    # required / a named function: the grammar; else None
    content, found = calls.parse(req, text)            # found: [{"name", "arguments"}, ...]
"""
from __future__ import annotations

from jobrunner.engine import Constraint
from jobrunner.jobs.base import RowError
from jobrunner.jobs.row import RowOptions
from jobrunner.jobs.spec import JobSpec
from jobrunner.jobs.tool_grammar import tool_call_constraint
from jobrunner.jobs.tool_parsers import TOOL_PARSERS, parser_for_template
from jobrunner.jobs.tools import ToolRequest


class ToolCalls:
    def __init__(self, spec: JobSpec, tokenizer):
        self.default = spec.tools
        self.tokenizer = tokenizer
        self.parser_name = spec.tool_call_parser or parser_for_template(getattr(tokenizer, "chat_template", None))

    def request(self, options: RowOptions) -> ToolRequest | None:
        return options.tools if options.tools is not None else self.default

    def parser(self):
        if self.parser_name is None:
            raise RowError("tools: this model's chat template writes tool calls in no format jobrunner "
                           f"recognises; pass --tool-call-parser {'|'.join(TOOL_PARSERS)}")
        return TOOL_PARSERS[self.parser_name]

    def constraint(self, req: ToolRequest | None, mode: str) -> Constraint | None:
        if req is None or not req.forced:
            return None
        try:
            return tool_call_constraint(self.parser(), req, mode, self.tokenizer)
        except ValueError as e:
            raise RowError(str(e)) from None

    def parse(self, req: ToolRequest, text: str | None) -> tuple[str | None, list[dict]]:
        """(content, calls) of a reply; a choice that allows one call (a named function, or
        parallel_tool_calls false) keeps the first. A forced choice's reply is calls by its grammar: no
        content, whatever a cut (max_tokens) left of its last call."""
        if text is None:
            return None, []
        content, calls = self.parser().parse(text)
        if req.forced:
            content = None
        if calls and (req.choice == "function" or not req.parallel):
            calls = calls[:1]
        return content, calls
