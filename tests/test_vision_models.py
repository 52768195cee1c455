"""Qwen2-VL, Qwen2.5-VL and LLaVA against transformers, from tiny checkpoints it saves (tests/vision_checkpoints.py):
the image processor's pixels and grids (allclose 1e-6, equal), multimodal rotary positions (equal to
get_rope_index), the vision tower over several images of different sizes in one call (1e-5), and a prompt's
logits with images spliced in (1e-4), then a decode step past it; the loader's files and weight layouts.
"""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from jobrunner.engine.load.loader import load_model_bundle
from jobrunner.engine.config.model_config import ModelConfig
from jobrunner.engine.models.vision_language import checkpoint_name
from jobrunner.engine.api.request import ImageInput
from jobrunner.engine.run.runtime import build_model
from jobrunner.engine.vision.positions import mrope_positions
from jobrunner.engine.vision.processor import PreparedImage, image_key, load_image_processor, smart_resize
from jobrunner.kernels.ops import AttentionMetadata
from tests.vision_checkpoints import KINDS, LLAVA_PREPROCESSOR, QWEN_PREPROCESSOR, checkpoint, sample_images

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
if not hasattr(transformers, "Qwen2VLImageProcessorPil"):       # the references are transformers 5's
    pytest.skip("needs transformers 5 (its *Pil image processors)", allow_module_level=True)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """kind -> (checkpoint dir, the transformers model, our bundle, our model), built on first use."""
    cache: dict[str, tuple] = {}
    root = tmp_path_factory.mktemp("vision")

    def get(kind: str):
        if kind not in cache:
            path, hf = checkpoint(kind, root)
            bundle = load_model_bundle(str(path))
            cache[kind] = path, hf, bundle, build_model(bundle, CPU, torch.float32)
        return cache[kind]
    return get


def _is_qwen(kind: str) -> bool:
    return kind.startswith("qwen")


def _hf_processor(kind: str, pre: dict):
    cls = transformers.Qwen2VLImageProcessorPil if _is_qwen(kind) else transformers.LlavaImageProcessorPil
    return cls(**pre)


def _hf_pixels(hf_proc, images):
    out = hf_proc(images=images, return_tensors="np")
    return np.asarray(out["pixel_values"]), out.get("image_grid_thw")


# --- the image processor --------------------------------------------------------------

PREPROCESSORS = [
    ("qwen2_vl", QWEN_PREPROCESSOR),
    ("qwen2_vl", {"min_pixels": 3136, "max_pixels": 28 * 28 * 6, "patch_size": 14, "temporal_patch_size": 2,
                  "merge_size": 2}),                                     # older configs' form; small images grow
    ("qwen2_vl", {"size": {"shortest_edge": 64, "longest_edge": 1024}, "patch_size": 4, "merge_size": 2,
                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2}),  # larger ones shrink
    ("llava", LLAVA_PREPROCESSOR),
    ("llava", {"size": {"height": 30, "width": 30}, "crop_size": {"height": 28, "width": 28}, "do_pad": True}),
    ("llava", {"size": {"shortest_edge": 20, "longest_edge": 40}, "crop_size": {"height": 28, "width": 28}}),
]


@pytest.mark.parametrize("kind, pre", PREPROCESSORS)
def test_processor_matches_transformers(made, kind, pre):
    """Each sample image (RGB of several sizes, RGBA, grayscale) alone: the same pixels and grid as the
    *Pil image processor of transformers, and the token count its processor would write."""
    _, hf, bundle, _ = made(kind)
    ours = load_image_processor(bundle.hf_config, pre, bundle.tokenizer)
    reference = _hf_processor(kind, pre)
    for image in sample_images():
        prepared = ours.prepare(image)
        pixels, grid = _hf_pixels(reference, [image])
        assert prepared.pixels.dtype == np.float32
        if _is_qwen(kind):
            assert prepared.grid == tuple(grid[0].tolist())
            assert prepared.num_tokens == int(np.prod(grid[0])) // 4
            np.testing.assert_allclose(prepared.pixels, pixels, rtol=0, atol=1e-6)
        else:
            np.testing.assert_allclose(prepared.pixels, pixels[0], rtol=0, atol=1e-6)
            assert prepared.grid == (1, 4, 4) and prepared.num_tokens == 16


def test_llava_token_count_is_the_processors(made):
    """LLaVA: what LlavaProcessor writes per image (patches, plus the CLS row under "full")."""
    for kind, keeps_cls in (("llava", False), ("llava_full", True)):
        _, hf, bundle, _ = made(kind)
        tok = transformers.AutoTokenizer.from_pretrained(str(made(kind)[0]))
        proc = transformers.LlavaProcessor(image_processor=_hf_processor(kind, LLAVA_PREPROCESSOR), tokenizer=tok,
                                           patch_size=7, num_additional_image_tokens=1,
                                           vision_feature_select_strategy=hf.config.vision_feature_select_strategy)
        ids = proc(text=["a <image> b"], images=sample_images()[:1], return_tensors="np")["input_ids"][0]
        ours = bundle.image_processor
        assert ours.prepare(sample_images()[0]).num_tokens == int((ids == ours.image_token_id).sum()) == 16 + keeps_cls


def test_smart_resize_bounds():
    assert smart_resize(30, 112, 8, 256, 4096) == (32, 112)
    h, w = smart_resize(1000, 700, 28, 3136, 28 * 28 * 100)
    assert h % 28 == w % 28 == 0 and h * w <= 28 * 28 * 100
    h, w = smart_resize(10, 12, 28, 3136, 28 * 28 * 100)
    assert h * w >= 3136
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 3000)


def test_expand_and_key(made):
    proc = made("qwen2_vl")[2].image_processor
    a, b = (proc.prepare(im) for im in sample_images()[:2])
    t = proc.image_token_id
    ids, offsets = proc.expand([5, t, 6, 7, t, 8], [a, b])
    assert offsets == [1, 1 + a.num_tokens + 2]
    assert ids == [5] + [t] * a.num_tokens + [6, 7] + [t] * b.num_tokens + [8]
    with pytest.raises(ValueError, match="image tokens"):
        proc.expand([5, t, 6], [a, b])
    assert image_key(a) == image_key(proc.prepare(sample_images()[0])) != image_key(b)
    assert 0 <= image_key(a) < 2 ** 63
    assert image_key(PreparedImage(a.pixels, (1, 8, 10), a.num_tokens)) != image_key(a)      # the grid counts


def test_text_model_has_no_image_processor(tiny_hf_model_dir):
    bundle = load_model_bundle(str(tiny_hf_model_dir("qwen2")))
    assert bundle.image_processor is None and bundle.config.vision is None and bundle.config.mrope_section is None


# --- multimodal rotary positions ----------------------------------------------------------

def _images_in(ids: list[int], token: int, grids, merge: int = 2) -> list[ImageInput]:
    """The ImageInputs of ids' image-token runs, in order, with grids."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return [ImageInput(np.zeros(1, np.float32), g, 0, off, n) for (off, n), g in zip(runs, grids)]


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_mrope_positions_match_transformers(made, kind):
    """Text before, between and after images of different grids; an image first and one last; no image."""
    _, hf, bundle, _ = made(kind)
    cfg = hf.config
    token, start, end = cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id
    grids = [(1, 8, 14), (1, 4, 4), (1, 10, 6)]
    image = lambda g: [start] + [token] * (g[0] * g[1] * g[2] // 4) + [end]          # noqa: E731
    prompts = [
        [7, 8, 9] + image(grids[0]) + [10, 11] + image(grids[1]) + [12] + image(grids[2]) + [13, 14, 15],
        image(grids[2]) + [30, 31] + image(grids[0]),
        [40, 41, 42, 43],
    ]
    used = [grids, [grids[2], grids[0]], []]
    for ids, gs in zip(prompts, used):
        images = _images_in(ids, token, gs)
        ours, delta = mrope_positions(ids, images, 2, start)
        input_ids = torch.tensor([ids])
        if gs:
            ref, ref_delta = hf.model.get_rope_index(input_ids, (input_ids == token).int(), torch.tensor(gs))
            np.testing.assert_array_equal(ours, ref[:, 0].numpy())
            assert delta == int(ref_delta) and delta != 0
        else:
            np.testing.assert_array_equal(ours, np.tile(np.arange(len(ids)), (3, 1)))
            assert delta == 0


def test_mrope_positions_refuse_a_run_that_does_not_fit():
    with pytest.raises(ValueError, match="does not fill"):
        mrope_positions([1, 2, 2, 3], [ImageInput(np.zeros(1, np.float32), (1, 4, 4), 0, 1, 2)], 2)


# --- the vision tower ---------------------------------------------------------------

def _hf_image_features(kind, hf, pixels, grids):
    with torch.no_grad():
        if _is_qwen(kind):
            out = hf.model.get_image_features(torch.from_numpy(np.concatenate(pixels)), torch.tensor(grids))
            return list(out.pooler_output)
        out = hf.model.get_image_features(torch.from_numpy(np.stack(pixels)),
                                          vision_feature_layer=hf.config.vision_feature_layer,
                                          vision_feature_select_strategy=hf.config.vision_feature_select_strategy)
        return list(out.pooler_output)


@pytest.mark.parametrize("kind", KINDS)
def test_encode_images_matches_transformers(made, kind):
    """Three images of different sizes (Qwen: 56 x 40, 30 x 112, 83 x 97 px -> different grids, windows cut
    at the edges for Qwen2.5-VL) in one encode_images call: each image's embeddings within 1e-5."""
    _, hf, bundle, model = made(kind)
    images = [sample_images()[i] for i in (0, 1, 3)]
    prepared = [bundle.image_processor.prepare(im) for im in images]
    if _is_qwen(kind):
        assert len({p.grid for p in prepared}) == 3
    with torch.no_grad():
        ours = model.encode_images([torch.from_numpy(p.pixels) for p in prepared], [p.grid for p in prepared])
    ref = _hf_image_features(kind, hf, [p.pixels for p in prepared], [list(p.grid) for p in prepared])
    for o, r, p in zip(ours, ref, prepared):
        assert o.shape == (p.num_tokens, 64) and o.dtype == torch.float32
        torch.testing.assert_close(o, r, rtol=0, atol=1e-5)


# --- the whole model ---------------------------------------------------------------

def _prompt(bundle, n_images: int) -> str:
    content = [{"type": "text", "text": "Look at these:"}]
    content += [{"type": "image"} for _ in range(n_images)]
    content += [{"type": "text", "text": "Which one is the quick brown fox?"}]
    return bundle.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def _forward(model, ids, positions, caches, meta, rows=None, embeds=None):
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.as_tensor(positions), caches, meta, image_rows=rows, image_embeds=embeds)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("kind", KINDS)
def test_forward_matches_transformers(made, kind):
    """A chat prompt with two images of different sizes, prefilled in two chunks (the split inside the
    first image's run) with the images' embeddings spliced in: every position's logits within 1e-4 of
    transformers'; then one decode step (plain positions: i + delta) against transformers' forward of
    the prompt and that token."""
    _, hf, bundle, model = made(kind)
    proc = bundle.image_processor
    text = _prompt(bundle, 2)
    assert text.count(proc.image_token) == 2
    prepared = [proc.prepare(im) for im in (sample_images()[1], sample_images()[0])]
    ids, offsets = proc.expand(bundle.tokenizer.encode(text), prepared)
    images = [ImageInput(p.pixels, p.grid, image_key(p), off, p.num_tokens) for p, off in zip(prepared, offsets)]
    with torch.no_grad():
        embeds = model.encode_images([torch.from_numpy(p.pixels) for p in prepared], [p.grid for p in prepared])
    if model.uses_mrope:
        positions, delta = mrope_positions(ids, images, model.spatial_merge_size, model.vision_start_token_id)
    else:
        positions, delta = np.arange(len(ids)), 0

    cfg, bs, n = bundle.config, 4, len(ids)
    table = list(range((n + 1 + bs - 1) // bs))
    caches = [tuple(torch.zeros(len(table), bs, cfg.num_kv_heads, cfg.head_dim) for _ in "kv")
              for _ in range(cfg.num_layers)]
    split = offsets[0] + 3                                  # the first chunk ends inside the first image's run
    logits = []
    for lo, hi in ((0, split), (split, n)):
        meta = AttentionMetadata.build(bs, 0, [hi - lo], [hi], list(range(lo, hi)), [table], "cpu")
        rows, parts = [], []
        for image, emb in zip(images, embeds):
            a, b = max(lo, image.offset), min(hi, image.offset + image.length)
            if a < b:
                rows.append(torch.arange(a - lo, b - lo))
                parts.append(emb[a - image.offset:b - image.offset])
        pos = positions[..., lo:hi]
        logits.append(_forward(model, ids[lo:hi], pos, caches, meta, torch.cat(rows), torch.cat(parts)))
    logits = torch.cat(logits)

    inputs = _hf_inputs(kind, hf, ids, prepared)
    with torch.no_grad():
        ref = hf(**inputs).logits[0]
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)

    nxt = int(ref[-1].argmax())
    meta = AttentionMetadata.build(bs, 1, [1], [n + 1], [n], [table], "cpu")
    step = _forward(model, [nxt], [n + delta], caches, meta)
    with torch.no_grad():
        ref_step = hf(**_hf_inputs(kind, hf, ids + [nxt], prepared)).logits[0, -1]
    torch.testing.assert_close(step[0], ref_step, rtol=0, atol=1e-4)


def _hf_inputs(kind, hf, ids, prepared) -> dict:
    input_ids = torch.tensor([ids])
    if _is_qwen(kind):
        return dict(input_ids=input_ids, pixel_values=torch.from_numpy(np.concatenate([p.pixels for p in prepared])),
                    image_grid_thw=torch.tensor([p.grid for p in prepared]),
                    mm_token_type_ids=(input_ids == hf.config.image_token_id).int())
    return dict(input_ids=input_ids, pixel_values=torch.from_numpy(np.stack([p.pixels for p in prepared])))


# --- loading -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["qwen2_vl", "llava"])
def test_transformers5_names_load_alike(made, kind):
    """transformers 5's in-memory names (model.language_model.*, model.visual.* / model.vision_tower.*,
    model.multi_modal_projector.*) fill the same model as the saved files' older names."""
    _, hf, bundle, model = made(kind)
    state = hf.state_dict()
    assert any(k.startswith("model.language_model.") for k in state)
    other = build_model(types.SimpleNamespace(config=bundle.config, hf_config=bundle.hf_config, weight_format="safetensors",
                                              weights=lambda: iter(state.items()), source="state_dict"), CPU, torch.float32)
    ours = dict(model.named_parameters())
    for name, p in other.named_parameters():
        torch.testing.assert_close(p, ours[name], rtol=0, atol=0)


@pytest.mark.parametrize("name, ours", [
    ("model.language_model.layers.0.mlp.up_proj.weight", "layers.0.mlp.up_proj.weight"),
    ("language_model.model.norm.weight", "norm.weight"),
    ("language_model.lm_head.weight", "lm_head.weight"),
    ("model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.q_proj.bias"),     # CausalLM strips model.
    ("model.visual.blocks.0.attn.qkv.weight", "visual.blocks.0.attn.qkv.weight"),
    ("visual.merger.mlp.0.bias", "visual.merger.mlp.0.bias"),
    ("vision_tower.vision_model.encoder.layers.3.mlp.fc1.weight", "vision_tower.encoder.layers.3.mlp.fc1.weight"),
    ("model.vision_tower.embeddings.class_embedding", "vision_tower.embeddings.class_embedding"),
    ("model.multi_modal_projector.linear_2.bias", "multi_modal_projector.linear_2.bias"),
])
def test_checkpoint_names(name, ours):
    """Both layouts' names (transformers 5's, and the older shipped checkpoints': llava-1.5-hf's vision_model)."""
    assert checkpoint_name(name) == ours


def test_checkpoint_files_are_read(made):
    """config.json's text_config and vision_config, the chat template (Qwen's chat_template.jinja, LLaVA's
    chat_template.json, end-of-turn stops), preprocessor_config.json, the image tokens' spellings."""
    for kind, token, template_has in (("qwen2_vl", "<|image_pad|>", "<|vision_start|>"),
                                      ("llava", "<image>", "ASSISTANT:")):
        path, hf, bundle, _ = made(kind)
        assert bundle.config.architecture == type(hf).__name__
        assert bundle.config.hidden_size == 64 and bundle.config.num_layers == 2
        assert bundle.image_processor.image_token == token
        assert bundle.image_processor.image_token_id == bundle.tokenizer.token_to_id(token) == bundle.config.vision.image_token_id
        assert template_has in bundle.tokenizer.chat_template
        assert _prompt(bundle, 3).count(token) == 3
    assert (made("llava")[0] / "chat_template.json").is_file() and not (made("llava")[0] / "chat_template.jinja").exists()
    qwen = made("qwen2_vl")[2]
    assert qwen.config.mrope_section == (2, 3, 3) and qwen.config.attention_bias
    assert qwen.tokenizer.token_to_id("<|im_end|>") in qwen.tokenizer.eos_token_ids


def test_dummy_weights(made):
    """dummy:<config.json> of a vision-language checkpoint: random weights, the processor beside it."""
    path = made("qwen2_5_vl")[0]
    bundle = load_model_bundle(f"dummy:{path / 'config.json'}")
    model = build_model(bundle, CPU, torch.float32)
    prepared = bundle.image_processor.prepare(sample_images()[0])
    with torch.no_grad():
        (out,) = model.encode_images([torch.from_numpy(prepared.pixels)], [prepared.grid])
    assert out.shape == (prepared.num_tokens, 64) and torch.isfinite(out).all()


def test_quantized_decoder(made):
    """int8 quantizes the decoder's linears and embedding; the tower stays float and still feeds it."""
    from jobrunner.engine.quant import quantize_model

    path, _, bundle, _ = made("qwen2_vl")
    model = quantize_model(build_model(bundle, CPU, torch.float32), "int8", bundle)
    prepared = bundle.image_processor.prepare(sample_images()[0])
    with torch.no_grad():
        (embeds,) = model.encode_images([torch.from_numpy(prepared.pixels)], [prepared.grid])
    assert embeds.dtype == torch.float32 and embeds.shape == (prepared.num_tokens, 64)


def test_flat_qwen2_vl_config():
    """Older Qwen2-VL config.json: the decoder's keys at the top level, rope_scaling of type mrope, in_chans."""
    flat = {"architectures": ["Qwen2VLForConditionalGeneration"], "vocab_size": 384, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "tie_word_embeddings": True, "image_token_id": 322, "vision_start_token_id": 320,
            "vision_config": {"depth": 2, "embed_dim": 32, "mlp_ratio": 2, "num_heads": 4, "in_chans": 3,
                              "hidden_size": 64, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2}}
    cfg = ModelConfig.from_hf(flat)
    assert cfg.rope_scaling is None and cfg.rope_theta == 1e6 and cfg.mrope_section == (2, 3, 3)
    assert cfg.tie_word_embeddings and cfg.attention_bias and cfg.vision.hidden_size == 32
    assert cfg.vision.intermediate_size == 64 and cfg.vision.vision_start_token_id == 320


def test_unsupported_llava_decoder():
    cfg = {"architectures": ["LlavaForConditionalGeneration"], "text_config": {"model_type": "gemma2"},
           "vision_config": {}}
    with pytest.raises(ValueError, match="gemma2"):
        ModelConfig.from_hf(cfg)
