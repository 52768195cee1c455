"""Decode steps through the CUDA-graph path: bucketed batch sizes, static buffers, padding rows.

On CPU the same padded static-buffer path runs eagerly (capture=False), so bucketing and padding
are checked everywhere; on a GPU the graphs are captured and replayed for real.
"""
import pytest

from jobrunner.engine.run.cuda_graphs import batch_buckets
from jobrunner.engine.api.request import Request, SamplingParams
from tests.kernel_cases import cuda_only
from tests.tiny import engine_for, hf_model, prompts


def test_buckets_cover_every_batch_size_with_bounded_padding():
    for max_batch in (1, 5, 16, 100, 256, 1000):
        b = batch_buckets(max_batch)
        assert b == sorted(set(b)) and b[0] == 1 and b[-1] == max_batch
        for n in range(1, max_batch + 1):
            bucket = next(x for x in b if x >= n)
            assert bucket - n <= max(15, n // 8)      # padding: at most 15 rows, or an eighth of a big batch


def _outputs(engine, batch, n=20, **params):
    p = SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0, **params)
    outs = engine.generate([Request(str(i), ids, p) for i, ids in enumerate(batch)])
    return [(o.token_ids, [round(lp.logprob, 4) for lp in o.completions[0].logprobs]) for o in outs]


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(max_num_batched_tokens=7, block_size=4),                   # many chunks, long block tables
    dict(kv_cache_memory=2 * 2 * 2 * 16 * 16 * 4 * 12),            # 12 blocks: preemption mid-decode
])
def test_padded_decode_path_matches_eager(overrides):
    model = hf_model("llama")
    batch = prompts(5, lengths=(9, 30, 3, 21, 14, 6, 40))           # 7 decodes -> bucket 8 (one padding row)
    eager = engine_for(model, **overrides)
    graphed = engine_for(model, **overrides)
    graphed.runner.enable_graphs(max_batch=8, max_model_len=graphed.max_model_len, capture=False)
    assert _outputs(graphed, batch) == _outputs(eager, batch)
    assert graphed.runner.graphs.replays > 0
    # seeded sampling too: padding rows never shift a row's random stream
    assert _outputs(graphed, batch, temperature=0.8, seed=3) == _outputs(eager, batch, temperature=0.8, seed=3)


def test_batches_larger_than_the_graphs_run_eagerly():
    model = hf_model("qwen2")
    batch = prompts(6, lengths=(5, 8, 11, 3, 7))
    engine = engine_for(model)
    engine.runner.enable_graphs(max_batch=2, max_model_len=engine.max_model_len, capture=False)
    ref = _outputs(engine_for(model), batch, 6)
    assert _outputs(engine, batch, 6) == ref


@cuda_only[0]
@cuda_only[1]
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_graphs_replay_exactly_on_cuda(dtype):
    """Replays equal the same padded batches run eagerly, bit for bit; and, in float32, the
    tokens equal the unpadded eager engine's."""
    model = hf_model("llama")
    batch = prompts(7, lengths=(9, 30, 3, 21, 14, 6, 40, 2, 17))
    kw = dict(device="cuda", dtype=dtype, kv_cache_memory=64 * 2**20, max_num_seqs=16)
    graphed = engine_for(model, cuda_graphs=True, **kw)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.capture
    emulated = engine_for(model, cuda_graphs=False, **kw)
    emulated.runner.enable_graphs(max_batch=16, max_model_len=emulated.max_model_len, capture=False)
    got = _outputs(graphed, batch, 24)
    assert graphed.runner.graphs.replays > 0
    assert got == _outputs(emulated, batch, 24)
    if dtype == "float32":
        eager = engine_for(model, cuda_graphs=False, **kw)
        assert [t for t, _ in got] == [t for t, _ in _outputs(eager, batch, 24)]
