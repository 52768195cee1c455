"""Images through the engine: rows with one image, several and none, mixed in one batch, against
transformers on the same tiny checkpoint (greedy tokens identical, logprobs within 1e-4); the prefix
cache and the embedding store keyed by pixels (the same image computed once, different images never
shared); chunked prefill splitting an image; requests the engine refuses."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from jobrunner.engine import Engine, EngineConfig, ImageInput, Request, SamplingParams, image_key
from vision_checkpoints import checkpoint, sample_images

NEW = 6


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "llava"])
def vl(request, tmp_path_factory):
    path, hf = checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, str(path), hf


def _engine(path: str, **kw) -> Engine:
    return Engine(EngineConfig(model=path, device="cpu", dtype="float32", **kw))


def _prompt(engine: Engine, text: str, images: list, before: str = "") -> tuple[list[int], tuple[ImageInput, ...]]:
    """The chat template over a user message of `before`, the images, then the text, its image tokens expanded."""
    content = ([{"type": "text", "text": before}] if before else []) + [{"type": "image"} for _ in images] + [
        {"type": "text", "text": text}]
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": content}])
    ids = engine.tokenizer.encode(rendered)
    proc = engine.image_processor
    prepared = [proc.prepare(im) for im in images]
    ids, offsets = proc.expand(ids, prepared)
    return ids, tuple(ImageInput(p.pixels, p.grid, image_key(p), o, p.num_tokens) for p, o in zip(prepared, offsets))


def _hf_inputs(kind: str, images: tuple[ImageInput, ...], seq: list[int]) -> dict:
    if not images:
        return {}
    if kind == "llava":
        return {"pixel_values": torch.from_numpy(np.stack([im.pixels for im in images]))}
    types = torch.zeros(1, len(seq), dtype=torch.int32)        # 1 at image tokens, as the processor returns it
    for im in images:
        types[0, im.offset:im.offset + im.length] = 1
    return {"pixel_values": torch.from_numpy(np.concatenate([im.pixels for im in images])),
            "image_grid_thw": torch.tensor([im.grid for im in images]), "mm_token_type_ids": types}


@torch.no_grad()
def _hf_greedy(hf, kind: str, ids: list[int], images) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation, recomputed whole each step (no cache to differ in)."""
    seq, logprobs = list(ids), []
    for _ in range(NEW):
        logits = hf(input_ids=torch.tensor([seq]), **_hf_inputs(kind, images, seq)).logits[0, -1].float()
        token = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        seq.append(token)
    return seq[len(ids):], logprobs


def _request(rid: str, ids, images) -> Request:
    return Request(rid, ids, SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=0), images=images)


def test_mixed_batch_matches_transformers(vl):
    kind, path, hf = vl
    pics = sample_images()
    with _engine(path) as engine:
        rows = {"one": _prompt(engine, "describe it", pics[:1]),
                "two": _prompt(engine, "compare them", [pics[1], pics[3]]),
                "none": _prompt(engine, "no picture here", []),
                "odd": _prompt(engine, "and this", [pics[4], pics[5], pics[2]])}
        outs = engine.generate([_request(rid, ids, images) for rid, (ids, images) in rows.items()])
        assert engine.counters().images_encoded == 6
    for out, (rid, (ids, images)) in zip(outs, rows.items()):
        tokens, logprobs = _hf_greedy(hf, kind, ids, images)
        assert out.error is None, out.error
        assert out.token_ids == tokens, rid
        np.testing.assert_allclose([lp.logprob for lp in out.completions[0].logprobs], logprobs, atol=1e-4)
        assert out.prompt_tokens == len(ids)        # the image tokens counted, as transformers' processor counts them


def test_same_image_computed_once_different_images_never_shared(vl):
    kind, path, _ = vl
    pics = sample_images()
    with _engine(path) as engine:
        same = [_prompt(engine, f"question {i}", pics[:1]) for i in range(4)]
        engine.generate([_request(f"s{i}", ids, images) for i, (ids, images) in enumerate(same)])
        c = engine.counters()
        assert c.images_encoded == 1
        ids, image = same[0]
        image_end = image[0].offset + image[0].length
        assert c.prompt_tokens_cached >= 3 * (image_end // 16 * 16)   # the image's blocks came from the cache
        engine.reset_counters()
        # another prefix before the same image: the prefix cache can't serve it, the tower's output store does
        apart = [_prompt(engine, "question", pics[:1], before=f"context number {i} " * 3) for i in range(3)]
        engine.generate([_request(f"a{i}", ids, images) for i, (ids, images) in enumerate(apart)])
        c = engine.counters()
        assert c.images_encoded == 0
        if kind != "llava":     # LLaVA's template writes the images first: the prefix cache serves them there
            assert c.images_reused == 3
        engine.reset_counters()
        other = _prompt(engine, "question 0", pics[2:3])            # same text, another image
        engine.generate([_request("other", *other)])
        c = engine.counters()
        assert c.images_encoded == 1
        assert c.prompt_tokens_cached <= other[1][0].offset         # nothing from the image on is shared


def test_chunked_prefill_through_an_image_matches_whole(vl):
    _, path, _ = vl
    pics = sample_images()
    results = []
    for budget in (None, 7):        # 7 tokens a step: every image is split over several steps
        with _engine(path, max_num_batched_tokens=budget, enable_prefix_caching=False) as engine:
            ids, images = _prompt(engine, "split me", [pics[3], pics[0]])
            results.append(engine.generate([_request("r", ids, images)])[0].token_ids)
    assert results[0] == results[1]


def test_refused_requests(vl, tiny_hf_model_dir):
    _, path, _ = vl
    pics = sample_images()
    with _engine(path) as engine:
        ids, images = _prompt(engine, "x", pics[:1])
        wrong = (ImageInput(images[0].pixels, images[0].grid, images[0].key, images[0].offset + 1, images[0].length),)
        [bad] = engine.generate([_request("bad", ids, wrong)])
        assert "image 0" in bad.error
        [short] = engine.generate([_request("short", ids + [ids[images[0].offset]], images)])
        assert "image tokens" in short.error
    with _engine(str(tiny_hf_model_dir("llama"))) as text_only:
        [out] = text_only.generate([_request("t", [1, 2, 3], images)])
        assert "takes no images" in out.error
