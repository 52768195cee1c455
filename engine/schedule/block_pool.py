"""KV block pool: reference counts, a free list in LRU order, and a hash index of full blocks.

No torch here: blocks are ids; the model runner owns the tensors they index.

Invariants:
- a block is in `free` iff its ref_count is 0;
- `free` is ordered oldest-first: allocation takes from the front, release appends at the back,
  so unreferenced cached blocks are evicted least recently used first;
- `by_hash[h]` is a block whose hash is h; a block leaves the index when it is reused for other
  content, or when it is released before its contents were ever computed;
- `children[(p, t)]` holds the indexed blocks that follow the prefix hashed p and start with token t
  (keyed by the first token too: a partial match scans only blocks that share at least one token,
  not every cached sequence's first block).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None    # set once the block's tokens are all known (a full block)
    parent: int = 0            # hash of the block before it in its sequence (0: the first block)
    tokens: tuple = ()         # the block's tokens, kept for partial-prefix matches
    computed: bool = False     # its K and V have been written


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.by_hash: dict[int, int] = {}
        self.children: dict[tuple[int, int], set[int]] = {}   # (parent hash, first token) -> indexed blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int] | None:
        """Takes n blocks from the front of the free list (evicting their cached contents);
        None, and nothing changed, when fewer than n are free."""
        if n > len(self.free):
            return None
        ids = []
        for _ in range(n):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            self._forget(block)
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def lookup(self, block_hash: int) -> Block | None:
        block_id = self.by_hash.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def acquire(self, block_id: int) -> None:
        """Adds a reference to a (possibly free, cached) block."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drops one reference from each; blocks reaching zero go to the back of the free list.
        Released in reverse so a sequence's tail blocks are evicted before its prefix."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} released twice"
            if block.ref_count == 0:
                if not block.computed:
                    self._forget(block)
                self.free[block_id] = None

    def register(self, block_id: int, block_hash: int, parent: int = 0, tokens: tuple = ()) -> None:
        """Gives a full block its hash; the first block with a given hash stays the indexed one."""
        block = self.blocks[block_id]
        if block.hash is not None:
            return
        # Registered as it is being written: its new tokens are not computed before this step ends
        # (a partial block computed earlier would otherwise pass as a complete copy source).
        block.hash, block.parent, block.tokens, block.computed = block_hash, parent, tokens, False
        key = (parent, tokens[0]) if tokens else None
        if self.by_hash.setdefault(block_hash, block_id) == block_id:
            if key is not None:
                self.children.setdefault(key, set()).add(block_id)
        else:   # a duplicate of an indexed block: not a match candidate
            siblings = self.children.get(key)
            if siblings is not None:
                siblings.discard(block_id)

    def index_partial(self, block_id: int, parent: int, tokens: tuple) -> None:
        """Makes a not-yet-full block findable for partial-prefix matches by its leading tokens.
        Its later tokens may change; the ones given here never do."""
        block = self.blocks[block_id]
        if block.hash is not None:
            return
        block.parent, block.tokens, block.computed = parent, tokens, False   # written this step
        self.children.setdefault((parent, tokens[0]), set()).add(block_id)

    def following(self, parent: int, first_token: int) -> list[Block]:
        """Indexed blocks whose sequence continues the prefix ending in `parent` with first_token."""
        return [self.blocks[b] for b in self.children.get((parent, first_token), ())]

    def mark_computed(self, block_ids) -> None:
        for block_id in block_ids:
            self.blocks[block_id].computed = True

    def _forget(self, block: Block) -> None:
        if block.hash is not None and self.by_hash.get(block.hash) == block.id:
            del self.by_hash[block.hash]
        key = (block.parent, block.tokens[0]) if block.tokens else None
        siblings = self.children.get(key)
        if siblings is not None and block.id in siblings:
            siblings.discard(block.id)
            if not siblings:
                del self.children[key]
        block.hash, block.parent, block.tokens = None, 0, ()
        block.computed = False

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_count == 0:
                self._forget(block)
