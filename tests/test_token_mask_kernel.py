"""The grammar-mask kernel (kernels/token_mask/token_mask_triton.py) against its torch reference, in Triton's
interpreter on CPU (and on the GPU when there is one)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from jobrunner.kernels.token_mask.token_mask import apply_token_bitmask, apply_token_bitmask_ref  # noqa: E402
from jobrunner.kernels.token_mask.token_mask_triton import apply_token_bitmask_triton  # noqa: E402
from tests.kernel_cases import device_dtype_cases  # noqa: E402


def random_bitmask(rows: int, words: int, gen: torch.Generator) -> torch.Tensor:
    bits = torch.randint(0, 2**32, (rows, words), generator=gen, dtype=torch.int64)
    return (bits - 2**31).to(torch.int32)        # every bit pattern, the sign bit included


@pytest.mark.parametrize("device,dtype", device_dtype_cases())
@pytest.mark.parametrize("rows,vocab,words", [(1, 32, 1), (3, 1000, 32), (5, 2051, 65), (2, 384, 10)],
                         ids=["one-word", "vocab-not-multiple-of-32", "odd", "mask-narrower-than-logits"])
def test_triton_matches_reference(device, dtype, rows, vocab, words):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype=dtype, device=device)
    mask = random_bitmask(rows, words, gen).to(device)
    expected = apply_token_bitmask_ref(logits.clone(), mask)
    got = apply_token_bitmask_triton(logits.clone(), mask)
    assert torch.equal(got, expected)
    assert torch.isinf(expected).any() and torch.isfinite(expected).any()


def test_reference_reads_bits_little_endian_within_words():
    logits = torch.zeros(2, 40)
    mask = torch.tensor([[0b101, 1 << 3], [-1, 0]], dtype=torch.int32)   # row 0: tokens 0, 2, 35
    out = apply_token_bitmask_ref(logits, mask)
    assert torch.isfinite(out[0]).nonzero()[:, 0].tolist() == [0, 2, 35]
    assert torch.isfinite(out[1]).nonzero()[:, 0].tolist() == list(range(32))


def test_launcher_checks_its_inputs():
    with pytest.raises(ValueError):
        apply_token_bitmask_triton(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError):
        apply_token_bitmask_triton(torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32))


def test_dispatch_takes_the_reference_on_cpu():
    logits, mask = torch.randn(3, 70), torch.tensor([[1, 0, 0]] * 3, dtype=torch.int32)
    assert torch.equal(apply_token_bitmask(logits.clone(), mask), apply_token_bitmask_ref(logits.clone(), mask))
