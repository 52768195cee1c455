"""Prefix-sharing figures of a dataset: what a perfect cache, or a block cache, could reuse.

Within one sorted window (see window.py), with lens[i] and lcps[i] = LCP with the
previous row in sorted order:

    total_tokens   = sum(lens)
    unique_tokens  = sum(lens) - sum(lcps)          # = number of trie nodes (root excluded)
    optimum cached = total_tokens - unique_tokens   # a perfect token-level cache

    block optimum  = sum(cacheable_prefix_tokens(lcps[i], lens[i], block_size))

The block optimum is the most a block-granular prefix cache can reuse: only full blocks
are cached, and at least the last prompt token of every row is recomputed (it must
produce logits). Running rows in sorted order reaches it. Proof sketch: hits decompose
over full-block trie nodes v at depth d*B; row r hits v iff v prefixes r, len(r) > d*B
and an earlier row also passed through v. So at most (rows through v with len > d*B)
rows hit v, minus one when no row ends exactly at v (then the first visitor pays).
Sorted order visits a row ending at v first whenever one exists, so it reaches that
bound at every v at once. `partial_optimum_tokens` is the same with block_size = 1:
what an engine that also copies the partial last shared block could reach.

Across windows each window is a fresh trie: prefixes shared between windows are
counted as unique again. So with more than one window, unique_tokens is an upper
bound on the dataset's trie size and the optima are lower bounds (the true figures
for a job that runs window after window with a cold cache at each window start).
`exact` says whether the whole input fit in one window.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .window import iter_windows


def block_level_reuse(lcp: int, block_size: int) -> int:
    """Tokens of a shared prefix of `lcp` tokens that fall in full blocks."""
    return (lcp // block_size) * block_size


def partial_block_tokens(lcp: int, block_size: int) -> int:
    """Shared tokens lost per row to block granularity (the partial last shared block)."""
    return lcp % block_size


def cacheable_prefix_tokens(lcp: int, prompt_len: int, block_size: int) -> int:
    """Tokens a block cache can serve a prompt of `prompt_len` sharing `lcp` with the cache.

    Full blocks only, and never the last prompt token (it is recomputed for its logits).
    """
    return block_level_reuse(max(0, min(lcp, prompt_len - 1)), block_size)


@dataclass(slots=True)
class PrefixStats:
    block_size: int = 16
    rows: int = 0
    windows: int = 0
    total_tokens: int = 0
    unique_tokens: int = 0  # trie nodes, summed over windows
    block_optimum_tokens: int = 0  # best cached tokens, full blocks, last token recomputed
    partial_optimum_tokens: int = 0  # same, partial last shared block copied

    @property
    def optimum_cached_tokens(self) -> int:
        """What a perfect token-level cache could reach: total - unique."""
        return self.total_tokens - self.unique_tokens

    @property
    def optimum_hit_rate(self) -> float:
        return self.optimum_cached_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def block_optimum_hit_rate(self) -> float:
        return self.block_optimum_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def block_granularity_loss(self) -> int:
        """Tokens a full-block cache loses against one that copies partial blocks."""
        return self.partial_optimum_tokens - self.block_optimum_tokens

    @property
    def exact(self) -> bool:
        """True when the input fit in one window (figures are exact, not estimates)."""
        return self.windows <= 1

    def add_window(self, lens: Sequence[int], lcps: Sequence[int]) -> None:
        """Add one sorted window (lcps[i] = LCP with the previous row, lcps[0] = 0)."""
        bs = self.block_size
        block = partial = 0
        for n, p in zip(lens, lcps):
            c = p if p < n else n - 1  # last token always recomputed
            if c > 0:
                partial += c
                block += c - c % bs
        self.rows += len(lens)
        self.windows += 1
        self.total_tokens += sum(lens)
        self.unique_tokens += sum(lens) - sum(lcps)
        self.block_optimum_tokens += block
        self.partial_optimum_tokens += partial

    def merge(self, other: PrefixStats) -> None:
        """Add another stats object's figures (same block size) into this one."""
        if other.block_size != self.block_size:
            raise ValueError("cannot merge stats of different block sizes")
        self.rows += other.rows
        self.windows += other.windows
        self.total_tokens += other.total_tokens
        self.unique_tokens += other.unique_tokens
        self.block_optimum_tokens += other.block_optimum_tokens
        self.partial_optimum_tokens += other.partial_optimum_tokens


def prefix_stats(
    token_lists: Iterable[Sequence[int]], block_size: int = 16, window_rows: int = 50_000
) -> PrefixStats:
    """Prefix-sharing figures in bounded memory (one window of `window_rows` at a time).

    Exact when the input fits in one window; otherwise see the module docstring.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    stats = PrefixStats(block_size=block_size)
    for w in iter_windows(enumerate(token_lists), window_rows):
        stats.add_window(w.lens, w.lcps)
    return stats
