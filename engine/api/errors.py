"""Errors the engine reports to its callers."""
from __future__ import annotations


class ModelError(Exception):
    """A model could not be found, fetched or read. The message names the file and the problem."""


class EngineFailure(RuntimeError):
    """The engine cannot go on (a rank of its tensor-parallel group died). The rows it had not returned
    are lost to this run; a rerun of the job redoes them."""
