"""An OpenAI batch file checked as a whole before any work, as OpenAI validates a batch: every line
a JSON object with a string custom_id, and no custom_id twice (vLLM's run-batch answers duplicates;
we follow OpenAI and refuse the file, so that every input line has exactly one output line).

    problems = file_problems(url)          # ["line 3: custom_id 'a' repeats line 1's", ...]
    check_openai_batch(cfg.input)          # JobConfigError (exit 2) naming the lines, else None

A line whose body cannot run (an unsupported endpoint, a parameter we don't honour) is not a
problem of the file: it becomes that line's error line (jobrunner.openai.batch).
"""
from __future__ import annotations

import json
import posixpath

from jobrunner.config.job import JobConfigError
from jobrunner.config.sections import InputOptions
from jobrunner.dataset.files import LongLine, decode, list_files, lines
from jobrunner.dataset.rows import where

SHOWN = 20          # problems named in the message; the rest are counted


def file_problems(url: str, limit: int | None = None) -> list[str]:
    """Each line (of the first `limit` non-blank ones) that fails the file: not JSON, not an object,
    no string custom_id, or a custom_id an earlier line has."""
    files = list_files(url)
    seen: dict[str, str] = {}          # custom_id -> where its first line is
    problems: list[str] = []
    n = 0
    for path in files:
        name = posixpath.basename(path) if len(files) > 1 else None
        for lineno, raw in enumerate(lines(path), start=1):
            if limit is not None and n >= limit:
                return problems
            if isinstance(raw, LongLine):   # too long to look at: read_jsonl makes it an error row
                n += 1
                continue
            text, _ = decode(raw)
            if text is None:
                text = raw.decode("utf-8", errors="replace")
            if not text.strip():
                continue
            n += 1
            at = where(name, lineno)
            try:
                rec = json.loads(text)
            except (ValueError, RecursionError):
                problems.append(f"{at}: not valid JSON")
                continue
            cid = rec.get("custom_id") if isinstance(rec, dict) else None
            if not isinstance(rec, dict):
                problems.append(f"{at}: not a JSON object")
            elif not isinstance(cid, str) or not cid:
                got = "missing" if cid is None else f"{type(cid).__name__} {cid!r}"
                problems.append(f"{at}: custom_id must be a non-empty string ({got})")
            elif cid in seen:
                problems.append(f"{at}: custom_id {cid!r} repeats {seen[cid]}'s")
            else:
                seen[cid] = at
    return problems


def check_openai_batch(input: InputOptions) -> None:
    """JobConfigError naming the lines when the file fails as a whole (see file_problems)."""
    problems = file_problems(input.dataset, input.limit)
    if not problems:
        return
    shown = "; ".join(problems[:SHOWN]) + (f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else "")
    raise JobConfigError(f"{input.dataset}: {len(problems)} line{'s' if len(problems) != 1 else ''} of this OpenAI "
                         f"batch file cannot be answered: {shown}. Every line needs a unique string custom_id "
                         "(OpenAI rejects such a file at validation too); fix the lines and run again")
