"""Attention over the paged KV cache: the dispatch and its torch reference, the step's metadata,
the Triton kernels, the CPU prefill and the in-place CPU decode kernel (C, compiled at first use), KV stores."""
