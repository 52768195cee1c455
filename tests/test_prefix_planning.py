"""Issue 4's end-to-end check: a KV cache far smaller than the job, interleaved instruction prefixes.
Planning reaches the block-level optimum of cached tokens; without it the run falls well short."""
import json
import random

import pytest

from jobrunner.config.job import job_config
from jobrunner.pipeline.build import open_job

pytestmark = pytest.mark.default_model

WORDS = "alpha beta gamma delta river stone cloud paper orange window garden silver".split()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    rng = random.Random(5)
    prefixes = [f"Instruction set {k}: " + " ".join(rng.choices(WORDS, k=70)) for k in range(20)]
    rows = [{"id": f"{k}-{j}", "prompt": p + "\nInput: " + " ".join(rng.choices(WORDS, k=6))}
            for k, p in enumerate(prefixes) for j in range(3)]
    rng.shuffle(rows)
    path = tmp_path_factory.mktemp("prefix") / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def engine(default_gguf_path):
    from jobrunner.pipeline.build import load_engine
    return load_engine(job_config("unused", kv_cache_memory=32 * 10**6, max_num_seqs=8))


def run(engine, dataset, out, plan):
    engine.kv.pool.reset_prefix_cache()
    job = open_job(job_config(dataset, output=out, max_tokens=1, chat=False, plan=plan, kv_cache_memory=32 * 10**6,
                        max_num_seqs=8), engine=engine)
    return job.run().stats


def test_planning_reaches_block_optimum_and_no_plan_falls_short(engine, dataset, tmp_path):
    assert engine.rt.num_blocks < 50          # the cache holds fewer blocks than the prefixes need together
    planned = run(engine, dataset, str(tmp_path / "plan"), plan=True)
    unplanned = run(engine, dataset, str(tmp_path / "noplan"), plan=False)
    optimum = planned["block_optimum_cached_tokens"]
    assert optimum > 0 and unplanned["block_optimum_cached_tokens"] == optimum
    assert planned["cached_tokens"] >= 0.9 * optimum
    assert unplanned["cached_tokens"] < 0.6 * planned["cached_tokens"]
