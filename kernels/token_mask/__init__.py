"""Structured output's token bitmask on the logits: reference and dispatch beside the Triton kernel."""
