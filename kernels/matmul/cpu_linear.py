"""Float32 and bfloat16 linears on the CPU with their weights packed once into oneDNN's blocked layout, or, for
float32 where the CPU has AVX-512, into the panels of our own kernel (cpu_f32.py: faster at decode sizes,
0.94-1.04x oneDNN at prefill sizes; PackedLinear's panel form).

torch's F.linear runs float32 on MKL's sgemm. On a 2-core AVX-512 EPYC, oneDNN over a weight
reordered once ran the default model's shapes 2.2-3.5x faster at every row count from 1 to 2048
(benchmarks/cpu_linear.py), and one layout serves every row count (a weight packed for 1, 64 or 512
rows ran each count within 10% of the best), so no batch-size buckets are kept: the packed weight
replaces the dense one and costs no memory (an lm_head tied to the embeddings gets its own copy).

Float32: not bit-exact against F.linear (MKL): oneDNN sums in another order. Both are float32 rounding of
the exact product, within `packed_error`'s bound of it (checked at packing, and in tests/test_cpu_linear.py); greedy
tokens still match transformers on the parity tests.
Bfloat16: F.linear runs oneDNN already, but reorders the weight at every call; packed it gave the
same bits, 1.1-2x faster at decode batch sizes (the lm_head most). Off: EngineConfig.packed_weights.

Batch invariance: a row's product must not depend on how many rows share the call. oneDNN's blocking over
rows leaves each row's sum over K in one order from 2 rows up (2 to 2048 rows, 1 and 2 threads, float32
and bfloat16, on an AVX-512 EPYC), but one row alone takes a matrix-vector path that sums in another
order where K is large (1536: yes; 576: no). So the invariant form (`min_rows=2`) runs a lone row as two
(the row twice; the decode of one sequence, where the weights' reading is the cost, not the second row),
and `check_row_invariant` asserts the property at packing, per shape, so a oneDNN that sums otherwise
is refused rather than trusted (tests/test_determinism.py holds it over the shapes above).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from jobrunner.kernels.matmul.cpu_f32 import f32_matmul_cpu, pack_panels, pad_bias

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packed_error(packed_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                 ) -> float:
    """The largest |packed - exact| (x @ weight.T + bias in float64) over the bound a float32-accumulated product
    keeps to whatever order its K terms are summed in: at most 1 for a sound product. The bound, per output
    element: gamma_{K+1} * sum |x| |w|, the worst case of a sum of K + 1 terms (Higham, Accuracy and Stability,
    3.1), plus the output dtype's own rounding (a whole ulp: binade edges). A tolerance scaled to a typical error
    instead (a few ulps of sqrt(K) max|x| max|w|) refused a sound 2048 x 16384 float32 weight; a broken build
    (a wrong layout) misses this one by orders of magnitude."""
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    u, k = torch.finfo(torch.float32).eps / 2, x.shape[-1] + 1
    bound = k * u / (1 - k * u) * magnitude + torch.finfo(weight.dtype).eps * exact.abs()
    return ((packed_out.double() - exact).abs() / bound.clamp_min(1e-300)).max().item()


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) for a weight made just now, a dequantized slice of a quantized one: oneDNN over
    the plain weight on CPU in float32 and bfloat16 (1.1-1.4x MKL's F.linear on slices of 1M weights at 128 to
    2,048 rows, AMD EPYC 2 cores, RESULTS.md), else F.linear. Not F.linear's last bits (another sum order)."""
    if (x.device.type == "cpu" and x.dim() == 2 and x.dtype in PACKED_DTYPES and weight.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype) and packing_available()):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight.contiguous(), bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


@functools.lru_cache(maxsize=None)
def packing_available() -> bool:
    """Whether this torch has oneDNN's linear ops (x86 and arm builds with mkldnn do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """nn.Linear's forward over a weight packed once; in/out_features as nn.Linear's. Two forms: oneDNN's
    layout (PACKED_DTYPES), or, for float32 where `panel_kernel` (a cpu_f32.F32Library) is given, the panels of
    cpu_f32.c's kernel, faster at decode sizes (cpu_f32.py). Either replaces the dense weight."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 64, min_rows: int = 1, panel_kernel=None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.panel_kernel = panel_kernel if linear.weight.dtype == torch.float32 else None
        # 2: batch-invariant in oneDNN's form (a lone row runs as two; module docstring); the panel form is
        # invariant at one row
        self.min_rows = 1 if self.panel_kernel is not None else min_rows
        if self.panel_kernel is not None:
            self.register_buffer("weight", pack_panels(linear.weight))
            self.bias = pad_bias(linear.bias, self.weight)
        else:
            self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(),
                                                                                    batch_hint))
            self.bias = None if linear.bias is None else linear.bias.detach()

    @property
    def row_invariant(self) -> bool:
        """Whether a row's product has the same bits at any rows a call (the batch-invariant mode's need)."""
        return self.panel_kernel is not None or self.min_rows >= 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panel_kernel is not None:
            return f32_matmul_cpu(x, self.weight, self.bias, self.out_features, self.panel_kernel)
        if x.dim() == 2 and x.shape[0] < self.min_rows:
            x2 = x.expand(self.min_rows, -1) if x.shape[0] == 1 else x.new_zeros(self.min_rows, x.shape[1])
            return self._linear(x2.contiguous())[:x.shape[0]]
        return self._linear(x.contiguous())

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        form = "panels" if self.panel_kernel is not None else "packed"
        return f"in_features={self.in_features}, out_features={self.out_features}, {form}"


def pack_linear(linear: nn.Linear, batch_hint: int = 64, check: bool = True, batch_invariant: bool = False,
                panel_kernel=None) -> PackedLinear:
    """linear packed (panel_kernel: the float32 panel form's library, or None: oneDNN's); with `check`, ValueError when
    the packed product strays from F.linear's (a broken build: one check per shape and dtype finds it, the
    kernel being the same), and, batch_invariant, when a row's product depends on the rows beside it
    (check_row_invariant)."""
    packed = PackedLinear(linear, batch_hint, min_rows=2 if batch_invariant else 1, panel_kernel=panel_kernel)
    if not check:
        return packed
    if batch_invariant:
        check_row_invariant(packed)
    g = torch.Generator().manual_seed(0)
    w = linear.weight
    x = torch.randn(3, linear.in_features, generator=g).to(w.dtype)
    with torch.inference_mode():
        error = packed_error(packed(x), x, w.detach(), None if linear.bias is None else linear.bias.detach())
    if not error <= 1:
        raise ValueError(f"packed linear {linear.in_features}->{linear.out_features} strays from the exact product "
                         f"({error:.3g}x the bound of any float32 summation order)")
    return packed


INVARIANCE_ROWS = (1, 2, 3, 17, 64, 300)   # the call sizes check_row_invariant compares (1: a lone row)


def check_row_invariant(packed: PackedLinear) -> None:
    """ValueError unless every row of `packed`'s product has the same bits at each of INVARIANCE_ROWS rows a
    call and at 1 and at the current threads: the property the batch-invariant mode rests on."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(max(INVARIANCE_ROWS), packed.in_features, generator=g).to(packed.weight.dtype)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        want = packed(x)
        for n in {1, threads}:
            torch.set_num_threads(n)
            try:
                same = all(torch.equal(packed(x[:m]), want[:m]) for m in INVARIANCE_ROWS)
            finally:
                torch.set_num_threads(threads)
            if not same:
                raise ValueError(f"packed linear {packed.in_features}->{packed.out_features}: a row's product depends "
                                 f"on the rows beside it here ({n} threads); no batch-invariant linear on this CPU")
