"""What the layers above may read of a loaded engine: a frozen EngineInfo, built once when the
engine starts, and the Tokenizer protocol. No torch: jobs/ reads these."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from jobrunner.engine.config.embedding import CheckpointPooling
from jobrunner.engine.config.generation import GenerationDefaults


class Tokenizer(Protocol):
    """The tokenizer an engine serves with (engine.tokenizer.Tokenizer, or a checkpoint's own)."""
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def vocab_size(self) -> int: ...

    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str: ...


@dataclass(frozen=True)
class EngineInfo:
    source: str                     # what the engine loaded: a path, a URL or dummy:<name>
    device: str                     # "cpu", "cuda:0"
    device_type: str                # "cpu", "cuda"
    dtype: str                      # the weights' torch dtype, as str() names it ("torch.bfloat16")
    kv_dtype: str                   # the KV cache's, likewise
    max_model_len: int              # the longest sequence: the model's positions, or the KV cache's tokens if fewer
    max_num_seqs: int               # sequences in one step
    max_num_batched_tokens: int     # tokens in one step
    num_blocks: int                 # KV cache blocks
    block_size: int                 # tokens per block
    weight_bytes: int               # the model's weights as loaded (this rank's share under tensor parallel)
    load_s: float                   # seconds to load the model and size the KV cache
    hidden_size: int                # the model's, the size of an embedding
    vocab_size: int
    pooling: CheckpointPooling | None = None    # what the checkpoint says embeddings are
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)   # its sampling defaults
    quantization: str = "none"      # what the weights run as: ours (int4, ...) or a shipped checkpoint's scheme
    vision: bool = False            # takes images (Request.images): a vision-language model
    packed_weights: bool = False    # CPU float linears run on oneDNN over packed weights (engine/run/packed_weights.py)
    batch_invariant: bool = False   # a row's results do not depend on its batch (engine/run/batch_invariance.py)
