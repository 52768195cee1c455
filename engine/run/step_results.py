"""What a launched step holds on the device until it is collected (LaunchedStep, its HostCopy), and what
collecting it returns (RunnerOutput): engine/run/model_runner.py fills them, engine/core reads them."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from jobrunner.engine.api.request import TokenLogprob
from jobrunner.engine.sample.sampler import DeviceSample


@dataclass
class RunnerOutput:
    sampled: dict[int, list[int]] = field(default_factory=dict)                 # seq_id -> tokens (one per sample)
    sample_logprobs: dict[int, list[TokenLogprob | None]] = field(default_factory=dict)
    token_logprobs: dict[int, list[float]] = field(default_factory=dict)        # seq_id -> scored tokens' logprobs
    token_greedy: dict[int, list[bool]] = field(default_factory=dict)           # seq_id -> each scored token is the argmax
    candidate_first: dict[int, list[float]] = field(default_factory=dict)       # seq_id -> logprob of each candidate's first token
    candidate_first_greedy: dict[int, list[bool]] = field(default_factory=dict)   # seq_id -> each first token is the argmax
    embeddings: dict[int, list[float]] = field(default_factory=dict)            # seq_id -> its pooled vector (EMBED)
    num_tokens: int = 0
    # host seconds: building inputs, enqueueing the forward, enqueueing logits + sampling, waiting for the results
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    wait_s: float = 0.0
    graphed: bool = False                 # the forward replayed a CUDA graph (or its padded stand-in)
    images_encoded: int = 0               # images the vision tower ran over this step
    images_reused: int = 0                # images whose tower output was at hand already


@dataclass
class LaunchedStep:
    """A step enqueued on the device. Its results stay there until `ModelRunner.collect`."""
    out: RunnerOutput
    sampled: DeviceSample | None = None
    sample_owners: list[int] = field(default_factory=list)                  # seq_id of each sampled row
    candidate_lp: torch.Tensor | None = None                                # [sum of counts]
    candidate_greedy: torch.Tensor | None = None                            # [sum of counts] bool: token == argmax
    candidate_owners: list[tuple[int, int]] = field(default_factory=list)   # (seq_id, number of candidates)
    score_lp: torch.Tensor | None = None                                    # [len(score_owners)]
    score_greedy: torch.Tensor | None = None                                # [len(score_owners)] bool: token == argmax
    score_owners: list[int] = field(default_factory=list)
    pooled: torch.Tensor | None = None                                      # [sum of sizes] float32 (engine/sample/pooling.py)
    pooled_owners: list[tuple[int, int]] = field(default_factory=list)      # (seq_id, size)
    fetch: HostCopy | None = None
    masked: tuple | None = None       # (logits [rows, vocab], their sequences, each row's position past its sequence's
                                      # last token, the previous launch's samples) awaiting a bitmask

    @property
    def awaits_mask(self) -> bool:
        return self.masked is not None


class HostCopy:
    """Device tensors copied into pinned host memory without waiting; wait() hands them over
    once the copies (and everything enqueued before them) are done."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.done = None
        if tensors and tensors[0].is_cuda:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self.host, tensors):
                h.copy_(t, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = [t.cpu() for t in tensors]

    def wait(self) -> list[torch.Tensor]:
        if self.done is not None:
            self.done.synchronize()
        return self.host
