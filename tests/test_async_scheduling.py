"""Async scheduling: step k+1 is scheduled and launched before step k's samples are read.

The outputs must equal the synchronous engine's for every feature (the engine's order of work
changes, never a token); the runner must launch a step before it waits for the one before;
blocks that end in a placeholder are hashed for the prefix cache once their token is known.
"""
import pytest

from jobrunner.engine.api.request import Request, SamplingParams
from jobrunner.engine.schedule.sequence import PLACEHOLDER, Sequence
from tests.kernel_cases import cuda_only
from tests.tiny import engine_for, forbid_launch_syncs, hf_model, prompts

TWELVE_BLOCKS = 2 * 2 * 2 * 16 * 16 * 4 * 12     # KV bytes of 12 blocks of the tiny llama: preemption


@pytest.fixture(scope="module")
def model():
    return hf_model("llama")


def _requests(stop_at: list[int]) -> list[Request]:
    """Every kind of request at once: greedy with varied lengths and stops, seeded sampling with
    filters, n > 1, logprobs, prompt logprobs, scoring and candidates."""
    batch = prompts(21, lengths=(9, 30, 3, 21, 14, 6, 40, 17))
    greedy = lambda length, **kw: SamplingParams(max_tokens=length, ignore_eos=True, **kw)
    return [
        Request("greedy", batch[0], greedy(24, logprobs=2)),
        Request("short", batch[1], greedy(1)),
        Request("stop-token", batch[2], greedy(20, stop_token_ids=tuple(stop_at))),
        Request("sampled", batch[3], greedy(16, temperature=0.8, top_p=0.9, top_k=40, seed=5, logprobs=1)),
        Request("n3", batch[4], greedy(7, temperature=1.0, min_p=0.02, seed=9, n=3)),
        Request("prompt-lp", batch[5], greedy(5, prompt_logprobs=True)),
        Request("score", batch[6], SamplingParams(max_tokens=0), score_from=12),
        Request("classify", batch[7], SamplingParams(max_tokens=0), candidates=[[5], [7, 8, 9], [7, 8, 11]]),
    ]


def _summary(out):
    r = lambda xs: None if xs is None else [round(x, 4) for x in xs]
    return (out.id, out.error, out.prompt_tokens, r(out.prompt_logprobs),
            None if out.candidate_logprobs is None else [r(c) for c in out.candidate_logprobs],
            [(c.index, c.token_ids, c.finish_reason,
              None if c.logprobs is None else [(lp.token_id, round(lp.logprob, 4), len(lp.top)) for lp in c.logprobs])
             for c in out.completions])


def _stop_tokens(model) -> list[int]:
    free = engine_for(model).generate(_requests([]))[2].token_ids
    return [free[6]]


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(max_num_batched_tokens=7, block_size=4),        # prefill in many small chunks, long block tables
    dict(kv_cache_memory=TWELVE_BLOCKS),                  # preemption while a step is in flight
    dict(max_num_seqs=3),
    dict(enable_prefix_caching=False),
], ids=["default", "chunked", "preemption", "few-seqs", "no-prefix-cache"])
def test_outputs_equal_the_synchronous_engine(model, overrides):
    stop_at = _stop_tokens(model)
    sync = engine_for(model, async_scheduling=False, **overrides).generate(_requests(stop_at))
    engine = engine_for(model, async_scheduling=True, **overrides)
    outs = engine.generate(_requests(stop_at))
    assert [_summary(o) for o in outs] == [_summary(o) for o in sync]
    assert outs[2].finish_reason == "stop" and outs[0].finish_reason == "length"
    assert not engine.has_unfinished() and engine.num_in_flight == 0 and not engine.scheduler.running
    assert engine.kv.pool.num_free == engine.rt.num_blocks          # every block came back


def test_graph_path_takes_placeholder_ids_on_the_device(model):
    batch = prompts(5, lengths=(9, 30, 3, 21, 14, 6, 40))
    p = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.7, seed=2)
    ref = engine_for(model, async_scheduling=False).generate([Request(str(i), ids, p) for i, ids in enumerate(batch)])
    engine = engine_for(model)
    engine.runner.enable_graphs(max_batch=8, max_model_len=engine.max_model_len, capture=False)
    outs = engine.generate([Request(str(i), ids, p) for i, ids in enumerate(batch)])
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert engine.runner.graphs.replays > 10


def test_each_step_is_launched_before_the_previous_is_waited_for(model):
    engine = engine_for(model)
    events = []
    launch, collect = engine.runner.launch, engine.runner.collect

    def logged_launch(sched):
        step = launch(sched)
        events.append(("launch", id(step)))
        return step

    def logged_collect(step):
        events.append(("collect", id(step)))
        return collect(step)

    engine.runner.launch, engine.runner.collect = logged_launch, logged_collect
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.generate([Request(str(i), ids, p) for i, ids in enumerate(prompts(2))])
    launches = [i for kind, i in events if kind == "launch"]
    collects = [i for kind, i in events if kind == "collect"]
    assert len(launches) > 12 and set(collects) <= set(launches)
    for step in collects[:-1]:
        # when step k is waited for, step k+1 has been launched already
        assert events.index(("launch", launches[launches.index(step) + 1])) < events.index(("collect", step))


def test_wasted_work_is_one_token_per_stop(model):
    stop_at = _stop_tokens(model)
    counts = {}
    for mode in (False, True):
        engine = engine_for(model, async_scheduling=mode)
        outs = engine.generate(_requests(stop_at))
        counts[mode] = engine.counters().tokens_computed
        stopped = sum(c.finish_reason == "stop" for o in outs if o.id == "stop-token" for c in o.completions)
    # a sequence that stops at step k computed one token in step k+1; a length stop costs nothing
    assert 0 <= counts[True] - counts[False] <= stopped


def test_generated_blocks_are_hashed_once_their_tokens_are_known(model):
    engine = engine_for(model, block_size=4)
    prompt = prompts(8, lengths=(10,))[0]
    out = engine.generate([Request("a", prompt, SamplingParams(max_tokens=30, ignore_eos=True))])[0]
    tokens = prompt + out.token_ids
    pool = engine.kv.pool
    assert all(PLACEHOLDER not in b.tokens for b in pool.blocks)
    computed_full = (len(tokens) - 1) // 4          # the last sampled token never ran through the model
    chain = engine.kv._hash_chain(Sequence("a", tokens, len(prompt), SamplingParams()), computed_full)
    assert all(h in pool.by_hash for h in chain)
    # a prompt that continues the completion finds all of it in the cache
    again = engine.generate([Request("b", tokens[:-1] + [3], SamplingParams(max_tokens=1))])[0]
    assert again.cached_tokens == computed_full * 4


def test_prompt_logprobs_survive_preemption(model):
    """Recomputed prompt tokens after a preemption are scored again; each position keeps one value
    (they were once appended a second time)."""
    batch = prompts(3, lengths=(40, 40, 40, 35))
    reqs = lambda: [Request(str(i), ids, SamplingParams(max_tokens=30, ignore_eos=True, prompt_logprobs=True))
                    for i, ids in enumerate(batch)]
    ref = engine_for(model).generate(reqs())
    for mode in (False, True):
        engine = engine_for(model, kv_cache_memory=TWELVE_BLOCKS, max_num_batched_tokens=16, async_scheduling=mode)
        outs = engine.generate(reqs())
        assert engine.counters().preemptions > 0
        assert [len(o.prompt_logprobs) for o in outs] == [len(ids) - 1 for ids in batch]
        for o, r in zip(outs, ref):
            assert o.token_ids == r.token_ids
            assert max(abs(a - b) for a, b in zip(o.prompt_logprobs, r.prompt_logprobs)) < 1e-5


@cuda_only[0]
@cuda_only[1]
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_on_cuda_launch_never_waits_for_the_device(cuda_graphs):
    """The point of async scheduling: launch() enqueues work without a host sync (a blocking copy,
    .item(), .tolist() would wait for the step in flight). torch's sync debug mode turns any such
    call into an error. Outputs equal the synchronous engine's (float32)."""
    model = hf_model("llama")
    kw = dict(device="cuda", dtype="float32", kv_cache_memory=64 * 2**20, max_num_seqs=16, cuda_graphs=cuda_graphs)
    stop_at = _stop_tokens(model)
    ref = engine_for(model, async_scheduling=False, **kw).generate(_requests(stop_at))
    engine = engine_for(model, **kw)
    engine.generate(_requests(stop_at))               # compiles every kernel first
    forbid_launch_syncs(engine)
    outs = engine.generate(_requests(stop_at))
    assert [_summary(o) for o in outs] == [_summary(o) for o in ref]


def _random_requests(rng, stop_at) -> list[Request]:
    reqs = []
    for i in range(rng.randint(1, 9)):
        prompt = [rng.randrange(1, 320) for _ in range(rng.randint(1, 45))]
        kind = rng.choice(["greedy", "greedy", "sampled", "n", "score", "classify", "prompt-lp"])
        base = dict(max_tokens=rng.randint(1, 20), ignore_eos=True, stop_token_ids=tuple(rng.sample(stop_at, 1)))
        if kind == "greedy":
            p = SamplingParams(**base, logprobs=rng.choice([None, 0, 2]))
        elif kind == "sampled":
            p = SamplingParams(**base, temperature=rng.choice([0.5, 1.0]), top_p=rng.choice([1.0, 0.8]),
                               top_k=rng.choice([0, 20]), seed=rng.randint(0, 9))
        elif kind == "n":
            p = SamplingParams(**base, temperature=1.0, seed=rng.randint(0, 9), n=rng.randint(2, 3))
        elif kind == "prompt-lp":
            p = SamplingParams(**base, prompt_logprobs=True)
        else:
            p = SamplingParams(max_tokens=0)
        if kind == "score" and len(prompt) > 2:
            reqs.append(Request(f"r{i}", prompt, p, score_from=rng.randint(1, len(prompt) - 1)))
        elif kind == "classify":
            cands = [[rng.randrange(1, 320) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(1, 3))]
            reqs.append(Request(f"r{i}", prompt, p, candidates=cands))
        elif kind not in ("score", "classify"):
            reqs.append(Request(f"r{i}", prompt, p))
    return reqs


@pytest.mark.parametrize("seed", [*range(10), 34, 51])    # 34 and 51 preempt (300 seeds passed once, 21 preempting)
def test_random_mixes_equal_the_synchronous_engine(model, seed):
    """Random requests of every kind under random batch limits, block sizes and cache sizes
    (small enough to preempt): async and synchronous engines give the same outputs."""
    import random
    rng = random.Random(seed)
    overrides = dict(block_size=rng.choice([1, 2, 4, 16]), max_num_seqs=rng.choice([1, 2, 3, 8, 64]),
                     max_num_batched_tokens=rng.choice([4, 7, 16, 64, 256]),
                     enable_prefix_caching=rng.random() < 0.8)
    overrides["kv_cache_memory"] = rng.choice([TWELVE_BLOCKS // 2, TWELVE_BLOCKS, 2 * TWELVE_BLOCKS, 4 * 2**20])
    stop_at = [rng.randrange(1, 320) for _ in range(4)]
    reqs = _random_requests(rng, stop_at)
    engines = {mode: engine_for(model, async_scheduling=mode, **overrides) for mode in (False, True)}
    if rng.random() < 0.5:                   # decode steps through the padded CUDA-graph path
        engines[True].runner.enable_graphs(max_batch=8, max_model_len=engines[True].max_model_len, capture=False)
    outs = {mode: engine.generate(reqs) for mode, engine in engines.items()}
    assert [_summary(o) for o in outs[True]] == [_summary(o) for o in outs[False]]
