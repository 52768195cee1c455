"""--deterministic (issue 61) over a mixture of experts and a vision-language model, on CPU: a row's tokens and
logprobs are the same bits under every schedule (max_num_seqs 1 and the default, a token budget small enough
to chunk every prompt, 1 and 2 threads); the default mode differs somewhere; greedy output still matches
transformers. Op by op: the expert matmuls over however many tokens a step routes to an expert follow the
batch in the default form and not in the packed invariant one; the combine keeps index_add_'s order and bits;
an image's tower output is its own whatever images share the call. The dense families: tests/test_determinism.py.
"""
from __future__ import annotations

import pytest
import torch

from conftest import TINY_VOCAB, save_tiny_tokenizer
from jobrunner.engine import Engine, EngineConfig, ImageInput, Request, SamplingParams, image_key
from jobrunner.engine.load.loader import load_model_bundle
from jobrunner.engine.models.moe import Experts
from jobrunner.engine.run.packed_weights import pack_experts
from jobrunner.engine.run.runtime import build_runtime
from jobrunner.kernels.ops import PackedLinear, fused_moe_ref, moe_by_expert, packing_available, route_topk
from tests.tiny import hf_greedy, prompts
from vision_checkpoints import checkpoint, sample_images

pytestmark = pytest.mark.skipif(not packing_available(), reason="no oneDNN in this torch")

SCHEDULES = {
    "defaults": {"num_threads": 2},                 # max_num_seqs and the token budget the defaults
    "seqs-1": {"max_num_seqs": 1},
    "chunked": {"max_num_batched_tokens": 8},       # every prompt in several chunks
    "threads-1": {"num_threads": 1},
}
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
# Qwen2-MoE: its shared expert, and (norm_topk_prob, 3 of 8 experts) a renormalized routing sum of three terms
MOE = dict(model_type="qwen2_moe", vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
           bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1, tie_word_embeddings=False,
           num_experts=8, num_experts_per_tok=3, moe_intermediate_size=40, shared_expert_intermediate_size=56,
           norm_topk_prob=True)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(the transformers model, its checkpoint directory)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(**MOE)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("tiny-moe")
    hf.save_pretrained(str(path))
    save_tiny_tokenizer(path)
    hf.generation_config.eos_token_id = None
    return hf, path


_CHECKPOINTS: dict = {}


def _vl_checkpoint(kind: str, tmp_path_factory):
    if kind not in _CHECKPOINTS:
        path, hf = checkpoint(kind, tmp_path_factory.mktemp(kind))
        _CHECKPOINTS[kind] = str(path), hf
    return _CHECKPOINTS[kind]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    return _vl_checkpoint("qwen2_vl", tmp_path_factory)


@pytest.fixture(scope="module", params=["qwen2_vl", "llava"])
def tower(request, tmp_path_factory):
    return (request.param, *_vl_checkpoint(request.param, tmp_path_factory))


def _engine(path, **kw) -> Engine:
    cfg = EngineConfig(**({"model": str(path), "device": "cpu", "kv_cache_memory": 8 * 2**20} | kw))
    return Engine(cfg, build_runtime(cfg, load_model_bundle(str(path))))


def _bits(outs) -> list:
    """Each row's tokens, and its logprobs and top logprobs as exact floats."""
    return [(o.token_ids, [(t.token_id, t.logprob, t.top) for t in o.completions[0].logprobs]) for o in outs]


def _runs(path, requests, invariant: bool, names=tuple(SCHEDULES)) -> dict[str, list]:
    out = {}
    for name in names:
        with _engine(path, batch_invariant=invariant, **SCHEDULES[name]) as engine:
            assert engine.info.batch_invariant is invariant
            out[name] = _bits(engine.generate(requests()))
    return out


def _moe_requests():
    base = prompts(7, lengths=(24,))[0]
    batch = [base + tail for tail in prompts(8, lengths=(9, 3, 17))] + prompts(9, lengths=(30, 2, 41))
    return [Request(str(i), ids, PARAMS) for i, ids in enumerate(batch)]


def test_moe_rows_are_the_same_bits_under_every_schedule_and_the_default_differs(moe):
    _, path = moe
    with _engine(path, batch_invariant=True) as engine:         # the experts packed, every shape checked
        experts = [m for m in engine.rt.model.modules() if isinstance(m, Experts)]
        assert experts and all(isinstance(m.packed[0][0], PackedLinear) and m.packed[0][0].min_rows == 2
                               for m in experts)
    runs = _runs(path, _moe_requests, True)
    for name, got in runs.items():
        assert got == runs["defaults"], name
    default = _runs(path, _moe_requests, False, ("defaults", "chunked"))
    assert any(got != default["defaults"] for got in default.values())


def test_moe_greedy_output_still_matches_transformers(moe):
    hf, path = moe
    batch = [r.prompt_token_ids for r in _moe_requests()[:3]]
    with _engine(path, batch_invariant=True, max_num_batched_tokens=16) as engine:
        outs = engine.generate([Request(str(i), ids, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0))
                                for i, ids in enumerate(batch)])
    for ids, out in zip(batch, outs):
        tokens, lps = hf_greedy(hf, ids, 12)
        assert out.token_ids == tokens
        assert max(abs(a.logprob - b) for a, b in zip(out.completions[0].logprobs, lps)) < 1e-4


def _experts(hidden=64, inter=48, num=8, seed=0) -> Experts:
    torch.manual_seed(seed)
    m = Experts(num, hidden, inter)
    with torch.no_grad():
        m.w13.normal_(0, 0.05)
        m.w2.normal_(0, 0.05)
    return m


def test_an_expert_matmul_follows_the_batch_and_its_invariant_form_does_not():
    """A token's MoE output alone and among 63 others (the experts' runs other lengths): the stacked
    experts (MKL over each run) give other bits; packed in the invariant form, the same bits at 1 and 2
    threads."""
    m = _experts()
    x = torch.randn(64, 64)
    w, ids = route_topk(torch.randn(64, 8), 2, True)
    with torch.inference_mode():
        full = fused_moe_ref(x, m.w13, m.w2, w, ids)
        alone = torch.cat([fused_moe_ref(x[i:i + 1], m.w13, m.w2, w[i:i + 1], ids[i:i + 1]) for i in range(64)])
        assert not torch.equal(full, alone)
        holder = torch.nn.Module()
        holder.experts = m
        pack_experts(holder, set())
        assert m.packed is not None and not hasattr(m, "w13")
        want = torch.cat([m(x[i:i + 1], w[i:i + 1], ids[i:i + 1]) for i in range(64)])
        for threads in (1, 2):
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                assert torch.equal(m(x, w, ids), want), threads
                assert torch.equal(m(x[5:42], w[5:42], ids[5:42]), want[5:42]), threads
            finally:
                torch.set_num_threads(before)
        torch.testing.assert_close(want, full, atol=1e-5, rtol=1e-4)       # float rounding, not another result


def test_the_fixed_combine_keeps_index_adds_order_and_the_routing_sum_its_value():
    """combine_in_expert_order adds a token's k results in ascending expert order from zero: index_add_'s
    bits over the sorted slots; the fixed-order routing sum is the sum (k = 3, so its order shows)."""
    m = _experts(hidden=64, inter=40, seed=1)
    x = torch.randn(33, 64)
    w, ids = route_topk(torch.randn(33, 8), 3, True)

    def expert(e, rows):
        h = rows @ m.w13[e]
        return torch.nn.functional.silu(h[:, :40]) * h[:, 40:] @ m.w2[e]
    with torch.inference_mode():
        assert torch.equal(moe_by_expert(x, w, ids, 8, expert), moe_by_expert(x, w, ids, 8, expert, fixed_order=True))
        logits = torch.randn(33, 8)
        fixed, fixed_ids = route_topk(logits, 3, True, fixed_order=True)
        plain, plain_ids = route_topk(logits, 3, True)
    assert torch.equal(fixed_ids, plain_ids)
    torch.testing.assert_close(fixed, plain, atol=1e-7, rtol=0)
    with pytest.raises(ValueError, match="foreign"):
        moe_by_expert(x, w, ids, 8, expert, foreign=True, fixed_order=True)


def _vl_requests(engine: Engine):
    pics = sample_images()
    proc = engine.image_processor
    rows = [("one", [pics[0]]), ("none", []), ("three", [pics[4], pics[5], pics[2]]), ("again", [pics[0]])]
    out = []
    for rid, images in rows:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": f"describe {rid}"}]
        ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": content}]))
        prepared = [proc.prepare(im) for im in images]
        ids, offsets = proc.expand(ids, prepared)
        inputs = tuple(ImageInput(p.pixels, p.grid, image_key(p), o, p.num_tokens) for p, o in zip(prepared, offsets))
        out.append(Request(rid, ids, PARAMS, images=inputs))
    return out


def test_vision_rows_are_the_same_bits_under_every_schedule_and_the_default_differs(vl):
    path, _ = vl
    with _engine(path) as engine:
        requests = _vl_requests(engine)
    runs = _runs(path, lambda: requests, True)
    for name, got in runs.items():
        assert got == runs["defaults"], name
    default = _runs(path, lambda: requests, False, ("defaults", "chunked"))
    assert any(got != default["defaults"] for got in default.values())


@torch.no_grad()
def _hf_greedy(hf, kind: str, request: Request, n: int) -> list[int]:
    """transformers' greedy continuation of a row, recomputed whole each step (test_engine_images's inputs)."""
    images, seq = request.images, list(request.prompt_token_ids)
    for _ in range(n):
        kw = {}
        if images and kind == "llava":
            kw = {"pixel_values": torch.stack([torch.from_numpy(im.pixels) for im in images])}
        elif images:
            types = torch.zeros(1, len(seq), dtype=torch.int32)
            for im in images:
                types[0, im.offset:im.offset + im.length] = 1
            kw = {"pixel_values": torch.cat([torch.from_numpy(im.pixels) for im in images]),
                  "image_grid_thw": torch.tensor([im.grid for im in images]), "mm_token_type_ids": types}
        seq.append(int(hf(input_ids=torch.tensor([seq]), **kw).logits[0, -1].argmax()))
    return seq[len(request.prompt_token_ids):]


def test_an_images_tower_output_is_its_own_whatever_shares_the_step(tower):
    """In the invariant mode each image goes through the tower alone: its embeddings are the bits it gets
    alone, beside other images (in another order) and at 1 thread; the tower over the images together
    (the default) gives other bits for LLaVA (a batched attention over same-size images); greedy tokens
    still match transformers."""
    kind, path, hf = tower
    with _engine(path, batch_invariant=True) as engine:
        requests = _vl_requests(engine)
        store = engine.runner.image_embeds
        images = [im for r in requests for im in r.images]
        with torch.inference_mode():
            together = store._encode(images)
            alone = [store._encode([im])[0] for im in images]
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                reversed_ = store._encode(images[::-1])[::-1]
            finally:
                torch.set_num_threads(before)
            batched = engine.rt.model.encode_images([torch.from_numpy(im.pixels) for im in images],
                                                    [im.grid for im in images])
        assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(together, alone, reversed_))
        if kind == "llava":
            assert not all(torch.equal(a, b) for a, b in zip(batched, alone))
        outs = engine.generate([Request(r.id, r.prompt_token_ids, SamplingParams(max_tokens=4, ignore_eos=True),
                                        images=r.images) for r in requests])
    for out, r in zip(outs, requests):
        assert out.token_ids == _hf_greedy(hf, kind, r, 4), r.id
