"""Order one window of prompts depth-first over their token trie.

Each prompt is encoded as fixed-width (4-byte) big-endian unsigned token ids. For ids in
[0, 2**32) this encoding keeps lexicographic order (byte order = token order, and a
prompt's prefix encodes to a prefix of its bytes), so sorting the encodings with plain
bytes comparison (memcmp, in C) is a depth-first walk of the token trie: every shared
prefix's rows become adjacent, and a prompt comes before its extensions.

The longest common prefix (LCP) of sorted neighbours is computed in C as well: XOR the
two encodings read as big integers; the highest differing bit gives the first differing
token. Invariant: in sorted order, LCP(row j, row i) = min(lcps[j+1..i]) for j < i, so
neighbour LCPs describe the whole trie of the window.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
_WIDTH = 4  # bytes per token id
_TYPECODE = "I"
assert array(_TYPECODE).itemsize == _WIDTH, "array('I') must hold 32-bit ints"
_SWAP = sys.byteorder == "little"  # array stores native order; we need big-endian


def encode(tokens: Sequence[int]) -> bytes:
    """Order-preserving bytes for a token id list: `encode(a) < encode(b)` iff `a < b`."""
    try:
        buf = array(_TYPECODE, tokens)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be ints in [0, 2**32): {e}") from None
    if _SWAP:
        buf.byteswap()
    return buf.tobytes()


@dataclass(slots=True)
class SortedWindow:
    """One window in run order. All lists are aligned and in sorted (trie) order."""

    keys: list[Hashable]  # caller's keys
    lens: list[int]  # prompt lengths, tokens
    lcps: list[int]  # lcps[i] = LCP(row i-1, row i); lcps[0] = 0 (window start)


def sort_window(keys: list[Hashable], encs: list[bytes]) -> SortedWindow:
    """Sort one window (stable: equal prompts keep input order) and take neighbour LCPs."""
    order = sorted(range(len(encs)), key=encs.__getitem__)
    from_bytes = int.from_bytes
    skeys: list[Hashable] = []
    lens: list[int] = []
    lcps: list[int] = []
    prev_int = 0
    prev_len = 0  # bytes
    for idx in order:
        enc = encs[idx]
        cur_len = len(enc)
        cur_int = from_bytes(enc, "big")
        if not lcps:
            lcps.append(0)
        else:
            # Compare the first m = min(len) bytes: drop the longer one's tail bytes.
            if prev_len <= cur_len:
                m = prev_len
                x = prev_int ^ (cur_int >> (8 * (cur_len - prev_len)))
            else:
                m = cur_len
                x = (prev_int >> (8 * (prev_len - cur_len))) ^ cur_int
            # 8*m - bit_length = leading equal bits; // 32 = whole equal tokens.
            lcps.append((8 * m - x.bit_length()) >> 5)
        skeys.append(keys[idx])
        lens.append(cur_len // _WIDTH)
        prev_int, prev_len = cur_int, cur_len
    return SortedWindow(skeys, lens, lcps)


def iter_windows(
    pairs: Iterable[tuple[Hashable, Sequence[int]]], window_rows: int, window_tokens: int | None = None
) -> Iterator[SortedWindow]:
    """Read (key, tokens) pairs a window at a time and yield each window sorted. A window ends
    after `window_rows` pairs, or at the pair that brings it to `window_tokens` tokens.

    Bounded memory: token lists are encoded as they are read and not kept, so at most
    one window of encodings (4 bytes per token) is held at once; `window_tokens` bounds
    that for datasets of long prompts, where rows alone would not.
    """
    if window_rows < 1:
        raise ValueError("window_rows must be >= 1")
    if window_tokens is not None and window_tokens < 1:
        raise ValueError("window_tokens must be >= 1")
    encoded = ((key, encode(tokens)) for key, tokens in pairs)
    for window in split_windows(encoded, window_rows, window_tokens, lambda pair: len(pair[1]) // _WIDTH):
        yield sort_window([key for key, _ in window], [enc for _, enc in window])


def split_windows(items: Iterable[T], window_rows: int, window_tokens: int | None,
                  tokens_of: Callable[[T], int]) -> Iterator[list[T]]:
    """Items in windows of `window_rows`, a window ending early at the item that brings it to
    `window_tokens` tokens. The one window rule of planned and unplanned jobs."""
    limit = window_tokens or float("inf")
    window: list[T] = []
    tokens = 0
    for item in items:
        window.append(item)
        tokens += tokens_of(item)
        if len(window) >= window_rows or tokens >= limit:
            yield window
            window, tokens = [], 0
    if window:
        yield window
