"""The batch-invariant mode (EngineConfig.batch_invariant) on CPU: what it covers, refused where it does not,
and the model made so.

A row's results (tokens, logprobs, scores, embeddings) come out bit for bit the same whatever else is in
its step and however the scheduler runs it (max_num_seqs, the step's token budget and so the prefill
chunks, prefix-cache hits, the thread count). Each op whose sum order could follow the batch has a form
whose order a row's own inputs fix:

    linears        oneDNN over packed weights, a lone row run as two (kernels/matmul/cpu_linear.py;
                   the property checked at packing, per shape)
    attention      every token a row of its own through the in-place kernel, its keys in splits of a fixed
                   size from its first key (kernels/attention/attention.py: _invariant_cpu): a prefill token
                   and a decode at the same position reduce alike, so a cached prefix gives the bits its
                   recomputation would
    norms, softmax, logsumexp, rotary, activations
                   per row already (torch's CPU kernels split rows, not a row's sum, between threads;
                   tests/test_determinism.py holds them to it)
    sampling       each row's uniform from its own seed, sample and position (engine/sample/sampler.py)
    mean pooling   a running sum in position order across chunks (engine/sample/pooling.py)
    experts        each expert's two projections packed in the linears' invariant form (Experts.pack, by
                   engine/run/packed_weights.pack_experts), whatever number of tokens a step routes to it;
                   the routing weights' renormalizing sum and each token's k results added in a fixed order
                   (kernels/moe/moe.py: route_topk, combine_in_expert_order: index_add_'s order and bits);
                   the shared expert's sigmoid gate all on torch's scalar path (engine/models/moe.py)
    vision tower   each image through the tower alone, its attention on torch's math path
                   (engine/run/image_embeds.py: the CPU flash kernel's blocks follow the batch and threads)

Elementwise ops are per element only where no element's path follows the tensor's size: torch's CPU
kernels run whole vectors and the rest by a scalar loop that rounds sigmoid, silu and gelu(tanh) otherwise,
so an activation over a tensor whose size follows the batch (a [T, 1] column; rows of a width not a multiple
of the vector) can differ; the model's activations run over rows of their own (a strided half, as
silu_and_mul's) or widths of whole vectors (tests/test_determinism_moe_vision.py, the MoE block).

Not covered yet, refused here with a ConfigError rather than run without the property: GPUs (Triton),
quantized linears (ours or a checkpoint's, quantized experts among them), int8 KV caches, LoRA, tensor
(and so expert) parallelism, and F.linear (packed weights off or no oneDNN).

The GPU forms of the ops exist and are held to the property in Triton's interpreter on CPU
(tests/test_invariant_triton.py): a fixed-tile matmul (kernels.ops.InvariantLinear: no tiles or split-K
chosen by the batch, as cuBLAS's are), attention with every token a row over its own keys in splits of
INVARIANT_SPLIT keys combined in split order (paged_attention on CUDA tensors with meta.batch_invariant),
and the RMSNorm kernel, one row a program already. The engine does not use them yet: putting
InvariantLinear in place of the nn.Linear modules on CUDA, and the runner's GPU path (CUDA graphs' fixed
grids, the sampler's and pooling's CUDA ops), wait for a run on a GPU, so a CUDA device is still refused.
"""
from __future__ import annotations

import torch
from torch import nn

from jobrunner.engine.config.engine_config import ConfigError, EngineConfig
from jobrunner.engine.models.moe import Experts
from jobrunner.kernels.ops import PackedLinear


def check_config(config: EngineConfig, bundle, device: torch.device, kv_dtype: torch.dtype) -> None:
    """ConfigError naming what a batch-invariant engine of `config` over `bundle` does not cover."""
    refused = [
        (device.type != "cpu", f"device {device.type} (the invariant Triton kernels exist, tested in Triton's "
                               "interpreter: kernels.ops.InvariantLinear, paged_attention with meta.batch_invariant; "
                               "the engine's GPU path awaits a run on a GPU)"),
        (config.quantization != "none", f"--quantization {config.quantization}"),
        (getattr(bundle, "quantization", None) is not None, "a quantized checkpoint"),
        (kv_dtype not in (torch.float32, torch.bfloat16, torch.float16), f"a {kv_dtype} KV cache"),
        (bool(config.loras), "LoRA adapters"),
        (config.tensor_parallel > 1, "tensor parallelism"),
        (not config.packed_weights, "--no-packed-weights (F.linear's sums follow the batch)"),
    ]
    what = [why for bad, why in refused if bad]
    if what:
        raise ConfigError(f"--deterministic (batch-invariant results) does not cover {', '.join(what)} yet; "
                          "drop --deterministic or those options")


def check_model(model: nn.Module, decode_kernels) -> None:
    """ConfigError unless every linear of `model` is packed in its invariant form and the in-place attention
    kernel loads (decode_kernels: the runner's engine.run.cpu_decode.DecodeKernels)."""
    dense = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    loose = [name for name, m in model.named_modules() if isinstance(m, PackedLinear) and not m.row_invariant]
    loose += [name for name, m in model.named_modules() if isinstance(m, Experts) and m.packed is None]
    if dense or loose:
        raise ConfigError(f"--deterministic: linears not packed for batch invariance: {', '.join((dense + loose)[:4])}"
                          " (this torch's oneDNN may be missing)")
    if decode_kernels is None or decode_kernels.library() is None:
        raise ConfigError("--deterministic needs the in-place CPU attention kernel, which did not build or load "
                          "(a C compiler as $CC or cc; JOBRUNNER_CPU_DECODE=auto)")
