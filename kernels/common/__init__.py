"""What several kernels share: moving tensors to a device, and Triton's launch helpers."""
