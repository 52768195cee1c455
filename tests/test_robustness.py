"""Issue 10: hostile rows never crash a job; every row comes back with an output or an error."""
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobrunner.config.job import job_config
from jobrunner.pipeline.build import open_job

pytestmark = pytest.mark.default_model

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                      max_leaves=6)
prompts = st.one_of(values, st.text(min_size=1, max_size=60), st.just("word " * 9000))
rows = st.lists(st.fixed_dictionaries({"id": st.one_of(st.sampled_from(["a", "b", "c"]), st.text(max_size=8),
                                                       st.integers()),
                                       "prompt": prompts}, optional={"extra": values}),
                min_size=1, max_size=6)


@pytest.fixture(scope="module")
def engine(default_gguf_path):
    from jobrunner.pipeline.build import load_engine
    return load_engine(job_config("unused"))


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
# junk: one malformed line each (a newline inside would make it two lines, and two error rows)
@given(data=rows, junk=st.lists(st.binary(max_size=20).map(lambda b: b.replace(b"\n", b"")), max_size=2))
def test_any_rows_give_one_result_each(engine, tmp_path_factory, data, junk):
    d = tmp_path_factory.mktemp("h")
    lines = [json.dumps(r).encode() for r in data] + [b"\xff" + j for j in junk]
    (d / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    job = open_job(job_config(str(d / "in.jsonl"), output=str(d / "out"), max_tokens=1), engine=engine)
    result = job.run()
    from jobrunner.output import read_results
    table = read_results(str(d / "out")).to_pylist()
    assert len(table) == len(lines)                      # nothing lost, nothing merged
    for row in table:
        assert (row["error"] is None) != (row["finish_reason"] == "error")
    assert result.stats["rows"] == len(lines)
