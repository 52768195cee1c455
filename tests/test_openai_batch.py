"""The full OpenAI batch request on a tiny random model: every honoured parameter against
transformers, unsupported ones as error rows naming them, and every output line parsed by the
official `openai` package's types."""
import json
import os

import polars as pl
import pytest
import torch
from openai.types import BatchError, Completion
from openai.types.chat import ChatCompletion

from jobrunner.config.job import job_config, JobConfigError
from jobrunner.pipeline.exit_codes import EXIT_OK
from jobrunner.pipeline.build import open_job
from jobrunner.openai.request import body_params, text_messages
from jobrunner.output import read_results
from tests.test_logits_process import _reference_greedy

USER = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def model_dir(tiny_hf_model_dir):
    return tiny_hf_model_dir("llama")


@pytest.fixture(scope="module")
def engine(model_dir):
    from jobrunner.pipeline.build import load_engine
    return load_engine(job_config("unused", model=str(model_dir), kv_cache_memory=8 * 2**20, device="cpu"))


@pytest.fixture(scope="module")
def hf(model_dir):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _run(engine, tmp_path, lines, **kw):
    """Both OpenAI files' lines by custom_id: exactly one line, in one of them, per input line."""
    ds = tmp_path / "batch.jsonl"
    ds.write_text("\n".join(json.dumps(x) for x in lines))
    kw.setdefault("served_model_name", ("tiny",))
    job = open_job(job_config(str(ds), output=str(tmp_path / "out"), output_format="openai-batch", **kw), engine=engine)
    res = job.run()
    assert res.exit_code == EXIT_OK
    ok = [json.loads(x) for x in open(os.path.join(res.output, "results.openai.jsonl"))]
    failed = [json.loads(x) for x in open(os.path.join(res.output, "errors.openai.jsonl"))]
    assert all(x["error"] is None for x in ok) and all(x["response"] is None for x in failed)
    assert sorted(x["custom_id"] for x in ok + failed) == sorted(x["custom_id"] for x in lines)
    assert res.stats["openai_output"] == {"results.openai.jsonl": len(ok), "errors.openai.jsonl": len(failed)}
    return {x["custom_id"]: x for x in ok + failed}, pl.from_arrow(read_results(res.output))


def _line(cid, url="/v1/chat/completions", **body):
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "tiny", **body}}


def _prompt_ids(engine, messages, **kwargs):
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    return engine.tokenizer.encode(text)


@pytest.mark.parametrize("key,value", [
    ("tools", [{"type": "web_search"}]), ("tool_choice", "required"),      # a tool that is no function; no tools
    ("functions", [{"name": "f"}]), ("audio", {"voice": "alloy"}), ("prediction", {"type": "content"}),
    ("modalities", ["text", "audio"]), ("reasoning_effort", "extreme"), ("stream", True),
    ("response_format", {"type": "xml"}), ("web_search_options", {"search_context_size": "low"}),
    ("no_such_parameter", 1), ("logprobs", 3),
])
def test_a_parameter_that_would_change_the_output_fails_the_row_naming_it(key, value):
    params, error = body_params({"messages": USER, key: value}, chat=True)
    assert params is None and key in error


def test_parameters_that_change_nothing_are_accepted_and_text_parts_joined():
    body = {"messages": USER, "user": "u1", "metadata": {"a": "b"}, "store": False, "service_tier": "auto",
            "stream": False, "tools": [], "response_format": {"type": "text"}, "max_completion_tokens": 4,
            "logit_bias": {"17": 3}, "logprobs": True, "top_logprobs": 2, "stop": ["x"]}
    params, error = body_params(body, chat=True)
    assert error is None
    assert params == {"max_tokens": 4, "logit_bias": [[17, 3.0]], "logprobs": 2, "stop": ["x"]}
    json_object = {"type": "json_object"}             # honoured: the row's constraint (jobs/constraint.py)
    assert body_params({"messages": USER, "response_format": json_object}, chat=True)[0] == \
        {"response_format": json_object}
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert text_messages(parts) == ([{"role": "user", "content": "a\nb"}], None)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert "image_url" in text_messages(image)[1]


def test_every_line_parses_with_the_openai_types_and_matches_transformers(engine, hf, tmp_path):
    penalties = dict(presence_penalty=1.5, frequency_penalty=0.8, repetition_penalty=3.0,
                     logit_bias={"17": 0.5}, min_tokens=6)
    parts = [{"role": "user", "content": [{"type": "text", "text": "The quick"}, {"type": "text", "text": "brown fox"}]}]
    lines = [
        _line("logprobs", messages=USER, max_tokens=6, logprobs=True, top_logprobs=3),
        _line("penalties", messages=USER, max_completion_tokens=10, **penalties),
        _line("sampled", messages=USER, max_tokens=5, temperature=1.0, seed=7, n=2, stop=["\n"], user="u"),
        _line("parts", messages=parts, max_tokens=4),
        _line("completion", url="/v1/completions", prompt="Hello world", max_tokens=5, logprobs=2),
        _line("tools", messages=USER, tools=[{"type": "function", "function": {"name": "f"}}]),
        _line("image", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]),
        _line("schema", messages=USER, response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
    ]
    out, df = _run(engine, tmp_path, lines)
    assert set(out) == {x["custom_id"] for x in lines}
    for cid in ("tools", "image", "schema"):
        assert out[cid]["response"] is None
    # the tiny model's template reads no `tools`: the line fails saying so, naming the key
    assert "takes no tools" in out["tools"]["error"]["message"] and out["tools"]["error"]["param"] == "tools"
    assert "image_url" in out["image"]["error"]["message"]
    assert "response_format" in out["schema"]["error"]["message"]
    assert all(BatchError.model_validate(x["error"]).message for x in out.values() if x["error"])
    bodies = {cid: x["response"]["body"] for cid, x in out.items() if x["response"]}
    chat = {cid: ChatCompletion.model_validate(b) for cid, b in bodies.items() if cid != "completion"}
    completion = Completion.model_validate(bodies["completion"])

    # logprobs: the chosen token's and the top 3, against transformers' greedy logits
    ids = _prompt_ids(engine, USER)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, pad_token_id=0)
    content = chat["logprobs"].choices[0].logprobs.content
    assert len(content) == 6
    for step, (entry, tok) in enumerate(zip(content, ref.sequences[0, len(ids):].tolist())):
        lp = torch.log_softmax(ref.logits[step][0].float(), -1)
        assert abs(entry.logprob - lp[tok].item()) < 1e-4
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(lp.topk(3).values.tolist(), abs=1e-4)
        assert bytes(entry.bytes) == engine.tokenizer.token_bytes(tok)
    row = df.filter(pl.col("id") == "logprobs")
    assert [e["logprob"] for e in row["logprobs"][0]] == [e.logprob for e in content]    # the Parquet column

    # penalties, logit_bias and min_tokens: the same text as transformers with the same processors
    pen = dict(penalties, logit_bias=((17, 0.5),), max_tokens=10)
    from jobrunner.engine.api.request import SamplingParams
    expected = _reference_greedy(hf, ids, SamplingParams(**pen), eos=2)
    assert chat["penalties"].choices[0].message.content == engine.tokenizer.decode(expected)
    assert chat["penalties"].usage.completion_tokens == len(expected) >= 6

    sampled = chat["sampled"]
    assert [c.index for c in sampled.choices] == [0, 1] and sampled.usage.completion_tokens <= 10
    assert sampled.usage.prompt_tokens == len(ids) and sampled.usage.completion_tokens_details.reasoning_tokens == 0
    assert chat["parts"].usage.prompt_tokens == len(_prompt_ids(engine, [{"role": "user", "content": "The quick\nbrown fox"}]))
    assert completion.object == "text_completion" and len(completion.choices[0].logprobs.tokens) <= 5
    # {token: logprob}: alternatives spelled alike (here ids past the tiny tokenizer's vocabulary) share a key
    assert all(1 <= len(t) <= 2 for t in completion.choices[0].logprobs.top_logprobs)


def test_chat_template_kwargs_reach_the_template(engine):
    from jobrunner.jobs import PromptBuilder
    from jobrunner.jobs.spec import JobSpec, PromptSpec
    tok = engine.tokenizer
    saved = tok.chat_template
    try:
        tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                             "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
        spec = JobSpec("generate", PromptSpec(chat_template_kwargs=(("enable_thinking", False),)))
        builder = PromptBuilder(spec, tok)
        assert builder.render({"prompt": "hi"})[0] == "hi<think></think>"
        from jobrunner.openai.row_options import row_options
        row = {"messages": USER, "params": {"chat_template_kwargs": {"enable_thinking": True}}}
        assert builder.render(row, row_options(row))[0] == "The quick brown fox"          # the row's own wins
    finally:
        tok.chat_template = saved


@pytest.mark.parametrize("mode", ["none", "left", "right"])
def test_truncate_prompt(engine, tmp_path, mode):
    long = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)     # ~400 tokens; context 256
    lines = [_line("long", url="/v1/completions", prompt=long, max_tokens=4),
             _line("long-copy", url="/v1/completions", prompt=long, max_tokens=4),    # computed once (dedup)
             _line("longer", url="/v1/completions", prompt="More words first. " + long, max_tokens=4),
             _line("short", url="/v1/completions", prompt="Hello", max_tokens=4)]
    out, df = _run(engine, tmp_path, lines, truncate_prompt=mode)
    n = len(engine.tokenizer.encode(long))
    long_row = df.filter(pl.col("id") == "long")
    if mode == "none":
        assert "exceeds the model's context" in out["long"]["error"]["message"]
        return
    assert long_row["error"][0] is None and long_row["prompt_tokens"][0] == 256 - 4
    assert long_row["truncated_tokens"][0] == n - (256 - 4)
    copy = df.filter(pl.col("id") == "long-copy")
    assert copy["reused"][0] and copy["truncated_tokens"][0] == n - (256 - 4)     # the copy's own count
    # cut left, a longer prompt keeps the same tokens: a copy of "long", with its own (larger) count
    longer = df.filter(pl.col("id") == "longer")
    assert longer["reused"][0] == (mode == "left")
    assert longer["truncated_tokens"][0] == len(engine.tokenizer.encode("More words first. " + long)) - (256 - 4) > n - 252
    assert df.filter(pl.col("id") == "short")["truncated_tokens"][0] == 0


@pytest.mark.parametrize("kw,words", [
    (dict(chat_template_kwargs="{not json"), "not valid JSON"),
    (dict(chat_template_kwargs="[1]"), "JSON object"),
    (dict(truncate_prompt="left", kind="score", score_column="x"), "generate only"),
    (dict(repetition_penalty=0.0), "repetition-penalty"),
    (dict(min_tokens=9, max_tokens=4), "min-tokens"),
    (dict(top_logprobs=21), "top-logprobs"),
])
def test_bad_options_stop_before_any_work(kw, words):
    with pytest.raises(JobConfigError, match=words):
        job_config("x.jsonl", **kw)


def test_generation_options_reach_the_sampling_parameters():
    p = job_config("x.jsonl", presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, min_tokens=3,
                  top_logprobs=2).sampling_params()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens, p.logprobs) == \
        (0.5, -0.5, 1.2, 3, 2)
    assert job_config("x.jsonl", logprobs=True).sampling_params().logprobs == 0
    assert job_config("x.jsonl").sampling_params().logprobs is None


def test_new_options_at_their_defaults_leave_the_fingerprint_as_it_was():
    from jobrunner.config.job import _ADDED_LATER
    assert not set(_ADDED_LATER) & set(job_config("x.jsonl").fingerprint_fields())
    assert job_config("x.jsonl", truncate_prompt="left").fingerprint_fields()["truncate_prompt"] == "left"
