"""jobrunner: batch LLM inference over datasets.

The Python API (jobrunner.api.submit, jobrunner.api.session), imported on first use so that `import jobrunner`
stays cheap:

    jobrunner.submit(dataset, output=None, **options) -> JobResult     # as `jobrunner submit`
    jobrunner.generate(rows, **options) -> polars.DataFrame            # rows in memory, nothing on disk
    with jobrunner.open_engine(model=..., **options) as llm:           # one engine for many calls
        llm.generate(rows, **options) -> polars.DataFrame
    jobrunner.compare(base, candidate, **gates) -> dict                # as `jobrunner compare --json`
    jobrunner.write_report(output, path=None) -> str                   # as `jobrunner report`
"""
from __future__ import annotations

from importlib import import_module
from pathlib import Path

# One installed name: the repository's folders engine/, kernels/ and jobs/ install as jobrunner.engine,
# jobrunner.kernels and jobrunner.jobs (setup.py's package-dir). Run from a checkout that was never
# installed (benchmarks/gpu_check.sh on a bare GPU machine), they are found beside this folder.
_CHECKOUT = Path(__file__).resolve().parent.parent
if not (Path(__file__).parent / "engine").is_dir() and (_CHECKOUT / "engine" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))

_MODULES = {"JobConfigError": "api.submit", "JobFailedError": "api.submit", "JobResult": "api.submit", "OutputStorageError": "api.submit",
            "submit": "api.submit", "EngineSession": "api.session", "generate": "api.session", "open_engine": "api.session",
            "compare": "report.compare", "write_report": "report"}
__all__ = sorted(_MODULES)


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(import_module(f"jobrunner.{_MODULES[name]}"), name)
    raise AttributeError(f"module 'jobrunner' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
