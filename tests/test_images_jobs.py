"""Images through whole jobs on the tiny vision-language checkpoints (tests/vision_checkpoints.py), on CPU:
the requests the intake makes against transformers' own processor (token ids with the image tokens
expanded, pixels, grids), datasets with an --image-column of image structs, paths and lists, a messages
column with image parts, OpenAI batch lines with image_url parts (data: and a loopback http URL), bad
images as error rows while the job goes on, the summary's and `jobrunner validate`'s image counts, dedup
and the result cache over images, and a text model refusing image rows."""
from __future__ import annotations

import base64
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import jobrunner
from jobrunner.engine import Engine, EngineConfig, ImageInput, Request, SamplingParams, image_key
from jobrunner.config.job import job_config
from jobrunner.pipeline.build import load_engine, open_parts
from jobrunner.pipeline.resolve import resolve
from jobrunner.output import read_results
from vision_checkpoints import LLAVA_TEMPLATE, QWEN_TEMPLATE, checkpoint, sample_images

MAX_TOKENS = 3


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return str(checkpoint("qwen2_vl", tmp_path_factory.mktemp("qwen2_vl"))[0])


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return str(checkpoint("llava", tmp_path_factory.mktemp("llava"))[0])


def _parquet(path, rows: list[dict], image_type=None) -> str:
    fields = {"id": pa.string(), "prompt": pa.string()}
    if image_type is not None:
        fields["image"] = image_type
    columns = {name: [r.get(name) for r in rows] for name in fields}
    pq.write_table(pa.table(columns, schema=pa.schema(list(fields.items()))), str(path))
    return str(path)


STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])      # datasets' Image feature in Parquet


def _pending(cfg, **parts_kw):
    """The PendingRows the job's intake makes (their engine requests), with the engine it planned for."""
    resolved = resolve(cfg, output_state=False)
    engine = load_engine(cfg, resolved)
    try:
        parts = open_parts(cfg, resolved, engine.info, engine.tokenizer, engine.config, **parts_kw)
        pending = {p.id: p for p in parts.intake.rows()}
        return {i: p.engine_request() for i, p in pending.items()}, parts
    finally:
        engine.close()


# --- against transformers' processor ---------------------------------------------------------------

def _hf_reference(kind: str, path: str, text: str, images: list):
    """transformers' input ids and pixels for one user message of `images` then `text`."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    msgs = [{"role": "user", "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]}]
    if kind == "llava":
        proc = transformers.LlavaProcessor(image_processor=transformers.LlavaImageProcessorPil.from_pretrained(path),
                                           tokenizer=tok, chat_template=LLAVA_TEMPLATE, patch_size=7,
                                           vision_feature_select_strategy="default", num_additional_image_tokens=1)
        rendered = proc.apply_chat_template(msgs, add_generation_prompt=True)
        out = proc(text=rendered, images=images or None, add_special_tokens=False)
        if not images:
            return list(out["input_ids"][0]), [], None
        return list(out["input_ids"][0]), [np.asarray(p) for p in out["pixel_values"]], None
    # Qwen2VLProcessor needs torchvision (its video processor): its __call__'s expansion, by hand
    rendered = tok.apply_chat_template(msgs, chat_template=QWEN_TEMPLATE, tokenize=False, add_generation_prompt=True)
    if not images:
        return tok(rendered, add_special_tokens=False)["input_ids"], [], []
    ip = transformers.Qwen2VLImageProcessorPil.from_pretrained(path)
    out = ip(images=images)
    grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"]]
    for t, h, w in grids:
        rendered = rendered.replace("<|image_pad|>", "<|placeholder|>" * (t * h * w // 4), 1)
    ids = tok(rendered.replace("<|placeholder|>", "<|image_pad|>"), add_special_tokens=False)["input_ids"]
    pixels = np.asarray(out["pixel_values"])
    sizes = np.cumsum([0] + [t * h * w for t, h, w in grids])
    return ids, [pixels[a:b] for a, b in zip(sizes[:-1], sizes[1:])], grids


@pytest.mark.parametrize("kind", ["qwen2_vl", "llava"])
def test_intake_requests_match_transformers(kind, request, tmp_path):
    path = request.getfixturevalue("qwen" if kind == "qwen2_vl" else "llava")
    pics = sample_images()
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "p3.png").write_bytes(encoded(pics[3]))
    rows = [{"id": "one", "prompt": "describe it", "image": [{"bytes": encoded(pics[0]), "path": None}]},
            {"id": "two", "prompt": "compare", "image": [{"bytes": encoded(pics[1]), "path": "x.png"},
                                                         {"bytes": None, "path": "pics/p3.png"}]},
            {"id": "rgba", "prompt": "and this", "image": [{"bytes": encoded(pics[4]), "path": None}]},
            {"id": "none", "prompt": "no picture", "image": None}]
    ds = _parquet(tmp_path / "ds.parquet", rows, pa.list_(STRUCT))
    cfg = job_config(ds, model=path, image_column="image", max_tokens=MAX_TOKENS, output=str(tmp_path / "out"))
    reqs, parts = _pending(cfg)
    decoded = {"one": [pics[0]], "two": [pics[1], pics[3]], "rgba": [pics[4]], "none": []}
    for rid, images in decoded.items():
        req = reqs[rid]
        ids, pixels, grids = _hf_reference(kind, path, rows[list(decoded).index(rid)]["prompt"], images)
        assert req.prompt_token_ids == ids, rid
        assert len(req.images) == len(images)
        for im, px in zip(req.images, pixels):
            np.testing.assert_array_equal(im.pixels, px)
            assert im.key == image_key(im) and ids[im.offset:im.offset + im.length] == [ids[im.offset]] * im.length
        if grids is not None:
            assert [im.grid for im in req.images] == grids
    assert parts.stats.images == 4 and parts.stats.image_tokens == sum(im.length for r in reqs.values()
                                                                          for im in r.images)


def test_a_dataset_job_with_bad_images_goes_on(qwen, tmp_path):
    pics = sample_images()
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(encoded(pics[0]))
    big = encoded(Image.new("RGB", (300, 300)))
    rows = [{"id": "path", "prompt": "what?", "image": "pics/a.png"},               # relative to the dataset
            {"id": "missing", "prompt": "what?", "image": "pics/none.png"},
            {"id": "garbage", "prompt": "what?", "image": "data:image/png;base64," + base64.b64encode(b"no").decode()},
            {"id": "big", "prompt": "what?", "image": "data:image/png;base64," + base64.b64encode(big).decode()},
            {"id": "text", "prompt": "what?"},
            {"id": "same", "prompt": "what?", "image": str(tmp_path / "pics" / "a.png")}]     # `path`'s copy
    ds = tmp_path / "rows.jsonl"
    ds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = jobrunner.submit(str(ds), str(tmp_path / "out"), model=qwen, image_column="image", max_tokens=MAX_TOKENS,
                              max_image_pixels=20_000)
    assert result.exit_code == 0
    out = {r["id"]: r for r in read_results(str(tmp_path / "out")).to_pylist()}
    assert set(out) == {r["id"] for r in rows}
    assert "no such file" in out["missing"]["error"] and "pics/none.png" in out["missing"]["error"]
    assert "not an image Pillow can read" in out["garbage"]["error"]
    assert "over --max-image-pixels 20000" in out["big"]["error"]
    for rid in ("path", "text", "same"):
        assert out[rid]["error"] is None and out[rid]["completion_tokens"] == MAX_TOKENS
    assert out["same"]["output"] == out["path"]["output"] and out["same"]["reused"]     # dedup: the image's key
    s = result.stats
    assert s["images"] == 2 and s["image_errors"] == 3 and s["rows_failed"] == 3
    tokens = s["image_tokens"] // 2
    assert out["path"]["prompt_tokens"] == out["text"]["prompt_tokens"] + tokens + 2     # + the vision start, end
    saved = json.loads((tmp_path / "out" / "_stats.json").read_text())
    assert saved["images"] == 2 and saved["image_tokens"] == 2 * tokens

    # the result cache keys the images: a second job is served from it; another image is not
    cache = str(tmp_path / "cache")
    first = jobrunner.submit(str(ds), str(tmp_path / "c1"), model=qwen, image_column="image", max_tokens=MAX_TOKENS,
                             cache=cache)
    again = jobrunner.submit(str(ds), str(tmp_path / "c2"), model=qwen, image_column="image", max_tokens=MAX_TOKENS,
                             cache=cache)
    assert first.stats["rows_from_cache"] == 0 and again.stats["rows_from_cache"] == 3     # path, text, big
    (tmp_path / "pics" / "a.png").write_bytes(encoded(pics[2]))         # the same path, another image
    other = jobrunner.submit(str(ds), str(tmp_path / "c3"), model=qwen, image_column="image", max_tokens=MAX_TOKENS,
                             cache=cache)
    assert other.stats["rows_from_cache"] == 2          # text and big; path and same are computed anew


def test_rows_with_the_same_text_plan_apart_by_image(qwen, tmp_path):
    pics = sample_images()
    rows = [{"id": f"r{i}", "prompt": "the same question", "image": {"bytes": encoded(pics[j]), "path": None}}
            for i, j in enumerate([0, 1, 0])]
    ds = _parquet(tmp_path / "ds.parquet", rows, STRUCT)
    cfg = job_config(ds, model=qwen, image_column="image", max_tokens=MAX_TOKENS, output=str(tmp_path / "out"),
                     dedup=False)
    resolved = resolve(cfg, output_state=False)
    engine = load_engine(cfg, resolved)
    try:
        parts = open_parts(cfg, resolved, engine.info, engine.tokenizer, engine.config)   # the processor read again
        pending = {p.id: p for p in parts.intake.rows()}
    finally:
        engine.close()
    a, b, c = (pending[f"r{i}"].tokens.tolist() for i in range(3))
    im = pending["r0"].request.images[0]
    assert a == c and a[:im.offset] == b[:im.offset] and a[im.offset] != b[im.offset]
    assert all(t >= 2**31 for t in a[im.offset:im.offset + im.length]) and max(a[:im.offset]) < 2**31


def test_messages_column_and_openai_lines(qwen, tmp_path):
    pics = sample_images()
    (tmp_path / "a.png").write_bytes(encoded(pics[0]))
    msgs = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "image", "path": "a.png"},
                                         {"type": "text", "text": "then"}, {"type": "image"}]}]
    ds = tmp_path / "m.jsonl"
    ds.write_text(json.dumps({"id": "m", "messages": msgs, "image": encoded_b64(pics[1])}) + "\n")
    r = jobrunner.submit(str(ds), str(tmp_path / "mout"), model=qwen, messages_column="messages",
                         image_column="image", max_tokens=MAX_TOKENS)
    (row,) = read_results(str(tmp_path / "mout")).to_pylist()
    assert row["error"] is None and r.stats["images"] == 2

    # OpenAI batch lines: a data: URL and a loopback http URL, the response body as the openai package reads it
    from openai.types.chat import ChatCompletion

    served = encoded(pics[3])

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(served)))
            self.end_headers()
            self.wfile.write(served)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/p.png"
        lines = []
        for cid, image_url in [("data", encoded_b64(pics[0])), ("http", url)]:
            parts = [{"type": "text", "text": "caption"}, {"type": "image_url", "image_url": {"url": image_url,
                                                                                             "detail": "low"}}]
            lines.append({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                          "body": {"model": "m", "max_tokens": MAX_TOKENS, "messages": [{"role": "user",
                                                                                         "content": parts}]}})
        batch = tmp_path / "batch.jsonl"
        batch.write_text("".join(json.dumps(x) + "\n" for x in lines))
        res = jobrunner.submit(str(batch), str(tmp_path / "bout"), model=qwen, any_model=True,
                               output_format="openai-batch", image_allow_private=True)     # the loopback server
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert res.exit_code == 0 and res.stats["images"] == 2
    outputs = [json.loads(x) for x in next((tmp_path / "bout").glob("*.jsonl")).read_text().splitlines()]
    with Engine(EngineConfig(model=qwen, device="cpu", dtype="float32")) as engine:
        for line in outputs:
            body = ChatCompletion.model_validate(line["response"]["body"])
            pic = pics[0] if line["custom_id"] == "data" else pics[3]
            ids, images = _by_hand(engine, "caption", pic)
            assert body.usage.prompt_tokens == len(ids)         # the image's tokens counted, as the reference
            [direct] = engine.generate([Request("x", ids, SamplingParams(max_tokens=MAX_TOKENS), images=images)])
            assert body.choices[0].message.content == direct.completions[0].text


def encoded_b64(image) -> str:
    return "data:image/png;base64," + base64.b64encode(encoded(image)).decode()


def _by_hand(engine, text: str, image):
    """The request as tests/test_engine_images.py makes it: the chat template over text then the image."""
    msgs = [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"}]}]
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(msgs))
    p = engine.image_processor.prepare(image)
    ids, (off,) = engine.image_processor.expand(ids, [p])
    return ids, (ImageInput(p.pixels, p.grid, image_key(p), off, p.num_tokens),)


def test_validate_counts_image_tokens(qwen, tmp_path):
    from jobrunner.cli.validate import validate_job

    pics = sample_images()
    rows = [{"id": "a", "prompt": "x", "image": [encoded_b64(pics[0]), encoded_b64(pics[1])]},
            {"id": "b", "prompt": "y", "image": "data:image/png;base64,AAAA"}]
    ds = tmp_path / "v.jsonl"
    ds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = validate_job(job_config(str(ds), model=qwen, image_column="image"))
    assert report["images"] == 2 and report["rows_with_errors"] == 1
    with Engine(EngineConfig(model=qwen, device="cpu", dtype="float32")) as engine:
        expected = sum(engine.image_processor.prepare(p).num_tokens for p in pics[:2])
    assert report["image_tokens"] == expected


def test_a_text_model_refuses_image_rows(tiny_hf_model_dir, tmp_path):
    rows = [{"id": "img", "prompt": "x", "image": "data:image/png;base64,AAAA"}, {"id": "txt", "prompt": "y"}]
    ds = tmp_path / "t.jsonl"
    ds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = jobrunner.submit(str(ds), str(tmp_path / "out"), model=str(tiny_hf_model_dir("llama")),
                           image_column="image", max_tokens=2)
    out = {r["id"]: r for r in read_results(str(tmp_path / "out")).to_pylist()}
    assert out["img"]["error"] == "--image-column 'image': this model takes no images"
    assert out["txt"]["error"] is None and "images" not in res.stats
