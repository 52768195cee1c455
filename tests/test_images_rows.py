"""Images in a row's prompt, without an engine: content parts as OpenAI and Hugging Face write them
(jobs.messages, jobs.base.PromptBuilder), OpenAI batch lines built with the `openai` package's types,
the result cache key (a text request's bytes unchanged), planner ids that part different images, and the
pixels of waiting rows (jobrunner/images/prepare.py: the store, preparing again, shipping)."""
from __future__ import annotations

import io
import json
import pickle
from dataclasses import dataclass, replace

import numpy as np
import pytest
from PIL import Image

from jobrunner.engine import Constraint, ImageInput, Request, SamplingParams
from jobrunner.engine.load.tokenizer import Tokenizer
from jobrunner.cache.key import request_key
from jobrunner.images import ImagePrep, PixelStore, RowImages, image_inputs
from jobrunner.pipeline.pending import IMAGE_PLAN_BASE, IMAGE_PLAN_SPAN, PendingRow, image_plan_ids, plan_tokens
from jobrunner.openai import batch as openai_batch
from jobrunner.openai.request import text_messages
from jobrunner.openai.row_options import row_options
from jobrunner.jobs import JobSpec, PromptBuilder, PromptSpec, RowError
from jobrunner.jobs.messages import IMAGE_PART, join_text_parts, template_images
from jobrunner.jobs.row import RowOptions
from vision_checkpoints import QWEN_TEMPLATE, tokenizer as vl_tokenizer


def png(w=12, h=8, color=(200, 30, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, "PNG")
    return buf.getvalue()


@dataclass(frozen=True, eq=False)
class FakePrepared:
    pixels: np.ndarray
    grid: tuple
    num_tokens: int


class FakeProcessor:
    """engine.ImageProcessor's interface: an image's tokens are its width // 4; pixels its RGB values."""
    image_token, image_token_id = "<|image_pad|>", 7

    def __init__(self):
        self.prepared = 0

    def prepare(self, image):
        self.prepared += 1
        rgb = np.asarray(image.convert("RGB"), np.float32) / 255
        return FakePrepared(rgb, (1, image.height, image.width), max(1, image.width // 4))

    def expand(self, ids, images):
        from jobrunner.engine.vision.processor import ImageProcessor
        return ImageProcessor.expand(self, ids, images)


@pytest.fixture(scope="module")
def qwen_tok():
    hf = vl_tokenizer("qwen2_vl")
    return Tokenizer(hf.backend_tokenizer, chat_template=QWEN_TEMPLATE)


def builder(tok, **prompt):
    return PromptBuilder(JobSpec(kind="generate", prompt=PromptSpec(**prompt)), tok)


# --- content parts ---------------------------------------------------------------------------------

def test_text_parts_are_joined_as_before_and_image_parts_kept():
    text = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert join_text_parts(text) == ([{"role": "user", "content": "a\nb"}], None)
    url = {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "low"}}
    mixed = [{"role": "system", "content": "s"},
             {"role": "user", "content": [{"type": "text", "text": "look", "extra": 1}, url]}]
    out, error = join_text_parts(mixed)
    assert error is None
    assert out == [{"role": "system", "content": "s"},
                   {"role": "user", "content": [{"type": "text", "text": "look"}, url]}]
    for bad, why in [({"type": "image_url", "image_url": {"url": "x"}}, "http"),
                     ({"type": "image_url", "image_url": {"url": "https://a", "detail": "max"}}, "detail"),
                     ({"type": "image", "url": "a", "path": "b"}, "one of"),
                     ({"type": "input_audio"}, "only text and image parts")]:
        assert why in join_text_parts([{"role": "user", "content": [bad]}])[1]


def test_template_images_in_place_and_from_the_column():
    msgs = [{"role": "user", "content": [{"type": "image", "path": "a.png"}, {"type": "text", "text": "q"},
                                         {"type": "image_url", "image_url": {"url": "data:;base64,AA=="}},
                                         {"type": "image", "base64": "QUJD"}]}]
    out, sources = template_images(msgs)
    assert out == [{"role": "user", "content": [IMAGE_PART, {"type": "text", "text": "q"}, IMAGE_PART, IMAGE_PART]}]
    assert sources == ["a.png", "data:;base64,AA==", "data:;base64,QUJD"]
    # placeholders ({"type": "image"} alone) take the column's images in turn
    holes = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    assert template_images(holes, ("c1", "c2"))[1] == ["c1", "c2"]
    with pytest.raises(ValueError, match="hold 2 image parts without an image, and the image column gives 1"):
        template_images(holes, ("c1",))
    with pytest.raises(ValueError, match="gives 3 images"):
        template_images(holes, ("c1", "c2", "c3"))
    # no placeholder: the column's images open the first user message, after earlier messages' images
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "second"}]
    out, sources = template_images(chat, ("c1", "c2"))
    assert out[1]["content"] == [IMAGE_PART, IMAGE_PART, {"type": "text", "text": "first"}]
    assert out[3] == chat[3] and sources == ["c1", "c2"]


def test_prompt_builder_places_images(qwen_tok):
    b = builder(qwen_tok)
    plain = b.prompt({"prompt": "what is it?"})
    assert plain.images == () and "<|image_pad|>" not in plain.text      # a text row as before
    assert b.render({"prompt": "what is it?"}) == (plain.text, plain.special)
    p = b.prompt({"prompt": "what is it?"}, images=("i1", "i2"))
    assert p.images == ("i1", "i2") and not p.special
    assert p.text.endswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|vision_start|>"
                           "<|image_pad|><|vision_end|>what is it?<|im_end|>\n<|im_start|>assistant\n")
    # transformers renders the same text from the same messages
    hf = vl_tokenizer("qwen2_vl")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    assert p.text == hf.apply_chat_template(msgs, chat_template=QWEN_TEMPLATE, tokenize=False,
                                            add_generation_prompt=True)
    # a messages column: its image parts where they are; the row's own messages (an OpenAI line) too
    mb = builder(qwen_tok, messages_column="m")
    row = {"m": [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image", "url": "u"}]}]}
    assert mb.prompt(row).images == ("u",) and "x<|vision_start|>" in mb.prompt(row).text
    own = RowOptions(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://h/i"}}]}])
    assert b.prompt({}, own).images == ("http://h/i",)
    with pytest.raises(RowError, match="the image column gives 1 images"):
        mb.prompt({"m": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}]}, images=("c",))
    # raw text: the images are the column's; the text writes the tokens itself (the intake checks)
    raw = builder(qwen_tok, chat=False).prompt({"prompt": "<|image_pad|> describe"}, images=("c",))
    assert raw.special and raw.images == ("c",)


# --- OpenAI batch lines ----------------------------------------------------------------------------

def test_openai_lines_with_image_url_parts_parse_with_the_openai_types():
    from openai.types.chat import (ChatCompletionContentPartImageParam, ChatCompletionContentPartTextParam,
                                   ChatCompletionUserMessageParam, CompletionCreateParams)

    url = "data:image/png;base64,iVBORw0KGgo="
    parts = [ChatCompletionContentPartTextParam(type="text", text="caption this"),
             ChatCompletionContentPartImageParam(type="image_url", image_url={"url": url, "detail": "high"})]
    body: CompletionCreateParams = {"model": "m", "max_tokens": 5,
                                    "messages": [ChatCompletionUserMessageParam(role="user", content=parts)]}
    line = json.dumps({"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": body})
    cid, data, error = openai_batch.parse_record(json.loads(line))
    assert error is None and cid == "c1", error
    assert data["messages"][0]["content"][1] == parts[1]
    opts = row_options(data)
    assert opts.messages[0]["content"] == [{"type": "text", "text": "caption this"}, parts[1]]
    # what OpenAI does not take: a Hugging Face image part, a url that is no URL
    assert "image_url parts" in text_messages([{"role": "user", "content": [{"type": "image", "url": url}]}])[1]
    assert "image_url" in text_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])[1]


# --- the result cache key --------------------------------------------------------------------------

# The keys of these requests as jobrunner/cache/key.py made them before Request had images (commit 98a7b23)
_BEFORE = ["21a81c5d1f0318fae4a5d81264672b04", "1841b70fc23af3a7e21140ea592d019d", "6ed872e84d238cd0c8b998f737d11a1c"]


def test_a_text_requests_key_bytes_are_unchanged():
    model = bytes(range(16))
    reqs = [Request("a", [1, 2, 3, 70000], SamplingParams(max_tokens=8, temperature=0.0)),
            Request("b", list(range(40)), SamplingParams(max_tokens=3, seed=7, temperature=0.8, stop=("x",)),
                    candidates=[[5, 6], [7]]),
            Request("c", [9, 9], SamplingParams(max_tokens=2), constraint=Constraint("json"), adapter="ad")]
    assert [request_key(model, "generate", r, {"ad": "hash1"}).hex() for r in reqs] == _BEFORE


def test_keys_take_image_keys_offsets_and_lengths_never_pixels():
    model, sp = bytes(16), SamplingParams(max_tokens=2)
    ids = [1, 7, 7, 7, 2]
    im = ImageInput(np.ones((3, 2), np.float32), (1, 3, 2), 1234, 1, 3)
    key = request_key(model, "generate", Request("a", ids, sp, images=(im,)))
    assert key != request_key(model, "generate", Request("a", ids, sp))
    assert key == request_key(model, "generate", Request("b", ids, sp, images=(replace(im, pixels=np.zeros(0)),)))
    assert key != request_key(model, "generate", Request("a", ids, sp, images=(replace(im, key=1235),)))
    assert key != request_key(model, "generate", Request("a", [1, 7, 7, 7, 7, 2], sp, images=(replace(im, offset=2),)))


# --- planner ids -----------------------------------------------------------------------------------

def test_planner_ids_part_different_images_and_map_back():
    a, b = image_plan_ids(11, 50), image_plan_ids(12, 50)
    assert a.dtype == np.uint32 and (a >= IMAGE_PLAN_BASE).all() and (a < IMAGE_PLAN_BASE + IMAGE_PLAN_SPAN).all()
    assert (a != b).all() and len(set(a.tolist())) == 50 and (image_plan_ids(11, 50) == a).all()
    ids = [3, 4, 7, 7, 7, 7, 5]
    first = ImageInput(np.zeros(0), (1, 2, 2), 11, 2, 4)
    t1 = plan_tokens(ids, (first,))
    t2 = plan_tokens(ids, (replace(first, key=12),))
    assert t1[:2].tolist() == t2[:2].tolist() == [3, 4] and t1[6] == t2[6] == 5
    assert t1[2] != t2[2] and all(t >= 2**31 for t in t1[2:6])
    assert plan_tokens(ids, ()).tolist() == ids
    store_prep = ImagePrep(FakeProcessor(), budget=1 << 20)
    prepared = store_prep.prepared((png(8, 4),))
    req = Request("r", [], SamplingParams(), images=(replace(first, key=prepared[0].key, pixels=np.zeros(0)),))
    images = RowImages.kept(store_prep, (png(8, 4),), prepared, 7)
    p = PendingRow(None, plan_tokens(ids, req.images), req, None, images)
    assert p.keyed_request().prompt_token_ids == ids
    out = p.engine_request()
    assert out.prompt_token_ids == ids and np.array_equal(out.images[0].pixels, prepared[0].image.pixels)


# --- waiting rows' pixels ----------------------------------------------------------------------------

def test_pixel_store_counts_rows_and_keeps_to_its_budget():
    store = PixelStore(budget=200)
    a, b = np.zeros(25, np.float32), np.ones(25, np.float32)       # 100 bytes each
    store.put(1, a)
    store.put(1, a)                      # the same image, a second row
    store.put(2, b)
    assert store.bytes == 200 and len(store) == 2
    assert store.take(1) is a and store.bytes == 200      # one row still to take it
    assert store.take(1) is a and store.bytes == 100
    store.put(3, a)
    store.put(4, b)                      # over the budget: the oldest (2) let go
    assert store.evicted == 1 and store.take(2) is None and store.bytes == 200


def test_a_row_whose_pixels_were_let_go_prepares_them_again_and_ships_them():
    proc = FakeProcessor()
    prep = ImagePrep(proc, budget=0)         # keeps nothing
    values = (png(8, 4), {"bytes": png(12, 4, (1, 2, 3))})
    prepared = prep.prepared(values)
    assert proc.prepared == 2 and [p.num_tokens for p in prepared] == [2, 3]
    ids, offsets = proc.expand([1, 7, 2, 7], [p.image for p in prepared])
    inputs = image_inputs(prepared, offsets)
    assert ids == [1, 7, 7, 2, 7, 7, 7] and [(i.offset, i.length) for i in inputs] == [(1, 2), (4, 3)]
    req = Request("r", [], SamplingParams(), images=tuple(replace(i, pixels=np.zeros(0)) for i in inputs))
    row = PendingRow(None, plan_tokens(ids, inputs), req, None, RowImages.kept(prep, values, prepared, 7))
    shipped = pickle.loads(pickle.dumps(row))        # a Ray bundle: the pixels go along
    assert proc.prepared == 4 and shipped.images.prep is None
    for p in (row, shipped):
        out = p.engine_request()
        assert out.prompt_token_ids == ids
        for got, want in zip(out.images, inputs):
            assert got.key == want.key and np.array_equal(got.pixels, want.pixels)
    assert proc.prepared == 6            # the row here prepared them again; the shipped one had them


def test_pool_errors_name_the_image():
    prep = ImagePrep(FakeProcessor())
    try:
        with pytest.raises(Exception, match=r"image 2 of 2: image of 5 bytes: not an image Pillow can read"):
            prep.submit((png(), b"nope!")).result()
    finally:
        prep.close()
