"""A Ray job's plan without a cluster: the driver's parts (job.build.open_parts on an engine's info,
tokenizer and config) ship PendingRows as the intake made them, and a worker's Job runs them as
they are: each row's request is made once, and the rows written are a one-process job's."""
import json
import pickle
from types import SimpleNamespace

import polars as pl

from jobrunner.config.job import job_config
from jobrunner.common.idset import IdSet
from jobrunner.pipeline.build import load_engine, open_job, open_parts
from jobrunner.pipeline.resolve import resolve
from jobrunner.parallel.ray_plan import Shipper


class Bundles:
    """A Ray worker's work source (ray_worker.QueueUnits) without the queue actor: the shipped bundles."""
    rank, world, part_prefix, hits_now = 1, 2, "part-r1", False

    def __init__(self, bundles):
        self.bundles = bundles

    def units(self, units, pending, writer):
        for bundle in self.bundles:
            for unit in bundle:
                yield unit, True


def counting(kind, calls: list):
    real = kind.request

    def request(row_id, *args):
        calls.append(row_id)
        return real(row_id, *args)
    kind.request = request


def test_a_rows_request_is_made_once_under_ray(tmp_path, tiny_hf_model_dir):
    rows = [{"id": "long", "prompt": "word " * 2000}, {"id": "short", "prompt": "hi"},
            {"id": "again", "prompt": "hi"}]       # a copy of `short` (dedup): its request is made (its key), then it ships with its leader
    ds = tmp_path / "rows.jsonl"
    ds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    opts = dict(model=str(tiny_hf_model_dir("llama")), truncate_prompt="left", max_tokens=4, chat=False)
    cfg = job_config(str(ds), output=str(tmp_path / "ray"), **opts)
    resolved = resolve(cfg, output_state=False)
    engine = load_engine(cfg, resolved)
    try:
        parts = open_parts(cfg, resolved, engine.info, engine.tokenizer, engine.config, part_prefix="part-plan")
        driver_calls, worker_calls, bundles = [], [], []
        counting(parts.kind, driver_calls)
        ray = SimpleNamespace(put=lambda units: pickle.loads(pickle.dumps(units)), get=lambda v: v)   # as Ray ships
        queue = SimpleNamespace(put=SimpleNamespace(remote=lambda queued: bundles.extend(r for _, _, (r,) in queued)))
        shipper = Shipper(ray, queue, world=2, out_tokens=4, window_rows=100, wait_room=lambda rows: None)
        planned = shipper.ship(parts, engine.info)
        assert sorted(driver_calls) == ["again", "long", "short"] and shipper.shipped_rows == 3 and planned["rows"] == 0
        (long,) = [p for bundle in bundles for unit in bundle for p in unit.rows if p.id == "long"]
        assert len(long.tokens) < 512       # shipped as the kind truncated it: the worker does not redo it

        job = open_job(cfg, resolved, engine=engine, work=Bundles(bundles), reader=list, done_ids=IdSet())
        counting(job.parts.kind, worker_calls)
        assert job.run().exit_code == 0 and worker_calls == []
        alone = open_job(job_config(str(ds), output=str(tmp_path / "alone"), **opts), engine=engine).run()
        assert alone.exit_code == 0
    finally:
        engine.close()
    ray_rows = pl.read_parquet(str(tmp_path / "ray" / "part-r1-*.parquet")).sort("id")
    alone_rows = pl.read_parquet(str(tmp_path / "alone" / "part-*.parquet")).sort("id")
    columns = ["id", "output", "prompt_tokens", "completion_tokens", "finish_reason", "truncated_tokens"]
    assert ray_rows.select(columns).equals(alone_rows.select(columns))
