"""Resumable, atomic Parquet output directory on any fsspec URL.

    layout.py      the files of an output directory, which are ours, OutputError
    values.py      value typing, pinned kinds, the Arrow schema, to_json
    manifest.py    the manifest, fingerprint, config diff; the resume and overwrite policy
    parts.py       ResultWriter: buffered rows written as atomic, resumable parts
    done.py        what the parts hold, by each id's occurrence: the rows a resumed job skips
    memory.py      RowSink: result rows kept in memory, as the parts would hold them (jobrunner.generate)
    completion.py  the end of a job: _stats.json/_stats.parquet, the manifest marked complete
    readers.py     reading parts, stored values, the stats and the manifest back

Each module's docstring states the invariants it keeps.
"""

from jobrunner.output.completion import mark_complete, write_stats
from jobrunner.output.layout import OutputError
from jobrunner.output.manifest import check_output, fingerprint, prepare_output
from jobrunner.output.memory import RowSink
from jobrunner.output.parts import ResultWriter
from jobrunner.output.readers import iter_result_parts, read_manifest, read_results, read_stats, stored_values
from jobrunner.output.values import EXTRA_JSON, FIXED_COLUMNS

__all__ = ["OutputError", "ResultWriter", "RowSink", "prepare_output", "check_output", "fingerprint", "read_results",
           "iter_result_parts", "stored_values", "read_stats", "read_manifest", "write_stats",
           "mark_complete", "FIXED_COLUMNS", "EXTRA_JSON"]
