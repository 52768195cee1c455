"""--tools FILE_OR_JSON, --tool-choice and --tool-call-parser (a dataset's rows offered functions, as an OpenAI
line's own `tools` are): the file read and checked into the job's jobs.tools.ToolRequest.

    job_tools(kind)        # a GenerateKind's ToolRequest or None; JobConfigError naming the option
"""
from __future__ import annotations

import json

from jobrunner.config.option_values import JobConfigError
from jobrunner.jobs.tools import ToolRequest, tool_request


def job_tools(kind) -> ToolRequest | None:
    if not kind.tools:
        return None
    text = kind.tools if kind.tools.lstrip().startswith(("[", "{")) else _read(kind.tools)
    try:
        tools = json.loads(text)
    except ValueError as e:
        raise JobConfigError(f"--tools: not valid JSON ({e}); give a list of function tools, or a file of one") from None
    try:
        return tool_request(tools, kind.tool_choice or "auto")
    except ValueError as e:
        raise JobConfigError(f"--tools: {e}".replace("--tools: tool_choice", "--tool-choice")) from None


def check_job_tools(kind, chat: bool | None) -> None:
    """The tools' file and choice (of the job's kind section), and a forced choice beside a constraint or
    tools with --no-chat (`chat`: the prompt's --chat): JobConfigError before any work."""
    if kind.name != "generate" or job_tools(kind) is None:
        return
    if chat is False:
        raise JobConfigError("--tools are offered through the chat template: they need --chat, not --no-chat")
    if kind.tool_choice not in (None, "none", "auto") and (kind.json_schema or kind.json or kind.regex
                                                            or kind.choice or kind.grammar):
        raise JobConfigError(f"--tool-choice {kind.tool_choice} makes every reply tool calls: it contradicts "
                             "a structured-output option; drop one")


def _read(url: str) -> str:
    from jobrunner.common import storage       # fsspec: only for a --tools file
    try:
        fs, path = storage.url_fs(url)
        with fs.open(path, "rb") as f:
            return f.read().decode("utf-8")
    except (OSError, ValueError, ImportError) as e:
        raise JobConfigError(f"--tools {url!r}: not JSON text and cannot read it as a file: {e}") from None
