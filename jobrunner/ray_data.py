"""A Ray Data pipeline's hand-off to jobrunner and back: a Dataset written as Parquet parts, a job over
them, the results read back as a Dataset.

    from jobrunner.ray_data import submit_dataset, read_results_dataset
    result = submit_dataset(ds, "s3://lake/job/", max_tokens=64, ray="auto", data_parallel=8)
    out = read_results_dataset(result.output)           # a ray.data.Dataset, one row per output row

The input is written once under <root>/input/, then marked done (INPUT_DONE): a rerun after a kill finds it
and resumes the job over the same rows; an input without the mark (a write cut short) is written again. The
output is <root>/output/, a usual jobrunner output.
Read back, only the part files count: `ray.data.read_parquet` over the directory would also read
`_stats.parquet`.
"""
from __future__ import annotations

from jobrunner.common import storage
from jobrunner.api.submit import submit
from jobrunner.output import layout

INPUT_DONE = "_jobrunner_input_done"       # not *.parquet: the job's glob skips it


def result_paths(output_url: str) -> list[str]:
    """The output's part files, as URLs (what `ray.data.read_parquet` should read); OutputError if none."""
    fs, root = layout.output_fs(output_url)
    names = layout.part_names(fs, root)
    prefix = output_url.rstrip("/")
    return [f"{prefix}/{n}" for n in names]


def read_results_dataset(output_url: str, **read_parquet_args):
    """The job's results as a ray.data.Dataset."""
    import ray          # the optional extra (jobrunner[ray]): only to read the results back
    return ray.data.read_parquet(result_paths(output_url), **read_parquet_args)


def submit_dataset(ds, root: str, **options):
    """Write `ds` (with an id column and the prompt's columns) under root/input once, then run a job over it
    into root/output with jobrunner.submit's options (e.g. ray="auto"). Returns the JobResult."""
    fs, base = storage.url_fs(root)
    inputs, mark = storage.join(base, "input"), storage.join(storage.join(base, "input"), INPUT_DONE)
    if not fs.exists(mark):
        if fs.exists(inputs):
            fs.rm(inputs, recursive=True)
        ds.write_parquet(f"{root.rstrip('/')}/input")
        with fs.open(mark, "wb") as f:
            f.write(b"")
    return submit(f"{root.rstrip('/')}/input/*.parquet", f"{root.rstrip('/')}/output", **options)
