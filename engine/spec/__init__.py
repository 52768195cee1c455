"""Speculative decoding: drafts proposed per row, verified by one forward of the target (engine/core)."""
