"""A checkpoint's generation_config.json: its EOS ids always stop generation; its sampling values
are the defaults of the options a job leaves unset (as vLLM), and the manifest says which value
came from where."""
import json
import shutil

import pytest

import jobrunner
from jobrunner.engine.config.generation import GenerationDefaults
from jobrunner.config.job import job_config, JobConfigError

SMALL = dict(chat=False, max_tokens=12, kv_cache_memory="4MB", seed=7)
ROWS = [{"id": str(i), "prompt": p} for i, p in enumerate(["The quick brown fox", "Numbers 0123", "Hello world!"])]


def test_defaults_read_from_a_generation_config():
    d = GenerationDefaults.from_config({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                        "min_p": 2, "repetition_penalty": 1.05, "presence_penalty": 0.0,
                                        "eos_token_id": [1, 2], "max_length": 20})
    assert d.sampling == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert set(d.ignored) == {"min_p", "repetition_penalty"} and "out of range" in d.ignored["min_p"]
    assert GenerationDefaults.from_config({"top_k": 2.5, "temperature": "hot"}).sampling == {}


def test_unset_options_take_the_checkpoint_defaults():
    model = {"temperature": 0.6, "top_k": 20}
    p = job_config("x").sampling_params(model)
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.6, 20, 1.0, 0.0)
    p = job_config("x", temperature=0.0, top_p=0.5).sampling_params(model)
    assert (p.temperature, p.top_k, p.top_p) == (0.0, 20, 0.5)
    assert job_config("x").sampling_params().temperature == 0.0              # no checkpoint defaults: greedy
    assert job_config("x", top_k=3).sampling_sources(model) == {
        "temperature": {"value": 0.6, "source": "generation_config.json"},
        "top_p": {"value": 1.0, "source": "default"}, "top_k": {"value": 3, "source": "job"},
        "min_p": {"value": 0.0, "source": "default"}}
    assert job_config("x", n=2).sampling_params(model).n == 2                # the checkpoint samples
    with pytest.raises(JobConfigError, match="identical samples"):
        job_config("x", n=2).sampling_params({})


def _model_with(src, tmp_path, **generation) -> str:
    path = tmp_path / "model"
    shutil.copytree(src, path)
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, **generation}))
    return str(path)


def _outputs(model, **options) -> list[tuple]:
    df = jobrunner.generate(ROWS, model=model, **{**SMALL, **options})
    return list(df.select("output", "finish_reason").iter_rows())


def test_a_job_samples_with_the_checkpoint_defaults(tiny_hf_model_dir, tmp_path):
    src = tiny_hf_model_dir("llama")
    model = _model_with(src, tmp_path, temperature=1.3, top_k=9, top_p=0.9)
    sampled = _outputs(model)
    assert sampled == _outputs(str(src), temperature=1.3, top_k=9, top_p=0.9)
    assert sampled != _outputs(str(src))                                     # not greedy
    assert _outputs(model, temperature=0.0) == _outputs(str(src))            # the job's value wins

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    result = jobrunner.submit(str(data), str(tmp_path / "out"), model=model, top_k=4, **SMALL)
    assert result.exit_code == 0
    sampling = json.loads((tmp_path / "out" / "_manifest.json").read_text())["sampling"]
    assert sampling["temperature"] == {"value": 1.3, "source": "generation_config.json"}
    assert sampling["top_k"] == {"value": 4, "source": "job"}
    assert sampling["min_p"] == {"value": 0.0, "source": "default"}

    from jobrunner.cli.validate import validate_job
    report = validate_job(job_config(str(data), model=model, top_k=4, chat=False))
    assert report["sampling"] == ("temperature 1.3 (generation_config.json), top_p 0.9 (generation_config.json), "
                                  "top_k 4 (job), min_p 0.0 (default)")


def test_every_eos_id_of_the_generation_config_stops(tiny_hf_model_dir, tmp_path):
    from jobrunner.engine.config.engine_config import EngineConfig
    from jobrunner.engine.core.engine import Engine
    from jobrunner.engine.api.request import Request, SamplingParams

    def generate(model):
        engine = Engine(EngineConfig(model=model, kv_cache_memory=4 * 2**20))
        prompt = engine.tokenizer.encode("The quick brown fox")
        return engine.generate([Request("r", prompt, SamplingParams(max_tokens=12))])[0]

    src = tiny_hf_model_dir("llama")
    free = generate(str(src)).token_ids
    stop_at = next(i for i, t in enumerate(free) if i > 0 and t not in free[:i])   # a token first seen there
    out = generate(_model_with(src, tmp_path, eos_token_id=[2, free[stop_at]]))
    assert out.finish_reason == "stop" and out.token_ids[:stop_at] == free[:stop_at]
