"""Errors the engine reports to its callers."""
from __future__ import annotations


class ModelError(Exception):
    """A model could not be found, fetched or read. The message names the file and the problem."""
