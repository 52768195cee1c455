"""Batch files as OpenAI Batch and vLLM run-batch users write them (tests/openai_fixtures.py names
their sources), run through jobrunner on a tiny random model and checked line by line with the
official `openai` types: exactly one output or error line per input line, ids unique, each body in
its endpoint's shape, errors with their line and param."""
import json
import os

import pytest
from click.testing import CliRunner
from openai.types import BatchError, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion

from jobrunner.cli.main import main
from jobrunner.config.job import job_config, JobConfigError
from jobrunner.pipeline.exit_codes import EXIT_OK
from jobrunner.pipeline.build import open_job
from tests import openai_fixtures as fx
from tests.test_openai_batch import engine, model_dir  # noqa: F401 (fixtures: one tiny llama engine a module)




def _write(tmp_path, lines, name="batch.jsonl"):
    ds = tmp_path / name
    ds.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return ds


def _job(engine, ds, out, **kw):
    job = open_job(job_config(str(ds), output=str(out), output_format="openai-batch", **kw), engine=engine)
    return job


def _run(engine, tmp_path, lines, out="out", **kw):
    """(output lines by custom_id, error lines by custom_id, the job's result), each input line in
    exactly one of the two files."""
    res = _job(engine, _write(tmp_path, lines), tmp_path / out, **kw).run()
    assert res.exit_code == EXIT_OK
    ok = [json.loads(x) for x in open(os.path.join(res.output, "results.openai.jsonl"))]
    failed = [json.loads(x) for x in open(os.path.join(res.output, "errors.openai.jsonl"))]
    assert sorted(x["custom_id"] for x in ok + failed) == sorted(x["custom_id"] for x in lines)
    ids = [x["id"] for x in ok + failed] + [x["response"]["request_id"] for x in ok]
    ids += [x["response"]["body"]["id"] for x in ok if "id" in x["response"]["body"]]
    assert len(set(ids)) == len(ids)
    assert res.stats["openai_output"] == {"results.openai.jsonl": len(ok), "errors.openai.jsonl": len(failed)}
    for x in failed:
        assert x["response"] is None and BatchError.model_validate(x["error"]).line is not None
    return {x["custom_id"]: x for x in ok}, {x["custom_id"]: x for x in failed}, res


def test_vllm_run_batch_input(engine, tmp_path):
    ok, failed, _ = _run(engine, tmp_path, fx.VLLM_INPUT_BATCH, served_model_name=(fx.CHAT_MODEL_NAME,))
    assert set(ok) == {"request-1", "request-2"}
    for x in ok.values():
        body = ChatCompletion.model_validate(x["response"]["body"])
        assert body.object == "chat.completion" and body.model == fx.CHAT_MODEL_NAME
        assert body.choices[0].message.content is not None and body.id.startswith("chatcmpl-")
    errors = {cid: BatchError.model_validate(x["error"]) for cid, x in failed.items()}
    assert (errors["request-3"].code, errors["request-3"].param, errors["request-3"].line) == ("model_not_found", "model", 3)
    assert "NonExistModel" in errors["request-3"].message
    assert (errors["request-4"].param, errors["request-4"].line) == ("url", 4) and "/bad_url" in errors["request-4"].message
    assert (errors["request-5"].param, errors["request-5"].line) == ("stream", 5)


def test_a_line_without_custom_id_stops_the_job_naming_it(engine, tmp_path):
    ds = _write(tmp_path, fx.VLLM_INVALID_INPUT_BATCH)       # auto-detected: the line's url, method and body
    with pytest.raises(JobConfigError, match=r"line 1: custom_id must be a non-empty string \(missing\)"):
        _job(engine, ds, tmp_path / "out")
    assert not (tmp_path / "out").exists()          # before any work
    r = CliRunner().invoke(main, ["validate", str(ds), "-m", "dummy:llama"])
    assert r.exit_code == 2 and "line 1" in r.output and "custom_id" in r.output


def test_a_duplicate_custom_id_stops_the_job_naming_both_lines(engine, tmp_path):
    ds = _write(tmp_path, fx.VLLM_INPUT_RERANK_BATCH)
    with pytest.raises(JobConfigError, match=r"line 3: custom_id 'request-2' repeats line 2's"):
        _job(engine, ds, tmp_path / "out")
    with pytest.raises(JobConfigError, match=r"line 4: not valid JSON.*line 5: custom_id must .*\(int 7\)"):
        ds.write_text("\n".join([json.dumps(x) for x in fx.VLLM_INPUT_BATCH[:3]] + ["{oops", json.dumps(
            {**fx.VLLM_INPUT_BATCH[3], "custom_id": 7})]))
        _job(engine, ds, tmp_path / "out")


def test_one_file_mixing_embeddings_and_chat_runs_each_line_as_its_url_says(engine, tmp_path):
    chat = [{**x, "custom_id": f"chat-{x['custom_id']}"} for x in fx.VLLM_INPUT_BATCH[:3]]
    lines = fx.VLLM_INPUT_EMBEDDING_BATCH + chat
    ok, failed, res = _run(engine, tmp_path, lines, served_model_name=(fx.CHAT_MODEL_NAME, fx.EMBEDDING_MODEL_NAME))
    assert set(failed) == {"request-4", "chat-request-3"}           # NonExistModel, both endpoints
    assert {x["error"]["code"] for x in failed.values()} == {"model_not_found"}
    for cid in ("request-1", "request-2", "request-3"):
        body = CreateEmbeddingResponse.model_validate(ok[cid]["response"]["body"])
        assert body.model == fx.EMBEDDING_MODEL_NAME and len(body.data[0].embedding) == engine.rt.model_config.hidden_size
    for cid in ("chat-request-1", "chat-request-2"):
        assert ChatCompletion.model_validate(ok[cid]["response"]["body"]).choices[0].message.role == "assistant"
    assert res.stats["rows_failed"] == 2


def test_ids_are_unique_per_job_and_stable_across_a_resume(engine, tmp_path):
    lines = fx.VLLM_INPUT_BATCH[:2]
    kw = dict(served_model_name=(fx.CHAT_MODEL_NAME,), max_tokens=4)
    lines = [{**x, "body": {**x["body"], "max_tokens": 3}} for x in lines]
    first, _, _ = _run(engine, tmp_path, lines, out="a", **kw)
    other, _, _ = _run(engine, tmp_path, lines, out="b", **kw)
    again, _, _ = _run(engine, tmp_path, lines, out="a", **kw)        # the same job again: resumed, nothing to do
    for cid in first:
        assert first[cid]["id"] != other[cid]["id"]
        assert first[cid]["response"]["request_id"] != other[cid]["response"]["request_id"]
        assert first[cid]["response"]["body"]["id"] != other[cid]["response"]["body"]["id"]
        assert first[cid]["id"] == again[cid]["id"]
        assert first[cid]["response"]["body"]["id"] == again[cid]["response"]["body"]["id"]


def test_cookbook_batches_for_another_provider_run_with_any_model(engine, tmp_path):
    movies = [{**x, "body": {**x["body"], "max_tokens": 8}} for x in fx.COOKBOOK_MOVIES]
    lines = movies + [{**x, "custom_id": f"caption-{x['custom_id']}"} for x in fx.COOKBOOK_CAPTIONS]
    refused, failed, _ = _run(engine, tmp_path, lines, out="named", allow_all_failed=True)     # not the job's model: every line fails
    assert not refused and {cid for cid, x in failed.items() if x["error"]["param"] == "model"} == \
        {x["custom_id"] for x in movies}            # the captions fail first for their image parts
    # the tiny model's context is 256 tokens, the cookbook's system prompt longer: cut from the left
    ok, failed, _ = _run(engine, tmp_path, lines, out="any", any_model=True, truncate_prompt="left")
    assert set(ok) == {x["custom_id"] for x in movies}
    for x in ok.values():           # the model that ran; the name the line asked for kept beside it
        body = ChatCompletion.model_validate(x["response"]["body"])
        assert body.model == "smollm2-135m-instruct"     # the job's --model (the default: no -m here)
        assert body.model_extra["requested_model"] == "gpt-3.5-turbo" and body.usage.completion_tokens <= 8
    for x in failed.values():       # an image part: the line and the key
        e = BatchError.model_validate(x["error"])
        assert e.param == "messages" and "image_url" in e.message and e.line in (4, 5)


@pytest.mark.parametrize("kind,key,value", [("classify", "max_tokens", 5), ("classify", "n", 2),
                                            ("classify", "response_format", {"type": "json_object"})])
def test_a_body_key_classify_cannot_honour_is_an_error_line_naming_it(engine, tmp_path, kind, key, value):
    lines = [{**fx.VLLM_INPUT_BATCH[0], "custom_id": "a"},
             {**fx.VLLM_INPUT_BATCH[0], "custom_id": "b", "body": {"model": fx.CHAT_MODEL_NAME, "temperature": 0,
                                                                  "messages": [{"role": "user", "content": "Hi"}]}}]
    lines[0] = {**lines[0], "body": {"model": fx.CHAT_MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
                                     key: value}}
    ds = _write(tmp_path, lines)
    job = open_job(job_config(str(ds), output=str(tmp_path / "out"), kind=kind, labels=("yes", "no"),
                        served_model_name=(fx.CHAT_MODEL_NAME,)), engine=engine)
    job.run()
    from jobrunner.output import read_results
    rows = {r["id"]: r for r in read_results(str(tmp_path / "out")).to_pylist()}
    assert f"'{key}'" in rows["a"]["error"] and f"--kind {kind}" in rows["a"]["error"]
    assert rows["b"]["error"] is None and rows["b"]["label"] in ("yes", "no")


def test_validate_lists_every_failing_line_and_counts_each_lines_max_tokens(model_dir, tmp_path):
    lines = [fx.VLLM_INPUT_BATCH[0] | {"body": {**fx.VLLM_INPUT_BATCH[0]["body"], "max_tokens": 7}},
             fx.VLLM_INPUT_BATCH[1] | {"body": {**fx.VLLM_INPUT_BATCH[1]["body"], "max_tokens": None,
                                                "max_completion_tokens": 11}},
             *fx.VLLM_INPUT_BATCH[2:],
             {**fx.VLLM_INPUT_BATCH[0], "custom_id": "tools", "body": {**fx.VLLM_INPUT_BATCH[0]["body"],
                                                                       "tools": [{"type": "function"}]}},
             {**fx.VLLM_INPUT_BATCH[0], "custom_id": "nobody", "body": {"model": fx.CHAT_MODEL_NAME}}]
    ds = _write(tmp_path, lines)
    r = CliRunner().invoke(main, ["validate", str(ds), "-m", str(model_dir), "--served-model-name",
                                  fx.CHAT_MODEL_NAME, "--device", "cpu"])
    assert r.exit_code == 0, r.output
    for n, words in [(3, "NonExistModel"), (4, "/bad_url"), (5, "stream"), (6, "tools"), (7, "messages")]:
        assert any(line.split()[:2] == ["line", f"{n}"] or f"line {n}" in line and words in line
                   for line in r.output.splitlines() if words in line), (n, r.output)
    out_line = next(line for line in r.output.splitlines() if "max_output_tokens_total" in line)
    assert out_line.split()[-1].replace(",", "") == "18"        # 7 + 11, not 256 a line


def test_reasoning_is_written_under_both_names_and_an_absent_answer_is_null(tmp_path):
    from jobrunner.openai.batch import write_openai_batch_output
    from jobrunner.output import ResultWriter
    base = dict(prompt_tokens=3, cached_tokens=0, completion_tokens=4, error=None, finish_reason="length",
                messages=[{"role": "user", "content": "q"}], params={})
    url = str(tmp_path / "out")
    w = ResultWriter(url, {"config": {"model": "m"}})
    w.write([{"id": "cut", "output": None, "reasoning": "still thinking", "reasoning_tokens": 4, **base}])
    w.write([{"id": "plain", "output": "Answer", "reasoning": None, "reasoning_tokens": 0, **base}])
    w.close({"rows": 2})
    write_openai_batch_output(url)
    lines = {x["custom_id"]: x for x in map(json.loads, open(tmp_path / "out" / "results.openai.jsonl"))}
    cut = lines["cut"]["response"]["body"]["choices"][0]["message"]
    assert cut == {"role": "assistant", "content": None, "reasoning": "still thinking",
                   "reasoning_content": "still thinking"}
    assert ChatCompletion.model_validate(lines["cut"]["response"]["body"]).choices[0].message.content is None
    assert lines["plain"]["response"]["body"]["choices"][0]["message"] == {"role": "assistant", "content": "Answer"}


def test_a_row_error_of_an_openai_line_names_its_line(engine, tmp_path):
    """A line the kind refuses (a chat line under --kind embed) says which line, as the reader's errors do."""
    lines = [{"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}]}},
             {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"input": "Hi"}}]
    ds = _write(tmp_path, lines)
    job = open_job(job_config(str(ds), output=str(tmp_path / "out"), kind="embed"), engine=engine)
    job.run()
    from jobrunner.output import read_results
    errors = {r["id"]: r["error"] for r in read_results(str(tmp_path / "out")).to_pylist()}
    assert errors["emb"] is None and errors["chat"].startswith("line 1: ")
