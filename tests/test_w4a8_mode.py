"""`--quantization w4a8` (engine/quant: W4A8Linear): int4's weights times int8 activations on the CPU w4a8 kernel
(kernels/matmul/cpu_w4a8.*, its own tests in test_cpu_w4a8.py). Here: the mode's modules and weights (int4 mode's,
GGUF Q4 blocks as shipped), layer by layer the kernel against the reference arithmetic on the model's real
activations, greedy tokens with the kernel and without it, the refusals, and a job through the CLI."""
from __future__ import annotations

import pytest
import torch

from jobrunner.engine.api.request import Request, SamplingParams
from jobrunner.engine.config.engine_config import ConfigError, EngineConfig
from jobrunner.engine.core.engine import Engine
from jobrunner.engine.quant import Int4Linear, check_quantization, parse_scheme
from jobrunner.engine.quant.linear import W4A8Linear
from jobrunner.kernels.matmul import cpu_w4a8 as cw

PROMPTS = ([5, 6, 7, 8], [11, 200, 3, 3, 64, 90, 17], [9] * 20, [1, 2])


def _engine(model, monkeypatch, kernel="auto", **config) -> Engine:
    monkeypatch.setenv("JOBRUNNER_CPU_W4A8", kernel)
    return Engine(EngineConfig(model=str(model), dtype="float32", kv_cache_memory=4 * 2**20, **config))


def _greedy(engine) -> list[list[int]]:
    reqs = [Request(str(i), p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]
    outs = {o.id: o.token_ids for o in engine.generate(reqs)}
    return [outs[str(i)] for i in range(len(reqs))]


def _w4a8(engine) -> list[W4A8Linear]:
    return [m for m in engine.rt.model.modules() if isinstance(m, W4A8Linear)]


def test_the_mode_holds_int4_modes_weights_and_runs_the_kernel(tiny_hf_model_dir, monkeypatch):
    path = tiny_hf_model_dir("llama")
    w4a8 = _engine(path, monkeypatch, quantization="w4a8")
    int4 = _engine(path, monkeypatch, quantization="int4")
    mods = _w4a8(w4a8)
    assert len(mods) == 4 * 2 and all(m.kernel_weights is not None and m.cpu_kernel is not None for m in mods)
    assert all(type(m.cpu_kernel) is cw.W4A8Library for m in mods)
    int4_mods = {n: m for n, m in int4.rt.model.named_modules() if type(m) is Int4Linear}
    for name, m in w4a8.rt.model.named_modules():
        if isinstance(m, W4A8Linear):
            assert torch.equal(m.dequantize(), int4_mods[name].dequantize()), name     # the same int4 weights
    assert w4a8.rt.weight_bytes <= int4.rt.weight_bytes * 1.05     # repacked in place: no second copy


def test_each_layer_computes_the_reference_arithmetic_on_the_models_activations(tiny_hf_model_dir, monkeypatch):
    """Layer by layer: every w4a8 linear's kernel output against the reference (activations quantized the same
    way, exact integer sums) on the inputs the model gives it, within the kernel's documented tolerance."""
    engine = _engine(tiny_hf_model_dir("llama"), monkeypatch, quantization="w4a8")
    seen = []

    def check(module, args, out):
        ref = module.forward_ref(args[0])
        scale = ref.abs().max().clamp(min=1.0)
        assert (out - ref).abs().max() <= cw.ATOL * scale + cw.RTOL * ref.abs().max()
        seen.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])

    hooks = [m.register_forward_hook(check) for m in _w4a8(engine)]
    try:
        _greedy(engine)
    finally:
        for h in hooks:
            h.remove()
    assert seen and max(seen) > 1 and min(seen) >= 1      # prefill chunks and decode rows both checked


def _score(engine, ids) -> torch.Tensor:
    return torch.tensor(engine.generate([Request("s", ids, score_from=1)])[0].prompt_logprobs)


def test_the_kernel_scores_prompts_as_the_reference_path(tiny_hf_model_dir, monkeypatch):
    """Whole model, kernel (native and portable builds) against the reference path (JOBRUNNER_CPU_W4A8=off). Not
    greedy tokens over many steps: rounding activations to int8 is a step function, so a last-bit difference
    upstream can move one activation by a step and, on a tiny random model's flat logits, a later argmax."""
    path = tiny_hf_model_dir("llama")
    reference = _engine(path, monkeypatch, kernel="off", quantization="w4a8")
    assert all(m.cpu_kernel is None and m.kernel_weights is None for m in _w4a8(reference))
    ids = list(range(3, 60))
    want = _score(reference, ids)
    for kernel in ("auto", "portable"):
        engine = _engine(path, monkeypatch, kernel=kernel, quantization="w4a8")
        assert all(m.cpu_kernel is not None for m in _w4a8(engine))
        torch.testing.assert_close(_score(engine, ids), want, atol=2e-2, rtol=0)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_load_as_shipped(tiny_gguf_path, monkeypatch, qtype):
    """The default model's way: GGUF Q4 blocks become the w4a8 weights without a float round trip."""
    pytest.importorskip("gguf")
    path = tiny_gguf_path("llama", qtype)
    w4a8 = _engine(path, monkeypatch, quantization="w4a8")
    int4 = _engine(path, monkeypatch, quantization="int4")
    int4_mods = {n: m for n, m in int4.rt.model.named_modules() if type(m) is Int4Linear}
    mods = {n: m for n, m in w4a8.rt.model.named_modules() if isinstance(m, W4A8Linear)}
    assert mods and mods.keys() == int4_mods.keys()
    for name, m in mods.items():
        packed, scales, zeros = m.int4_buffers()
        assert torch.equal(packed, int4_mods[name].packed) and torch.equal(scales, int4_mods[name].scales), name
    first = _greedy(w4a8)
    assert all(len(t) == 12 for t in first)


def test_w4a8_parses_group_sizes_and_is_refused_off_the_cpu():
    assert parse_scheme("w4a8") == ("w4a8", 32) and parse_scheme("w4a8-g128") == ("w4a8", 128)
    with pytest.raises(ConfigError, match="w4a8 is a CPU mode"):
        check_quantization("w4a8", "cuda")
    with pytest.raises(ConfigError, match="int4 and w4a8 take a group size"):
        parse_scheme("w8a8-g64")


def test_a_w4a8_job_through_the_cli(tiny_hf_model_dir, tmp_path):
    import polars as pl
    from click.testing import CliRunner

    from jobrunner.cli.main import main
    from tests.cache_helpers import write_jsonl

    data = write_jsonl(tmp_path / "rows.jsonl", [{"id": str(i), "prompt": f"row {i} says"} for i in range(4)])
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["submit", data, "-m", str(tiny_hf_model_dir("llama")), "-o", str(out),
                                  "--quantization", "w4a8", "--max-tokens", "4", "--ignore-eos",
                                  "--kv-cache-memory", "32MB"])
    assert r.exit_code == 0, r.output
    df = pl.read_parquet(out / "part-00000.parquet")
    assert df["error"].null_count() == 4 and df["completion_tokens"].to_list() == [4] * 4


def _checked_layers(engine) -> list:
    """Forward hooks holding every w4a8 linear to its reference (the kernel's tolerance); removed by the caller."""
    def check(module, args, out):
        ref = module.forward_ref(args[0])
        assert (out - ref).abs().max() <= cw.ATOL * ref.abs().max().clamp(min=1.0) + cw.RTOL * ref.abs().max()
    return [m.register_forward_hook(check) for m in _w4a8(engine)]


@pytest.mark.parametrize("make", ["gptq-act-order", "W4A16"])
def test_a_shipped_int4_checkpoint_runs_its_own_weights_with_int8_activations(tmp_path, monkeypatch, make):
    """A shipped W4A16 / GPTQ checkpoint under --quantization w4a8: its int4 linears (act order's permuted
    ones too) become w4a8 ones over the same buffers; each holds to the reference on the model's activations,
    and the prompt scores stay near the shipped int4 model's (int8 activations on a tiny random model: about 1%
    of a token's logprob on average, measured 0.02-0.07 of ~6)."""
    pytest.importorskip("compressed_tensors")
    from quantized_checkpoints import make_compressed, make_gptq
    path = (make_gptq(tmp_path / "ckpt", "llama", bits=4, group_size=32, desc_act=True, sym=False)
            if make == "gptq-act-order" else make_compressed(tmp_path / "ckpt", "llama", "W4A16"))
    shipped = _engine(path, monkeypatch)
    w4a8 = _engine(path, monkeypatch, quantization="w4a8")
    int4 = {n: m for n, m in shipped.rt.model.named_modules() if type(m) is Int4Linear}
    mods = {n: m for n, m in w4a8.rt.model.named_modules() if isinstance(m, W4A8Linear)}
    assert int4 and mods.keys() == int4.keys() and all(m.cpu_kernel is not None for m in mods.values())
    for name, m in mods.items():
        assert torch.equal(m.dequantize(), int4[name].dequantize()), name
    hooks = _checked_layers(w4a8)
    try:
        ids = list(range(3, 60))
        got, want = _score(w4a8, ids), _score(shipped, ids)
        diff = (got - want).abs()
        assert diff.mean() < 0.02 * want.abs().mean() and diff.max() < 0.06 * want.abs().max(), diff
    finally:
        for h in hooks:
            h.remove()


def test_w4a8_refuses_a_shipped_checkpoint_without_int4_weights(tmp_path, monkeypatch):
    pytest.importorskip("compressed_tensors")
    from quantized_checkpoints import make_compressed
    path = make_compressed(tmp_path / "ckpt", "llama", "W8A16")
    with pytest.raises(ConfigError, match="w4a8 runs a checkpoint's int4 weights"):
        _engine(path, monkeypatch, quantization="w4a8")
