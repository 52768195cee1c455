"""Rotary position embeddings: the torch reference and dispatch beside the Triton kernel."""
