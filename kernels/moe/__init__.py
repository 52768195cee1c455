"""Mixture of experts: routing and the experts' matmuls, reference and dispatch beside the Triton kernel."""
