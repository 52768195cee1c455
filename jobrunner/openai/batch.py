"""The OpenAI Batch format: reading its input records and writing its output lines.

Input: a JSONL file, one request a line:

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_tokens": 5, ...}}

parse_record turns one into a row's data {"messages", "params", "model"} (plus "prompt" for
/v1/completions); params are the body's other keys as our sampling options
(jobrunner.openai.request: a key that would change the output and isn't supported fails the row).  The dataset reader
(jobrunner.dataset) reads the lines, and turns custom_id into the row's id.

Output: results.openai.jsonl in the output directory, one line per custom_id that ran:

    {"id": "batch_req_...", "custom_id": "req-1", "error": null,
     "response": {"status_code": 200, "request_id": "req_...", "body": <a chat.completion>}}

(a text_completion for /v1/completions rows, a CreateEmbeddingResponse for /v1/embeddings rows, a Response
for /v1/responses rows, vLLM's score and rerank responses for its /score and /rerank rows:
jobrunner.openai.response, embeddings, responses and scores build the bodies), and errors.openai.jsonl beside
it, one line per custom_id whose every sample failed, as OpenAI writes its error file:

    {"id": "batch_req_...", "custom_id": "req-2", "response": null,
     "error": {"code": "invalid_request", "message": "...", "param": "tools", "line": 2}}

Every input line has exactly one line in one of the two (the file check, jobrunner.job.openai_check,
refuses a file whose custom_ids are not unique strings). The samples of one custom_id become the
choices of one line. The ids are hashes of the custom_id and the job's random salt (the manifest's
run_salt): unique per job and request, the same when the job resumes. A body's `model` is the line's own
name for the job's model; under --any-model a line naming another model gets the job's model's name, and
its own in `requested_model`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from jobrunner.models import hub
from jobrunner.common import storage
from jobrunner.models.known import KNOWN_MODELS
from jobrunner.openai import embeddings as openai_embeddings, errors as openai_errors
from jobrunner.openai import responses as openai_responses, scores as openai_scores
from jobrunner.openai.request import parse_chat_body
from jobrunner.openai.response import response_body
from jobrunner.output import iter_result_parts, read_manifest, write_stats
from jobrunner.output.values import norm_row, to_json

__all__ = ["FORMAT", "ENDPOINTS", "COLUMNS", "OPENAI_ERRORS", "OPENAI_OUTPUT", "finish_openai_output",
           "is_openai_record", "parse_record", "write_openai_batch_output"]

FORMAT = "openai-batch"                                     # the dataset format's name
# the request urls we serve
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", openai_embeddings.ENDPOINT, openai_responses.ENDPOINT,
             *openai_scores.ENDPOINTS)
COLUMNS = ("messages", "params", "model")                   # the columns of a parsed record
OPENAI_OUTPUT = "results.openai.jsonl"                      # the output file's name
OPENAI_ERRORS = "errors.openai.jsonl"                       # the error file's, beside it


# ---------------------------------------------------------------- input


def is_openai_record(rec: Any) -> bool:
    """Whether a parsed JSON line looks like an OpenAI batch request (used to sniff the format): by its
    shape, a body with a url, method or custom_id, so that a line lacking custom_id is still read as
    one (and refused for it: jobrunner.job.openai_check)."""
    return isinstance(rec, dict) and isinstance(rec.get("body"), dict) and (
        "custom_id" in rec or isinstance(rec.get("url"), str) or rec.get("method") == "POST")


def parse_record(rec: Any) -> tuple[Any, dict | None, str | None]:
    """(custom_id as given or None, data, error) for one OpenAI batch input record.

    data is None exactly when error is set.  The caller turns custom_id into a str id.
    """
    if not isinstance(rec, dict):
        return None, None, f"expected a JSON object, got {type(rec).__name__}"
    cid = rec.get("custom_id")
    body = rec.get("body")
    if cid is None:
        return None, None, "OpenAI batch record without custom_id"
    if not isinstance(body, dict):
        return cid, None, "OpenAI batch record without a body object"
    url = rec.get("url")
    if url is not None and url not in ENDPOINTS:
        return cid, None, f"unsupported endpoint {url!r} (supported: {', '.join(ENDPOINTS)})"
    data, error = _parse_body(url, body)
    return cid, data, error


def _parse_body(url: str | None, body: dict) -> tuple[dict | None, str | None]:
    """A body's row data by its endpoint (no url: chat or completions, by the body's own keys)."""
    if url == openai_embeddings.ENDPOINT:
        return openai_embeddings.parse_embeddings_body(body)
    if url == openai_responses.ENDPOINT:
        return openai_responses.parse_responses_body(body)
    if url in openai_scores.ENDPOINTS:
        return openai_scores.parse_score_body(url, body)
    return parse_chat_body(body)


# ---------------------------------------------------------------- output


def _ids(salt: str, cid: str) -> dict[str, str]:
    """A line's ids (batch_req_, req_, and the body's), unique per job and request: a hash of the job's
    random salt (its manifest's run_salt, kept on resume) and the custom_id (unique in the file)."""
    def h(what: str) -> str:
        key = f"{salt}\0{what}\0{cid}".encode("utf-8", errors="surrogatepass")
        return hashlib.sha256(key).hexdigest()[:24]
    return {"line": f"batch_req_{h('line')}", "request": f"req_{h('request')}", "body": h("body")}


@dataclass(frozen=True)
class _Job:
    """What the output lines say of the job: its model's name (the first --served-model-name, else
    --model), every name a line may give it, whether any name was served (--any-model), and whether
    --reasoning-parser was on (then `reasoning` is written, null when there was none)."""
    model: str
    names: frozenset[str]
    any_model: bool = False
    reasoning: bool = False
    created: int = 0
    salt: str = ""

    def model_for(self, asked: str | None) -> tuple[str, dict]:
        """(the response's `model`, the body's extra keys): a line's own name where it names the job's
        model (an alias, a LoRA adapter); under --any-model, another name is kept as `requested_model`
        and `model` says what ran."""
        if asked is None or not self.any_model or asked in self.names:
            return asked or self.model, {}
        return self.model, {"requested_model": asked}


def _job(manifest: dict, model: str | None) -> _Job:
    cfg = manifest.get("config") or {}
    given = cfg.get("model") or manifest.get("model")
    served = list(cfg.get("served_model_name") or [])
    names = {given, *served, *((cfg.get("lora") or {}).get("adapters") or {})}
    if given in KNOWN_MODELS:
        names.add(KNOWN_MODELS[given].hub_name)
    if isinstance(given, str) and hub.is_hub_name(given):
        names.add(hub.parse(given)[0])
    # outputs begun before run_salt existed: their creation time and fingerprint, as stable on resume
    salt = str(manifest.get("run_salt") or f"{manifest.get('created_at')}{manifest.get('fingerprint')}")
    return _Job(str(model or (served or [None])[0] or given or "jobrunner"), frozenset(n for n in names if n),
                bool(cfg.get("any_model")), bool(cfg.get("reasoning_parser")), int(time.time()), salt)


def _openai_record(rows: list[dict[str, Any]], job: _Job) -> tuple[dict, bool]:
    """(one OpenAI batch output line for all result rows (samples) of one custom_id, whether it is an
    error line)."""
    cid = rows[0]["id"]
    ids = _ids(job.salt, cid)
    errors = [r.get("error") for r in rows if r.get("error")]
    if errors and len(errors) == len(rows):
        error = openai_errors.error_object(str(errors[0]), rows[0].get("line"), rows[0].get("endpoint"))
        return {"id": ids["line"], "custom_id": cid, "response": None, "error": error}, True
    ok = [r for r in rows if not r.get("error")]
    model, extra = job.model_for(ok[0].get("model"))
    if openai_embeddings.is_embeddings_rows(ok):
        body = openai_embeddings.embeddings_body(ok, model)
    elif openai_responses.is_responses_rows(ok):
        body = openai_responses.response_object(ok, model, job.created, ids["body"])
    elif openai_scores.is_pairs_rows(ok):
        body = openai_scores.pairs_body(ok, model, job.created, ids["body"])
    else:
        body = response_body(ok, model, job.created, ids["body"], job.reasoning)
    return {"id": ids["line"], "custom_id": cid, "error": None,
            "response": {"status_code": 200, "request_id": ids["request"], "body": {**body, **extra}}}, False


def _output_lines(rows: Iterable[Mapping[str, Any]], job: _Job) -> Iterator[tuple[str, bool]]:
    """(JSON text, is an error line) of each output line; consecutive rows with the same id form one line."""
    group: list[dict[str, Any]] = []
    for r in rows:
        r = norm_row(r)
        if group and group[0]["id"] != r["id"]:
            record, failed = _openai_record(group, job)
            yield to_json(record), failed
            group = []
        group.append(r)
    if group:
        record, failed = _openai_record(group, job)
        yield to_json(record), failed


def write_openai_batch_output(output_url: str, rows: Iterable[Mapping[str, Any]] | None = None,
                              model: str | None = None, name: str = OPENAI_OUTPUT,
                              errors_name: str = OPENAI_ERRORS) -> dict[str, int]:
    """Write results in the OpenAI Batch output format: each custom_id's line in `name`
    (results.openai.jsonl) or, when every sample of it failed, in `errors_name` (errors.openai.jsonl),
    as OpenAI writes an output and an error file; never in both. Returns {file name: lines}.

    rows: result rows; None reads all parts.  Consecutive rows with the same id
    (samples) become one line with several choices.  Each file appears complete or not at all
    (storage.atomic_write_with); lines are streamed into the temporary files, so the output never
    sits in memory at once.
    """
    fs, root = storage.url_fs(output_url)
    job = _job(read_manifest(output_url) or {}, model)
    if rows is None:
        rows = (r for t in iter_result_parts(output_url) for r in t.to_pylist())
    counts = {name: 0, errors_name: 0}

    def write(results, errors):
        for text, failed in _output_lines(rows, job):
            storage.write_lines(errors if failed else results, [text])
            counts[errors_name if failed else name] += 1

    storage.atomic_write_with(fs, storage.join(root, errors_name), lambda errors: storage.atomic_write_with(
        fs, storage.join(root, name), lambda results: write(results, errors)))
    return counts


def finish_openai_output(output_url: str, summary: dict) -> None:
    """The OpenAI output files of a finished job, and their line counts in its summary (`openai_output`,
    rewritten into _stats.json)."""
    summary["openai_output"] = write_openai_batch_output(output_url)
    write_stats(output_url, summary)
