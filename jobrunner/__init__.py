"""jobrunner: batch LLM inference over datasets.

The Python API (jobrunner.api), imported on first use so that `import jobrunner` stays cheap:

    jobrunner.submit(dataset, output=None, **options) -> JobResult     # as `jobrunner submit`
    jobrunner.generate(rows, **options) -> polars.DataFrame            # rows in memory, nothing on disk
"""
from __future__ import annotations

__all__ = ["JobConfigError", "JobFailedError", "JobResult", "OutputStorageError", "generate", "submit"]


def __getattr__(name: str):
    if name in __all__:
        from jobrunner import api
        return getattr(api, name)
    raise AttributeError(f"module 'jobrunner' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
