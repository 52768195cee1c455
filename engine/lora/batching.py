"""A step's rows grouped by LoRA adapter. No torch.

The runner flattens chunks in order, decodes first (the attention metadata needs them there); with
adapters loaded it orders the decodes by adapter and the prefill chunks by adapter, so each
adapter's rows are at most two contiguous segments (spans) of the flat batch.
"""
from __future__ import annotations


def order_by_adapter(chunks: list, num_decodes: int) -> list:
    """Decodes first, then the rest, each part stably sorted by the sequence's adapter."""
    key = lambda c: c.seq.lora
    return sorted(chunks[:num_decodes], key=key) + sorted(chunks[num_decodes:], key=key)


def adapter_spans(chunks: list) -> list[tuple[int, int, int]]:
    """(first token row, rows, adapter) of each run of chunks under one adapter; base rows (0) in none."""
    spans: list[tuple[int, int, int]] = []
    row = 0
    for chunk in chunks:
        adapter, n = chunk.seq.lora, chunk.num_tokens
        if adapter:
            if spans and spans[-1][2] == adapter and spans[-1][0] + spans[-1][1] == row:
                start, rows, _ = spans[-1]
                spans[-1] = (start, rows + n, adapter)
            else:
                spans.append((row, n, adapter))
        row += n
    return spans
