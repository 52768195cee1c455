"""Gated activations (SiLU, GELU-tanh): the torch reference and dispatch beside the Triton kernel."""
