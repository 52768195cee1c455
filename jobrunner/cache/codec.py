"""A RequestOutput as the bytes a cache entry stores, and back (JSON: floats round-trip exactly).

The row id is not stored: a cached result is handed to whichever row asks for it.
"""
from __future__ import annotations

import json
from dataclasses import asdict

from jobrunner.engine import Completion, RequestOutput, TokenLogprob


def encode_output(out: RequestOutput) -> bytes:
    d = asdict(out)
    del d["id"]
    return json.dumps(d, separators=(",", ":")).encode()


def decode_output(data: bytes, row_id: str) -> RequestOutput:
    """Raises ValueError (or TypeError, KeyError) on anything but encode_output's bytes."""
    d = json.loads(data)
    d["completions"] = [_completion(c) for c in d["completions"]]
    return RequestOutput(id=row_id, **d)


def _completion(c: dict) -> Completion:
    if c.get("logprobs") is not None:
        c["logprobs"] = [TokenLogprob(t["token_id"], t["logprob"], [tuple(x) for x in t["top"]])
                         for t in c["logprobs"]]
    return Completion(**c)
