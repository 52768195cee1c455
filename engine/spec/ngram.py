"""Prompt-lookup drafting: a row's next tokens guessed from where its last few tokens occurred before,
in its own prompt or output. No torch, no model: extraction and rewriting copy spans of the prompt,
so the tokens that followed the same n-gram before are the likeliest continuation.

Each row keeps an index of its n-grams (n = 1..max_n) to the position after their latest earlier
occurrence, extended by the tokens appended since the last proposal: a proposal costs the new
tokens, not the row's length.
"""
from __future__ import annotations


class NgramIndex:
    """One row's n-gram index over its known tokens."""

    def __init__(self, max_n: int):
        self.max_n = max_n
        self.after: dict[tuple[int, ...], int] = {}   # n-gram -> index of the token that followed it last
        self.indexed = 0                                # n-grams ending before this index are in `after`

    def propose(self, tokens: list[int], k: int, end: int | None = None) -> list[int]:
        """Up to k tokens that followed the longest suffix of tokens[:end] (n <= max_n) earlier in them."""
        end = len(tokens) if end is None else end
        for e in range(max(self.indexed, 1), end):       # n-grams ending at e - 1, each with a follower
            for n in range(1, min(self.max_n, e) + 1):
                self.after[tuple(tokens[e - n:e])] = e
        self.indexed = max(self.indexed, end)
        for n in range(min(self.max_n, end), 0, -1):
            start = self.after.get(tuple(tokens[end - n:end]))
            if start is not None:
                return tokens[start:min(start + k, end)]
        return []


class NgramDrafter:
    """Indexes by sequence id; `forget` a sequence when it ends. Cheap: every row gets a (shadow) draft."""
    costly = False

    def __init__(self, max_n: int = 3):
        self.max_n = max_n
        self._rows: dict[int, NgramIndex] = {}

    def propose(self, seq_id: int, tokens: list[int], k: int, end: int | None = None) -> list[int]:
        index = self._rows.get(seq_id)
        if index is None:
            index = self._rows[seq_id] = NgramIndex(self.max_n)
        return index.propose(tokens, k, end) if k > 0 else []

    def propose_rows(self, rows: list[tuple[int, list[int], int]], k: int) -> dict[int, list[int]]:
        return {seq_id: self.propose(seq_id, tokens, k, known) for seq_id, tokens, known in rows}

    def forget(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)

    def close(self) -> None:
        self._rows.clear()
