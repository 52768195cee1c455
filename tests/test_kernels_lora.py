"""The segmented gather matmul (kernels/lora/sgmv.py): the Triton kernel against the torch reference over
odd shapes, ranks and empty segments (CPU: Triton's interpreter)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from jobrunner.kernels.lora.sgmv import Segments, sgmv_ref  # noqa: E402
from jobrunner.kernels.lora.sgmv_triton import sgmv_triton  # noqa: E402

from tests.kernel_cases import device_dtype_cases  # noqa: E402


def _segments(lengths: list[int], slots: list[int], device) -> Segments:
    spans, row = [], 0
    for n, s in zip(lengths, slots):
        spans.append((row, n, s))
        row += n
    return Segments(spans, torch.device(device))


@pytest.mark.parametrize("device,dtype", device_dtype_cases())
@pytest.mark.parametrize("k,n,lengths,slots", [
    (64, 16, [1, 1, 1], [0, 1, 2]),                 # decodes, rank-16 shrink
    (16, 72, [5, 0, 17, 1], [2, 0, 1, 2]),          # expand to 72 columns, an empty segment
    (37, 3, [70, 2], [1, 0]),                       # odd K, rank 3, a long prefill segment
    (8, 33, [19], [1]),                             # K below the kernel's block
    (96, 48, [], []),                               # no segment: nothing changes
])
def test_sgmv_matches_the_reference(device, dtype, k, n, lengths, slots):
    g = torch.Generator().manual_seed(k * 1000 + n)
    t = sum(lengths) + 3                            # rows after the segments (base rows) stay untouched
    x = torch.randn(t, k, generator=g).to(device, dtype)
    w = (torch.randn(3, n, k, generator=g) / k ** 0.5).to(device, dtype)
    out = torch.randn(t, n, generator=g).to(device, dtype)
    seg = _segments(lengths, slots, device)
    ref = sgmv_ref(x.float(), w.float(), seg, out.float().clone())
    got = sgmv_triton(x, w, seg, out.clone())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)
    assert torch.equal(got[sum(lengths):], out[sum(lengths):])


def test_sgmv_writes_through_a_column_slice_view():
    """The expand step adds into y[:, offset:offset + size] of a fused projection's output."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 4, generator=g), torch.randn(2, 5, 4, generator=g)
    y = torch.zeros(9, 12)
    seg = _segments([4, 5], [1, 0], "cpu")
    ref = sgmv_ref(x, w, seg, torch.zeros(9, 5))
    sgmv_triton(x, w, seg, y[:, 6:11])
    torch.testing.assert_close(y[:, 6:11], ref)
    assert not y[:, :6].any() and not y[:, 11:].any()
