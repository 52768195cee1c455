"""Drafts from a smaller model of the same vocabulary (`--speculative draft --draft-model M`).

The draft model is an engine of its own (its KV cache, scheduler and prefix cache), driven as a drafter:
each step, every drafting row's known tokens are a prompt and its next k greedy tokens the draft. The
prefix cache keeps a row's earlier blocks, so a proposal recomputes the row's last partial block and
the tokens added since, not its history (blocks are found by their tokens' hashes, so one holding
drafts the target refused never matches a later prompt). The target verifies as for n-gram drafts
(engine/spec): the tokens are the plain engine's whatever the drafts.
"""
from __future__ import annotations

from dataclasses import replace

from jobrunner.engine.api.request import Request, SamplingParams
from jobrunner.engine.config.engine_config import ConfigError, EngineConfig
from jobrunner.engine.spec.speculator import Speculator


def speculator(config: EngineConfig, tokenizer, engine_class) -> Speculator | None:
    """The engine's speculator (None when off): n-gram drafts, or the draft model's (engine_class builds it)."""
    if config.speculative == "off":
        return None
    drafter = None
    if config.speculative == "draft" and not config.draft_model:
        raise ConfigError("speculative 'draft' needs a draft model (EngineConfig.draft_model)")
    if config.draft_model and config.speculative in ("draft", "auto"):
        drafter = DraftModelDrafter(engine_class(draft_config(config)))
        drafter.check_vocabulary(tokenizer)
    return Speculator(config.speculative, config.num_speculative_tokens, drafter)


def draft_config(config: EngineConfig) -> EngineConfig:
    """The draft model's engine: the target's device, dtype, threads and cache size; unquantized, no adapters,
    no speculation of its own, and its steps one at a time (a proposal waits for its tokens anyway)."""
    return replace(config, model=config.draft_model, draft_model=None, speculative="off", quantization="none",
                   loras=(), async_scheduling=False, batch_invariant=False, tensor_parallel=1,
                   enable_prefix_caching=True)


class DraftModelDrafter:
    """Proposes for many rows in one batch of the draft engine; forget() and close() as the drafter protocol.
    Costly: a proposal runs the draft model, so `auto` asks it only for the rows it lets draft (engine/spec)."""
    costly = True

    def __init__(self, engine):
        self.engine = engine

    def check_vocabulary(self, tokenizer) -> None:
        """ConfigError unless the draft model's tokenizer has the target's tokens at the same ids."""
        mine, theirs = self.engine.tokenizer, tokenizer
        same = mine.vocab_size == theirs.vocab_size and all(
            mine.token_bytes(i) == theirs.token_bytes(i) for i in range(theirs.vocab_size))
        if not same:
            self.close()
            raise ConfigError(f"the draft model's vocabulary differs from the model's ({mine.vocab_size} against "
                              f"{theirs.vocab_size} tokens, or other tokens at the same ids): a draft model must "
                              "share the model's tokenizer")

    def propose_rows(self, rows: list[tuple[int, list[int], int]], k: int) -> dict[int, list[int]]:
        """{seq_id: up to k greedy tokens of the draft model after tokens[:known]} for each (seq_id, tokens, known)."""
        requests = []
        for seq_id, tokens, known in rows:
            n = min(k, self.engine.max_model_len - known)
            if n > 0 and known > 0:
                requests.append(Request(id=f"{seq_id}", prompt_token_ids=list(tokens[:known]),
                                        sampling=SamplingParams(max_tokens=n, ignore_eos=True)))
        if not requests:
            return {}
        return {int(o.id): list(o.completions[0].token_ids) for o in self.engine.generate(requests)
                if o.error is None}

    def forget(self, seq_id: int) -> None:
        """Nothing kept per row: the draft engine's prefix cache holds what a later proposal reuses."""

    def close(self) -> None:
        self.engine.close()
