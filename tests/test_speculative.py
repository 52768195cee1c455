"""Speculative decoding (engine/spec): the same tokens as without it (greedy, seeded sampling, logprobs
within float tolerance), through preemption, stops and max_tokens; rejected drafts rolled back in the
KV blocks and their hashes; the switch that turns it off where it does not pay; a job's columns and
figures."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from jobrunner.cli.main import main
from jobrunner.engine.api.request import Request, SamplingParams
from jobrunner.engine.schedule.kv_manager import KVCacheManager
from jobrunner.engine.schedule.scheduler import Scheduler
from jobrunner.engine.schedule.sequence import Sequence
from jobrunner.engine.spec.ngram import NgramIndex
from jobrunner.engine.spec.switch import RowAcceptance, SpeculationSwitch
from jobrunner.output import read_results
from tests.cache_helpers import tiny_model, write_jsonl
from tests.tiny import engine_for, hf_model

N = 40


def _loops(seed: int, lengths=(5, 17, 33, 2, 48, 16, 9, 40)) -> list[list[int]]:
    """Prompts that repeat themselves: a random model falls into loops, which drafts from its own tokens catch."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 320, (n,), generator=g).tolist() * 3 for n in lengths]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf(request):
    return hf_model(request.param)


def _generate(hf, mode: str, params: SamplingParams, prompts, **engine):
    e = engine_for(hf, speculative=mode, **engine)
    outs = e.generate([Request(f"r{i}", p, params) for i, p in enumerate(prompts)])
    return outs, e.counters()


def _tokens(outs):
    return [[c.token_ids for c in o.completions] for o in outs]


def test_greedy_tokens_and_logprobs_are_the_plain_engines(hf):
    params = SamplingParams(max_tokens=N, ignore_eos=True, logprobs=2)
    plain, _ = _generate(hf, "off", params, _loops(0))
    spec, counters = _generate(hf, "ngram", params, _loops(0))
    assert _tokens(spec) == _tokens(plain)
    assert counters.accepted_tokens > 0
    for a, b in zip(plain, spec):
        for x, y in zip(a.completions[0].logprobs, b.completions[0].logprobs):
            assert abs(x.logprob - y.logprob) < 1e-5
            assert [t for t, _ in x.top] == [t for t, _ in y.top] and len(x.top) == 2
    assert sum(o.draft_tokens for o in spec) == counters.draft_tokens
    assert sum(o.accepted_tokens for o in spec) == counters.accepted_tokens


def test_seeded_sampling_draws_the_plain_engines_tokens(hf):
    """Each drafted position samples with the uniform the plain engine draws there: a right draft is kept
    exactly when the plain engine samples it (speculative sampling's rule for a draft of one certain
    token), so the tokens, not only their distribution, are the plain engine's."""
    params = SamplingParams(max_tokens=N, ignore_eos=True, temperature=0.3, top_p=0.95, seed=5, n=2)
    plain, _ = _generate(hf, "off", params, _loops(1))
    spec, counters = _generate(hf, "ngram", params, _loops(1))
    assert _tokens(spec) == _tokens(plain)
    assert counters.accepted_tokens > 0


def test_preemption_in_a_small_cache_and_no_async(hf):
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    small = dict(kv_cache_memory=2**18, max_num_seqs=8)
    plain, before = _generate(hf, "off", params, _loops(2), **small)
    spec, counters = _generate(hf, "ngram", params, _loops(2), **small)
    assert before.preemptions > 0 and counters.preemptions > 0
    assert _tokens(spec) == _tokens(plain)
    sync, _ = _generate(hf, "ngram", params, _loops(2), async_scheduling=False)
    assert _tokens(sync) == _tokens(plain)


def test_stops_and_max_tokens_cut_inside_accepted_drafts(hf):
    plain, _ = _generate(hf, "off", SamplingParams(max_tokens=N, ignore_eos=True), _loops(3))
    stop = plain[3].token_ids[25]          # a token its loop repeats: drafted and accepted before it stops
    for params in (SamplingParams(max_tokens=N, stop_token_ids=[stop]), SamplingParams(max_tokens=7, ignore_eos=True)):
        a, _ = _generate(hf, "off", params, _loops(3))
        b, _ = _generate(hf, "ngram", params, _loops(3))
        assert _tokens(a) == _tokens(b)
        assert [o.completions[0].finish_reason for o in a] == [o.completions[0].finish_reason for o in b]
    assert all(len(o.token_ids) == 7 for o in b)


def test_rejected_drafts_roll_back_blocks_and_hashes():
    """A row of 14 tokens (blocks of 4) verifies 6 drafted tokens and keeps 2 of them: blocks 0-2 hold its
    own tokens and are hashed once computed; block 4 held only rejected drafts and is hashed never; a
    second row with the same 16 tokens finds exactly blocks 0-3 (ref counts 2)."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    p = SamplingParams(max_tokens=20, ignore_eos=True)
    seq = Sequence("a", list(range(1, 15)), 14, p)
    sched.add(seq)
    out = sched.schedule()
    sched.finish_step(out)
    seq.token_ids.append(100)               # its first sample; 15 tokens, 14 computed
    seq.draft = [101, 102, 103, 104, 105, 106]
    out = sched.schedule()
    [chunk] = out.chunks
    assert (chunk.start, chunk.num_tokens, chunk.draft, chunk.completes) == (14, 7, (101, 102, 103, 104, 105, 106), True)
    assert len(seq.block_table) == 6        # slots through position 20
    hashed = [kv.pool.blocks[b].hash is not None for b in seq.block_table]
    assert hashed == [True, True, True, False, False, False]    # the drafts' blocks are not hashed
    sched.finish_step(out)
    assert seq.num_computed_tokens == 15    # drafted positions count once accepted
    known = seq.num_tokens
    seq.token_ids += [101, 102, 999]        # kept two drafts and the sample after them
    seq.num_computed_tokens = 17
    kv.register_accepted(seq, known)
    assert [kv.pool.blocks[b].hash is not None for b in seq.block_table] == [True, True, True, True, False, False]
    other = Sequence("b", seq.token_ids[:16] + [7], 17, p)
    match = kv.match_prefix(other, other.max_cacheable_prefix)
    assert match.blocks == seq.block_table[:4]
    kv.admit(other, match)
    assert [kv.pool.blocks[b].ref_count for b in seq.block_table] == [2, 2, 2, 2, 1, 1]


def test_a_draft_never_preempts_and_leaves_budget_for_later_rows():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    p = SamplingParams(max_tokens=20, ignore_eos=True)
    seqs = [Sequence(str(i), [1, 2, 3, 4, 5, 6, 7], 7, p) for i in range(2)]
    for s in seqs:
        sched.add(s)
    sched.finish_step(sched.schedule())
    for s in seqs:
        s.token_ids.append(9)
        s.draft = [1, 2, 3, 4, 5, 6, 7, 8]
    out = sched.schedule()                  # 4 blocks: each row's 8 tokens fit, their drafts do not
    assert not out.preempted and [c.draft for c in out.chunks] == [(), ()]
    sched2 = Scheduler(KVCacheManager(num_blocks=64, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
    rows = [Sequence(str(i), [1, 2, 3], 3, p) for i in range(3)]
    for s in rows:
        sched2.add(s)
    sched2.finish_step(sched2.schedule())
    sched2.max_num_batched_tokens = 5
    for s in rows:
        s.token_ids.append(9)
        s.draft = [1, 2, 3, 4]
    out = sched2.schedule()
    assert [len(c.draft) for c in out.chunks] == [0, 0, 2] and out.num_tokens == 5    # plain decodes first
    assert out.chunks[-1].seq is rows[0]        # the first row's room: one token left for each row after it


def test_ngram_index_proposes_what_followed_the_longest_suffix():
    index = NgramIndex(max_n=3)
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert index.propose(tokens, 3) == [4, 5, 9]
    tokens += [4, 5]
    assert index.propose(tokens, 3) == [9, 1, 2]        # (3, 4, 5) last seen before 9
    assert NgramIndex(3).propose([7, 8], 2) == []
    assert NgramIndex(2).propose([4, 5, 6, 4, 5, -1], 4, end=5) == [6, 4, 5]    # never the placeholder past end


def test_the_switch_drafts_where_it_pays_and_not_where_it_costs():
    """Steps timed as fixed + per row + when drafting + per drafted token: where a drafted token costs
    little against a plain step's time per row (memory-bound, few rows) good rows draft their most; where
    it costs as much as a decoded row (compute-bound), none does; rows never right never draft."""
    def timed(per_row, per_draft, fixed=0.100, when=0.005):
        switch = SpeculationSwitch("auto", 4)
        for rows, drafted in [(8, 0), (6, 0), (4, 0), (8, 8), (8, 16), (5, 10), (6, 24), (3, 0), (7, 0)] * 3:
            switch.timed(rows, drafted, fixed + per_row * rows + (when if drafted else 0) + per_draft * drafted)
        return switch
    cheap, dear = timed(0.0005, 0.0006), timed(0.009, 0.009, fixed=0.021)
    for switch in (cheap, dear):
        switch.row(1).rate, switch.row(2).rate = 0.7, 0.02
    assert cheap.plan([1, 2], batch_rows=8) == {1: 4}
    assert dear.plan([1, 2], batch_rows=8) == {}
    assert dear.plan([1], batch_rows=1) == {1: 3}       # alone in the tail, a step costs its fixed part
    fresh = SpeculationSwitch("auto", 4)
    fresh.row(1).rate = 0.6
    assert fresh.plan([1, 2], batch_rows=8) == {1: 2}   # not measured: proven rows try, and so measure
    assert fresh.plan([1, 2], batch_rows=100) == {}     # ... in small batches only (the tail), not at 100 rows
    assert SpeculationSwitch("ngram", 3).plan([1, 2], batch_rows=256) == {1: 3, 2: 3}


def test_a_rows_acceptance_is_measured_from_its_shadow_drafts():
    row = RowAcceptance()
    row.hold([5, 6, 7], at=3)
    row.check([0, 1, 2, 5, 6, 8], end=5)    # not settled: two right so far (the 8 is not known yet)
    assert row.draft
    row.check([0, 1, 2, 5, 6, 8], end=6)    # the third was wrong: 2 of 3 tried
    assert not row.draft and row.rate > 0.3 + 1e-9


def test_a_job_writes_the_same_rows_with_its_drafts_counted(tmp_path):
    model = tiny_model(tmp_path)
    rows = [{"id": f"r{i}", "prompt": " ".join(["alpha beta gamma delta"] * (2 + i % 3))} for i in range(6)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    common = [data, "-m", model, "--device", "cpu", "--max-tokens", "24", "--ignore-eos"]
    off = CliRunner().invoke(main, ["submit", *common, "-o", str(tmp_path / "off")])
    on = CliRunner().invoke(main, ["submit", *common, "-o", str(tmp_path / "on"), "--speculative", "ngram"])
    assert off.exit_code == 0 and on.exit_code == 0, on.output
    a = {r["id"]: r for r in read_results(str(tmp_path / "off")).to_pylist()}
    b = {r["id"]: r for r in read_results(str(tmp_path / "on")).to_pylist()}
    assert {k: r["output"] for k, r in a.items()} == {k: r["output"] for k, r in b.items()}
    assert "draft_tokens" not in next(iter(a.values()))
    assert any(r["reused"] and r["draft_tokens"] is None for r in b.values())   # copies: not computed here
    drafted = sum(r["draft_tokens"] or 0 for r in b.values())
    kept = sum(r["accepted_tokens"] or 0 for r in b.values())
    run = json.loads((tmp_path / "on" / "_stats.json").read_text())["runs"][-1]
    assert (run["engine"]["draft_tokens"], run["engine"]["accepted_tokens"]) == (drafted, kept) and drafted > 0
    assert f"{kept:,} of {drafted:,} drafted tokens accepted" in on.output
    report = CliRunner().invoke(main, ["report", str(tmp_path / "on"), "-o", str(tmp_path / "r.html")])
    assert report.exit_code == 0 and "drafts accepted" in (tmp_path / "r.html").read_text()
    bad = CliRunner().invoke(main, ["submit", *common, "-o", str(tmp_path / "bad"), "--speculative-tokens", "0"])
    assert bad.exit_code == 2 and "--speculative-tokens must be between 1 and 16" in bad.output


JOB_KINDS = {
    "generate": dict(max_tokens=24, logprobs=True, top_logprobs=1, ignore_eos=True),
    "json-schema": dict(max_tokens=48, json_schema=json.dumps({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
        "required": ["name", "tags"]})),
    "classify": dict(kind="classify", labels="yes,no,maybe so"),
    "score": dict(kind="score", score_column="answer"),
    "embed": dict(kind="embed"),
}


@pytest.mark.parametrize("kind", list(JOB_KINDS))
def test_every_job_kind_gives_the_same_rows(tiny_hf_model_dir, kind):
    """Through the product: only generating rows draft; every kind's rows are the plain engine's."""
    import jobrunner
    model = str(tiny_hf_model_dir("llama"))
    rows = [{"id": f"q{i}", "prompt": "one two three four one two three four " * (1 + i % 3) + f"row {i}",
             "answer": " one two"} for i in range(8)]

    def run(mode):
        df = jobrunner.generate(rows, model=model, device="cpu", kv_cache_memory="32MB", speculative=mode,
                                **JOB_KINDS[kind])
        keep = [c for c in df.columns if c not in ("queue_s", "prefill_s", "decode_s", "draft_tokens",
                                                      "accepted_tokens", "cached_tokens", "reused")]
        return df.sort("id").select(keep).to_dicts()
    spec, plain = run("ngram"), run("off")
    lps = [[[t["logprob"] for t in r.pop("logprobs", None) or ()] for r in rows] for rows in (spec, plain)]
    assert spec == plain        # texts, labels, scores, vectors: the same; logprobs within float tolerance
    assert all(abs(a - b) < 1e-5 for x, y in zip(*lps) for a, b in zip(x, y))
