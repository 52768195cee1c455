"""Per-sequence KV bookkeeping over the block pool: prefix matching, slot allocation, forks.

No torch. Block hashes chain over full blocks: hash(block i) = hash((hash(block i-1), tokens of block i)),
so equal hashes mean equal whole prefixes. An image's tokens are keyed by its pixels
(Sequence.key_ids, engine/schedule/prompt_images.py): equal hashes mean equal images too. The chain starts at the sequence's LoRA adapter
(Sequence.hash_root; 0 for the base model): equal tokens under another adapter hash apart.
Python's tuple hash is 64-bit; a collision would be a silent wrong answer, at odds of about
n^2 / 2^64 for n cached blocks.

Reuse need not stop at a block boundary: when the prefix continues part way into a cached block
(short prompts sharing 37 tokens with 16-token blocks), that block is copied into a fresh one and
its matching tokens count as computed. The copy runs before the step's forward, so its source
must be computed already, not merely written this step.

A full block gets its hash when it is allocated for a chunk that fills it (its tokens are known
then), before it is computed. Another sequence may share such a block only if the block is
computed by the end of the current step's writes, which precede every attention read in the
same forward: that is how N rows admitted together compute their shared prefix once.
"Computed" means written by a step already enqueued on the device: steps run in order on
one stream, so every later step reads it complete.
"""
from __future__ import annotations

from dataclasses import dataclass

from jobrunner.engine.schedule.block_pool import BlockPool
from jobrunner.engine.schedule.sequence import Sequence


@dataclass
class PrefixMatch:
    blocks: list[int]                      # full cached blocks, in order
    partial: tuple[int, int] | None = None  # (source block, leading tokens reused from it)


class PrefixWait:
    """match_prefix's answer when the prefix continues into a block another sequence has yet to
    compute: admitting now would compute it twice, so the sequence waits a step."""

    def __repr__(self) -> str:
        return "WAIT"


WAIT = PrefixWait()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_blocks = num_blocks
        self.ready_this_step: set[int] = set()   # full blocks whose K/V this step's forward completes
        self.written_this_step: set[int] = set()  # every block this step's forward writes into

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hash_chain(self, seq: Sequence, num_blocks: int, start: int = 0, prev: int | None = None) -> list[int]:
        """From the sequence's root (its adapter's: engine.sequence.hash_root) unless `prev` is given."""
        bs, hashes = self.block_size, []
        prev = seq.hash_root if prev is None else prev
        for i in range(start, num_blocks):
            prev = hash((prev, tuple(seq.key_ids(i * bs, (i + 1) * bs))))
            hashes.append(prev)
        return hashes

    def match_prefix(self, seq: Sequence, max_tokens: int) -> PrefixMatch | PrefixWait:
        """The longest cached prefix of at most max_tokens tokens (blocks not yet acquired), or WAIT
        when that prefix continues into a block another sequence has yet to compute. No change."""
        if not self.enable_prefix_caching:
            return PrefixMatch([])
        matched, parent, bs = [], seq.hash_root, self.block_size
        for h in self._hash_chain(seq, max_tokens // bs):
            block = self.pool.lookup(h)
            if block is None:
                break
            if not block.computed and block.id not in self.ready_this_step:
                return WAIT
            matched.append(block.id)
            parent = h
        start = len(matched) * bs
        ours = seq.key_ids(start, min(start + bs, max_tokens))
        # A source written this step can't be copied before the forward; waiting a step for at most
        # block_size - 1 tokens would cost more batch than it saves, so only computed blocks count.
        best, best_len = None, 0
        for block in self.pool.following(parent, ours[0]) if ours else ():
            n = common_prefix(block.tokens, ours)
            if block.computed and n > best_len:
                best, best_len = block.id, n
        return PrefixMatch(matched, (best, best_len) if best is not None else None)

    def admit(self, seq: Sequence, match: PrefixMatch) -> list[tuple[int, int]]:
        """Gives a waiting sequence its matched prefix. Changes ref counts; returns block copies to run.
        The caller has checked can_admit, so the partial block's copy target is free."""
        for block_id in match.blocks:
            self.pool.acquire(block_id)
        seq.block_table = list(match.blocks)
        seq.num_computed_tokens = len(match.blocks) * self.block_size
        copies = []
        if match.partial:
            src, n = match.partial
            [dst] = self.pool.allocate(1)
            seq.block_table.append(dst)
            seq.num_computed_tokens += n
            copies.append((src, dst))
        seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        return copies

    def can_admit(self, seq: Sequence, match: PrefixMatch, budget: int) -> bool:
        """Whether admit(seq, match) and then allocating its first chunk (up to budget tokens past
        the match) both fit. Exact, so a waiting sequence is never left holding blocks. No change."""
        start = len(match.blocks) * self.block_size + (match.partial[1] if match.partial else 0)
        end = min(seq.compute_target, start + budget)
        needed = self.blocks_for(end) - len(match.blocks)          # the partial copy's block included
        reclaimable = sum(1 for b in match.blocks if self.pool.blocks[b].ref_count == 0)
        return needed <= self.pool.num_free - reclaimable

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Ensures slots for the next num_new_tokens tokens and hashes the blocks this chunk fills.
        False, and nothing changed, when the pool is short."""
        bs = self.block_size
        end = seq.num_computed_tokens + num_new_tokens
        num_blocks = self.blocks_for(end)
        needed = num_blocks - len(seq.block_table)
        if needed > 0:
            new = self.pool.allocate(needed)
            if new is None:
                return False
            seq.block_table.extend(new)
        first_full = seq.num_computed_tokens // bs
        last_full = end // bs
        self.written_this_step.update(seq.block_table[first_full:num_blocks])
        if last_full > first_full:
            self.ready_this_step.update(seq.block_table[first_full:last_full])
            # a block ending in a placeholder is hashed once its token is known (register_resolved):
            # its hash covers the token's id, which the host learns only after the step in flight
            known_full = min(last_full, seq.num_known_tokens // bs)
            if self.enable_prefix_caching:
                self._register_full(seq, first_full, known_full)
        if self.enable_prefix_caching and end % bs and end <= seq.num_prompt_tokens:
            # a prompt's partial last block: findable by its leading tokens, for partial reuse
            self.pool.index_partial(seq.block_table[last_full], self._prefix_hash(seq, last_full),
                                    tuple(seq.key_ids(last_full * bs, end)))
        return True

    def register_resolved(self, seq: Sequence) -> None:
        """seq's placeholder has just become its real token: hashes the block that token completes,
        if a launched step has written it already (allocate left it unhashed). Changes the pool's index."""
        n = seq.num_tokens
        if not self.enable_prefix_caching or n % self.block_size or seq.num_computed_tokens < n:
            return
        last = n // self.block_size
        self._register_full(seq, last - 1, last)
        self.pool.mark_computed([seq.block_table[last - 1]])   # written by a step already enqueued

    def register_accepted(self, seq: Sequence, known_before: int) -> None:
        """seq kept drafted tokens (engine/spec): hashes the full blocks they complete that are computed
        (allocate hashed none past the tokens known then, `known_before`). Changes the pool's index."""
        if not self.enable_prefix_caching:
            return
        first, last = known_before // self.block_size, seq.num_computed_tokens // self.block_size
        self._register_full(seq, first, last)
        self.pool.mark_computed(seq.block_table[first:last])    # written by a step already enqueued

    def _register_full(self, seq: Sequence, first: int, last: int) -> None:
        """Hashes seq's full blocks first..last-1 into the pool's index (their tokens are all known)."""
        if first >= last:
            return
        bs, prev = self.block_size, self._prefix_hash(seq, first)
        for i, h in enumerate(self._hash_chain(seq, last, first, prev), first):
            self.pool.register(seq.block_table[i], h, prev, tuple(seq.key_ids(i * bs, (i + 1) * bs)))
            prev = h

    def _prefix_hash(self, seq: Sequence, num_blocks: int) -> int:
        if num_blocks == 0:
            return seq.hash_root
        block = self.pool.blocks[seq.block_table[num_blocks - 1]]
        if block.hash is not None:
            return block.hash
        return self._hash_chain(seq, num_blocks)[-1]

    def end_step(self) -> None:
        """After the forward: every block written this step is computed."""
        self.pool.mark_computed(self.ready_this_step)
        self.pool.mark_computed(b for b in self.written_this_step if self.pool.blocks[b].tokens)
        self.ready_this_step.clear()
        self.written_this_step.clear()

    def free(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        seq.block_table = []

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]] | None:
        """Child shares the parent's full computed blocks; the partial last block is copied.
        Returns the (src, dst) block copies the runner must do, or None if no block is free."""
        num_full = parent.num_computed_tokens // self.block_size
        partial = parent.num_computed_tokens % self.block_size
        copies = []
        if partial:
            new = self.pool.allocate(1)
            if new is None:
                return None
            copies.append((parent.block_table[num_full], new[0]))
        for block_id in parent.block_table[:num_full]:
            self.pool.acquire(block_id)
        child.block_table = parent.block_table[:num_full] + [dst for _, dst in copies]
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        return copies


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
