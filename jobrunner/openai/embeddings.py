"""OpenAI Batch /v1/embeddings lines: the request body in, the CreateEmbeddingResponse body out
(jobrunner.openai.batch dispatches here by url and by the rows' `embedding` column).

    in   {"custom_id": "doc-1", "method": "POST", "url": "/v1/embeddings",
          "body": {"model": "...", "input": "text" | ["text", ...], "dimensions": 256,
                   "encoding_format": "float" | "base64"}}
    out  "body": {"object": "list", "model": "...",
                  "data": [{"object": "embedding", "index": 0, "embedding": [0.1, ...] | "<base64>"}],
                  "usage": {"prompt_tokens": 12, "total_tokens": 12}}

base64 is the vector's little-endian float32 bytes, as OpenAI sends it (its client decodes it so).
A body that cannot run (no input, an empty text, token-id input, a bad dimensions or
encoding_format) becomes the row's error and an error line; the job goes on.
"""
from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np

__all__ = ["ENDPOINT", "ENCODING_FORMATS", "parse_embeddings_body", "embeddings_body", "is_embeddings_rows"]

ENDPOINT = "/v1/embeddings"         # the url that the embed kind serves (jobrunner.openai.rows routes it)
ENCODING_FORMATS = ("float", "base64")
_BODY_KEYS = ("input", "model", "dimensions", "encoding_format", "user")


def parse_embeddings_body(body: dict) -> tuple[dict | None, str | None]:
    """(row data, None) or (None, what is wrong) for one /v1/embeddings request body. The data's
    `prompt` is the first text (the planner and the prompt builder read it), `input` all of them."""
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts:
        return None, "input must be a string or a non-empty list of strings"
    if not all(isinstance(t, str) for t in texts):
        return None, "input must hold strings (token-id inputs are not supported: send the text)"
    if not all(t.strip() for t in texts):
        return None, "input holds an empty string"
    dims = body.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        return None, f"dimensions must be a positive integer, not {dims!r}"
    fmt = body.get("encoding_format", "float")
    if fmt not in ENCODING_FORMATS:
        return None, f"encoding_format must be float or base64, not {fmt!r}"
    unknown = sorted(set(body) - set(_BODY_KEYS))
    if unknown:
        return None, f"unsupported body keys for {ENDPOINT}: {', '.join(unknown)}"
    params = {"dimensions": dims, "encoding_format": fmt}
    data = {"input": body["input"], "prompt": texts[0], "params": params, "model": body.get("model"),
            "endpoint": ENDPOINT}
    return data, None


def is_embeddings_rows(rows: list[dict[str, Any]]) -> bool:
    """Whether one custom_id's result rows answer a /v1/embeddings line."""
    return any(_vector(r) is not None for r in rows)


def embeddings_body(rows: list[dict[str, Any]], model: str) -> dict:
    """The CreateEmbeddingResponse of one custom_id's successful rows (one per input text)."""
    fmt = _params(rows[0]).get("encoding_format") or "float"
    data = []
    for i, r in enumerate(sorted(rows, key=lambda r: r.get("input_index") or 0)):
        vector = _vector(r)
        if fmt == "base64":
            vector = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
        else:
            vector = [float(x) for x in vector]
        data.append({"object": "embedding", "index": i, "embedding": vector})
    tokens = sum(int(r.get("prompt_tokens") or 0) for r in rows)
    return {"object": "list", "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _vector(row: dict) -> list[float] | None:
    """The row's embedding: its column, or extra_json where a vector of another size than the column's
    went (a line's own `dimensions`: jobrunner.output.values)."""
    if row.get("embedding") is not None:
        return row["embedding"]
    extra = row.get("extra_json")
    if isinstance(extra, str) and '"embedding"' in extra:
        try:
            return json.loads(extra).get("embedding")
        except (ValueError, AttributeError):
            return None
    return None


def _params(row: dict) -> dict:
    """The row's stored body parameters: a dict, or its JSON text as the parts keep it."""
    p = row.get("params")
    if isinstance(p, str):
        try:
            p = json.loads(p)
        except ValueError:
            return {}
    return p if isinstance(p, dict) else {}
