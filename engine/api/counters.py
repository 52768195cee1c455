"""An engine's running totals, as a frozen snapshot: Engine.counters() returns one; the difference
of two is what ran between them (an engine may serve several jobs). No torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineCounters:
    steps: int = 0
    tokens_computed: int = 0          # every token run through the model
    prompt_tokens_computed: int = 0   # tokens of requests' prompts (not candidates, not generated)
    prompt_tokens_cached: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    graph_steps: int = 0              # pure-decode steps replayed from CUDA graphs
    images_encoded: int = 0           # images run through a vision tower
    images_reused: int = 0            # a chunk's image whose tower output was at hand (engine/run/image_embeds.py)
    draft_tokens: int = 0             # speculative decoding (engine/spec): drafted tokens verified
    accepted_tokens: int = 0          # and those kept
    # host seconds per phase of a step; wait_s: waiting for the device's results
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    wait_s: float = 0.0
    process_s: float = 0.0
    mask_s: float = 0.0               # filling grammar bitmasks on the host (structured output)

    def __add__(self, other: EngineCounters) -> EngineCounters:
        return EngineCounters(*(a + b for a, b in zip(vars(self).values(), vars(other).values())))

    def __sub__(self, other: EngineCounters) -> EngineCounters:
        return EngineCounters(*(a - b for a, b in zip(vars(self).values(), vars(other).values())))

    def as_dict(self) -> dict[str, int | float]:
        return dict(vars(self))
