"""Block pool, KV manager and scheduler on tiny pools, with exact block ids. No model, no torch."""
from jobrunner.engine.schedule.block_pool import BlockPool
from jobrunner.engine.schedule.kv_manager import WAIT, KVCacheManager, PrefixMatch
from jobrunner.engine.api.request import SamplingParams
from jobrunner.engine.schedule.scheduler import Scheduler
from jobrunner.engine.schedule.sequence import Sequence


def seq(tokens, max_tokens=4, **kw):
    return Sequence("r", list(tokens), len(tokens), SamplingParams(max_tokens=max_tokens), **kw)


def test_pool_allocates_front_and_frees_to_back():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) is None and pool.num_free == 2
    pool.release([0, 1])                      # released in reverse: tail block first
    assert list(pool.free) == [2, 3, 1, 0]
    assert pool.allocate(3) == [2, 3, 1]


def test_cached_block_evicted_lru_and_reacquired():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.register(a, 111)
    pool.register(b, 222)
    pool.mark_computed([a, b])
    pool.release([b])
    pool.release([a])
    assert list(pool.free) == [2, b, a]
    assert pool.lookup(222).id == b
    pool.acquire(a)                           # reuse from the free list keeps its contents
    assert a not in pool.free and pool.blocks[a].ref_count == 1
    assert pool.allocate(2) == [2, b]         # evicts b: its hash is forgotten
    assert pool.lookup(222) is None and pool.lookup(111).id == a


def test_uncomputed_block_loses_hash_on_release():
    pool = BlockPool(2)
    [a] = pool.allocate(1)
    pool.register(a, 7)
    pool.release([a])
    assert pool.lookup(7) is None


def test_prefix_match_full_blocks_only_and_last_token_recomputed():
    kv = KVCacheManager(8, block_size=4)
    s1 = seq(range(10))
    kv.admit(s1, PrefixMatch([]))
    assert kv.allocate(s1, 10) and s1.block_table == [0, 1, 2]
    kv.end_step()
    s2 = seq(list(range(8)) + [99])
    assert kv.match_prefix(s2, 8).blocks == [0, 1]
    s3 = seq(range(8))                        # identical 8 tokens: at most 7 may be matched
    assert kv.match_prefix(s3, 7).blocks == [0]


def test_shared_prefix_in_same_step_is_computed_once():
    kv = KVCacheManager(8, block_size=4)
    s1 = seq(range(9))
    kv.admit(s1, PrefixMatch([]))
    kv.allocate(s1, 9)                        # blocks 0, 1 filled this step
    s2 = seq(list(range(8)) + [50, 51])
    assert kv.match_prefix(s2, 9).blocks == [0, 1]  # ready by the time attention reads them
    kv.end_step()


def test_partial_block_reused_by_copy():
    kv = KVCacheManager(8, block_size=4)
    s1 = seq(range(12))
    kv.admit(s1, PrefixMatch([]))
    kv.allocate(s1, 12)
    kv.end_step()
    s2 = seq([0, 1, 2, 3, 4, 5, 77, 78])          # shares 6 tokens: one full block and 2 of the next
    match = kv.match_prefix(s2, 7)
    assert match.blocks == [0] and match.partial == (1, 2)
    copies = kv.admit(s2, match)
    assert copies == [(1, 3)] and s2.block_table == [0, 3]
    assert s2.num_computed_tokens == 6 and s2.num_cached_tokens == 6
    # a block still being written this step is never a copy source
    s3 = seq(range(100, 112))
    kv.admit(s3, PrefixMatch([]))
    kv.allocate(s3, 12)
    assert kv.match_prefix(seq([100, 101, 102, 103, 104, 0]), 5).partial is None
    kv.end_step()
    assert kv.match_prefix(seq([100, 101, 102, 103, 104, 0]), 5).partial == (5, 1)


def test_partial_source_never_claims_tokens_still_being_written():
    """A's first chunk writes 6 slots of block 1; its next chunk fills the block (and registers it)
    in the step where B is admitted: B may copy only the 6 slots already computed."""
    kv = KVCacheManager(8, block_size=4)
    a = seq(range(16))
    kv.admit(a, PrefixMatch([]))
    kv.allocate(a, 6)
    kv.end_step()
    a.num_computed_tokens = 6
    kv.allocate(a, 4)                              # this step: block 1 becomes full and registered
    b = seq([0, 1, 2, 3, 4, 5, 6, 50, 51])        # shares 7 tokens: block 0 and 3 tokens of block 1
    match = kv.match_prefix(b, 8)
    assert match.blocks == [0] and match.partial is None   # slot 6 of block 1 is written this step
    kv.end_step()
    assert kv.match_prefix(b, 8).partial == (1, 3)


def test_short_prompt_partial_block_is_indexed():
    kv = KVCacheManager(8, block_size=4)
    s1 = seq(range(6))                            # ends part way into its second block
    kv.admit(s1, PrefixMatch([]))
    kv.allocate(s1, 6)
    kv.end_step()
    match = kv.match_prefix(seq([0, 1, 2, 3, 4, 5, 9]), 6)
    assert match.blocks == [0] and match.partial == (1, 2)


def test_partial_match_looks_only_at_blocks_sharing_a_token(monkeypatch):
    """Partial-block candidates are indexed by their first token as well as their parent: with many
    cached sequences, admitting a new one compares its tokens with the few blocks that could match,
    not with every cached sequence's first block (that scan grew with the cache: 21 ms an admission
    at 50,000 cached sequences)."""
    import jobrunner.engine.schedule.kv_manager as km
    kv = KVCacheManager(400, block_size=4)
    for i in range(100):                       # 100 cached prompts, first tokens 1000..1099, 6 tokens each
        s = seq([1000 + i, 1, 2, 3, 4, 5])
        kv.admit(s, PrefixMatch([]))
        kv.allocate(s, 6)
        kv.end_step()
        kv.free(s)
    real, compared = km.common_prefix, []

    def counting(a, b):
        compared.append(tuple(a))
        return real(a, b)

    monkeypatch.setattr(km, "common_prefix", counting)
    match = kv.match_prefix(seq([1042, 1, 2, 9, 9]), 4)
    assert match.blocks == [] and match.partial is not None and match.partial[1] == 3
    assert len(compared) == 1                  # only the block starting with 1042
    compared.clear()
    assert kv.match_prefix(seq([7, 1, 2, 3, 4]), 4).partial is None and compared == []


def test_match_waits_for_block_not_computed_this_step():
    kv = KVCacheManager(8, block_size=4)
    s1 = seq(range(12))
    kv.admit(s1, PrefixMatch([]))
    kv.allocate(s1, 12)
    kv.ready_this_step.clear()                # as if s1's chunk ran in an earlier, unfinished step
    assert kv.match_prefix(seq(range(12)), 11) is WAIT


def test_fork_shares_full_blocks_and_copies_partial():
    kv = KVCacheManager(8, block_size=4)
    parent = seq(range(6))
    kv.admit(parent, PrefixMatch([]))
    kv.allocate(parent, 6)
    kv.end_step()
    parent.num_computed_tokens = 6
    child = seq(range(6))
    copies = kv.fork(parent, child)
    assert parent.block_table == [0, 1] and child.block_table == [0, 2] and copies == [(1, 2)]
    assert kv.pool.blocks[0].ref_count == 2


def test_scheduler_budget_mixed_batch_and_preemption():
    kv = KVCacheManager(4, block_size=4, enable_prefix_caching=False)
    sch = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=8)
    a, b = seq(range(6), max_tokens=8), seq(range(100, 106), max_tokens=8)
    sch.add(a)
    sch.add(b)
    out = sch.schedule()                      # a: 6 tokens, b: 2-token chunk (budget 8)
    assert [(c.seq is a, c.start, c.num_tokens) for c in out.chunks] == [(True, 0, 6), (False, 0, 2)]
    assert a.block_table == [0, 1] and b.block_table == [2]
    sch.finish_step(out)
    a.token_ids.append(7)                     # a sampled a token
    out = sch.schedule()                      # a decodes first, b continues its prefill
    assert [(c.seq is a, c.start, c.num_tokens) for c in out.chunks] == [(True, 6, 1), (False, 2, 4)]
    assert b.block_table == [2, 3]
    sch.finish_step(out)
    b.token_ids.append(9)
    for t in (8, 9):
        a.token_ids.append(t)
    a.num_computed_tokens = 8                 # a needs a third block: none free, so b is preempted
    a.token_ids.append(10)
    out = sch.schedule()
    assert out.preempted == [b] and b.block_table == [] and b.num_computed_tokens == 0
    assert a.block_table == [0, 1, 3]
    assert list(sch.waiting) == [b]


def test_admission_counts_the_partial_match_and_never_leaves_a_waiting_sequence_holding_blocks():
    """B matches a full cached block plus 1 token of a partial one; beside c's decode its chunk
    gets 4 tokens of budget, from position 5 to 9: a third block, while only 2 blocks are free.
    Admission must refuse B whole. Admitting it (acquiring the cached block, taking the copy
    target) and then failing its allocation left B waiting while holding both free blocks, and
    the engine could hang (found by fuzzing, with async scheduling on or off)."""
    kv = KVCacheManager(3, block_size=4)
    sch = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=5)
    a = seq([1, 2, 3, 4, 5, 6])
    sch.add(a)
    for _ in range(2):                         # a's prompt in chunks of 5 and 1
        sch.finish_step(sch.schedule())
    sch.finish(a, "stop")                      # blocks 0 ([1,2,3,4], hashed) and 1 ([5,6]) stay cached
    c = seq([9, 9], max_tokens=8)
    sch.add(c)
    sch.finish_step(sch.schedule())            # c takes block 2
    c.token_ids.append(9)
    b = seq([1, 2, 3, 4, 5, 7, 8, 9, 10])
    sch.add(b)
    out = sch.schedule()
    assert [ch.seq for ch in out.chunks] == [c]            # b is not admitted ...
    assert b.block_table == [] and b.num_computed_tokens == 0 and list(sch.waiting) == [b]
    assert kv.pool.num_free == 2                            # ... and holds nothing
