"""Image rows beyond plain generation, on the tiny Qwen2-VL checkpoint: a Parquet of image structs answers
as the same requests written as OpenAI batch lines; score, classify, structured output and /v1/responses
lines with input_image parts run over images."""
from __future__ import annotations

import base64
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import jobrunner
from jobrunner.output import read_results
from vision_checkpoints import checkpoint, sample_images

MAX_TOKENS = 4
STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])      # datasets' Image feature in Parquet


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return str(checkpoint("qwen2_vl", tmp_path_factory.mktemp("qwen2_vl"))[0])


@pytest.fixture(scope="module")
def pictures():
    out = []
    for image in sample_images()[:4]:
        buf = io.BytesIO()
        image.save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _struct_parquet(path, rows) -> str:
    table = pa.table({"id": [r["id"] for r in rows], "prompt": [r["prompt"] for r in rows],
                      "answer": ["a cat" for _ in rows], "image": [{"bytes": r["png"], "path": None} for r in rows]},
                     schema=pa.schema([("id", pa.string()), ("prompt", pa.string()), ("answer", pa.string()),
                                       ("image", STRUCT)]))
    pq.write_table(table, str(path))
    return str(path)


def test_a_parquet_of_image_structs_answers_as_openai_lines(qwen, pictures, tmp_path):
    from openai.types.chat import ChatCompletion

    rows = [{"id": f"r{i}", "prompt": f"what is in picture {i}?", "png": png} for i, png in enumerate(pictures)]
    ds = _struct_parquet(tmp_path / "ds.parquet", rows)
    table = jobrunner.submit(ds, str(tmp_path / "pq"), model=qwen, image_column="image", max_tokens=MAX_TOKENS)
    assert table.exit_code == 0 and table.stats["images"] == len(rows)
    from_parquet = {r["id"]: r for r in read_results(str(tmp_path / "pq")).to_pylist()}

    # the same requests as lines: the image before the text, as --image-column places it
    lines = [{"custom_id": r["id"], "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": [
                  {"type": "image_url", "image_url": {"url": _data_url(r["png"])}},
                  {"type": "text", "text": r["prompt"]}]}]}} for r in rows]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = jobrunner.submit(str(batch), str(tmp_path / "oa"), model=qwen, any_model=True, output_format="openai-batch")
    assert res.exit_code == 0
    answers = {}
    for line in next((tmp_path / "oa").glob("*.jsonl")).read_text().splitlines():
        x = json.loads(line)
        answers[x["custom_id"]] = ChatCompletion.model_validate(x["response"]["body"])
    assert set(answers) == set(from_parquet)
    for rid, body in answers.items():
        assert body.choices[0].message.content == from_parquet[rid]["output"]
        assert body.usage.prompt_tokens == from_parquet[rid]["prompt_tokens"]


def _image_rows_job(qwen, pictures, tmp_path, prompt: str, name: str, **options) -> tuple[str, list[dict]]:
    """One job over a Parquet of image structs, a row per picture: (the dataset, its result rows)."""
    rows = [{"id": f"r{i}", "prompt": prompt, "png": png} for i, png in enumerate(pictures)]
    ds = _struct_parquet(tmp_path / "ds.parquet", rows)
    res = jobrunner.submit(ds, str(tmp_path / name), model=qwen, image_column="image", **options)
    assert res.exit_code == 0 and res.stats["images"] == len(rows)
    return ds, read_results(str(tmp_path / name)).to_pylist()


def test_score_over_images(qwen, pictures, tmp_path):
    _, out = _image_rows_job(qwen, pictures, tmp_path, "what animal is it?", "score", kind="score",
                             score_column="answer")
    assert all(r["error"] is None and r["scored_tokens"] > 0 for r in out)
    assert len({round(r["logprob"], 6) for r in out}) == len(pictures)      # each image its own likelihood


def test_classify_and_structured_output_over_images(qwen, pictures, tmp_path):
    ds, out = _image_rows_job(qwen, pictures, tmp_path, "is it a cat or a dog?", "cls", kind="classify",
                              labels="cat,dog")
    assert all(r["error"] is None and r["label"] in ("cat", "dog") for r in out)
    # another image, another answer's probabilities: the rows did not share one image's computation
    assert len({json.dumps(r["label_probs"], sort_keys=True) for r in out}) > 1

    schema = {"type": "object", "properties": {"animal": {"enum": ["cat", "dog"]}}, "required": ["animal"],
              "additionalProperties": False}
    res = jobrunner.submit(ds, str(tmp_path / "json"), model=qwen, image_column="image", max_tokens=24,
                           json_schema=json.dumps(schema))
    assert res.exit_code == 0
    for r in read_results(str(tmp_path / "json")).to_pylist():
        assert r["error"] is None
        if r["finish_reason"] == "stop":
            assert json.loads(r["output"])["animal"] in ("cat", "dog")


def test_responses_lines_with_input_image_parts(qwen, pictures, tmp_path):
    from openai.types.responses import Response

    line = {"custom_id": "resp", "method": "POST", "url": "/v1/responses",
            "body": {"model": "m", "max_output_tokens": MAX_TOKENS, "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "caption this"},
                {"type": "input_image", "image_url": _data_url(pictures[0]), "detail": "auto"}]}]}}
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps(line) + "\n")
    res = jobrunner.submit(str(batch), str(tmp_path / "out"), model=qwen, any_model=True, output_format="openai-batch")
    assert res.exit_code == 0 and res.stats["images"] == 1
    [x] = [json.loads(s) for s in next((tmp_path / "out").glob("*.jsonl")).read_text().splitlines()]
    body = Response.model_validate(x["response"]["body"])
    assert body.usage.input_tokens > 20 and body.output[0].content[0].text is not None
