"""No result column ever replaces an input column: inputs that collide are kept as input_<name>."""
import json

import polars as pl
import pytest

from jobrunner.output.columns import input_names, reserved_columns
from jobrunner.config.job import job_config
from jobrunner.pipeline.exit_codes import EXIT_OK
from jobrunner.pipeline.build import open_job
from jobrunner.output import read_results
from jobrunner.jobs import KINDS


def test_colliding_inputs_are_prefixed_and_stay_distinct():
    reserved = reserved_columns(("label", "correct"))
    names = input_names(["text", "label", "input_label", "output", "id", "extra_json"], reserved)
    assert names == {"text": "text", "label": "input_input_label", "input_label": "input_label",
                     "output": "input_output", "id": "input_id", "extra_json": "input_extra_json"}
    assert len(set(names.values())) == len(names)
    assert not set(names.values()) & reserved


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_declares_the_columns_it_adds(kind):
    assert KINDS[kind].result_columns, kind


def _run(model_dir, tmp_path, rows, **kw):
    tmp_path.mkdir(exist_ok=True)
    ds = tmp_path / "ds.jsonl"
    ds.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = job_config(str(ds), model=str(model_dir), output=str(tmp_path / "out"), **kw)
    job = open_job(cfg)
    res = job.run()
    assert res.exit_code == EXIT_OK
    return pl.from_arrow(read_results(res.output)).sort("id"), res.stats


def test_classify_keeps_the_gold_label_column(tiny_hf_model_dir, tmp_path):
    gold = ["yes", "no", "no", "yes"]
    rows = [{"id": f"r{i}", "prompt": f"question {i}", "label": g, "confidence": "high", "correct": "?",
             "label_probs": 0.5, "label_logprobs": "x"} for i, g in enumerate(gold)]
    df, stats = _run(tiny_hf_model_dir("llama"), tmp_path, rows, kind="classify", labels=("yes", "no"),
                     reference_column="label")
    assert df["input_label"].to_list() == gold                      # the gold labels survive
    assert set(df["label"]) <= {"yes", "no"}                        # the prediction
    assert df["input_confidence"].to_list() == ["high"] * 4
    assert df["input_correct"].to_list() == ["?"] * 4
    assert df["input_label_probs"].to_list() == [0.5] * 4
    assert df["input_label_logprobs"].to_list() == ["x"] * 4
    assert df["correct"].to_list() == [p == g for p, g in zip(df["label"], gold)]
    assert stats["metrics"]["accuracy"] == sum(df["correct"]) / 4


def test_generate_and_score_keep_inputs_named_like_their_columns(tiny_hf_model_dir, tmp_path):
    rows = [{"id": "a", "prompt": "hello", "output": "old output", "sample_index": "s", "finish_reason": "f"}]
    df, _ = _run(tiny_hf_model_dir("llama"), tmp_path / "g", rows, max_tokens=2, n=2, temperature=1.0, seed=1)
    assert df["input_output"].to_list() == ["old output"] * 2
    assert sorted(df["sample_index"]) == [0, 1] and df["input_sample_index"].to_list() == ["s", "s"]
    assert df["input_finish_reason"].to_list() == ["f", "f"]

    rows = [{"id": "a", "prompt": "hello", "cont": " world", "logprob": -1.5, "perplexity": "p",
             "scored_tokens": 3, "mean_logprob": 0}]
    df, _ = _run(tiny_hf_model_dir("llama"), tmp_path / "s", rows, kind="score", score_column="cont")
    assert df["input_logprob"].to_list() == [-1.5] and df["input_perplexity"].to_list() == ["p"]
    assert df["input_scored_tokens"].to_list() == [3] and df["input_mean_logprob"].to_list() == [0]
    assert df["logprob"][0] < 0 and df["scored_tokens"][0] >= 1
