"""Reasoning models: where the answer starts (the engine's hook, engine.sequence.reasoning_end), the
text split into reasoning and answer, and both through a job to the OpenAI output."""
import json
import os

import pytest

from jobrunner.engine.api.request import Request, SamplingParams
from jobrunner.engine.schedule.sequence import Sequence
from jobrunner.jobs.reasoning import split_reasoning
from tests.tiny import engine_for, hf_model, prompts

MARKERS = ((100,), (101, 102))          # <think>, </think> as token ids (a closing tag of two tokens)


def _seq(prompt):
    return Sequence("r", list(prompt), len(prompt), SamplingParams(max_tokens=9, reasoning_markers=MARKERS))


def test_the_answer_starts_after_the_closing_tag():
    s = _seq([5, 6, 100])
    assert s.in_reasoning and s.reasoning_end is None
    for t in (7, 101, 8, 101):
        s.append_token(t)
    assert s.in_reasoning and s.num_reasoning_tokens == 4
    s.expect_token()
    s.append_token(102)                                   # the closing tag completes on a placeholder's token
    assert not s.in_reasoning and s.reasoning_end == 8 and s.num_reasoning_tokens == 5
    s.append_token(9)
    assert s.reasoning_end == 8 and s.fork(1).reasoning_end == 8


@pytest.mark.parametrize("prompt,end", [
    ([5, 6], None),                           # Qwen3 thinking: the model opens the reasoning itself
    ([5, 100], None),                         # R1: the template opened it
    ([5, 100, 7, 101, 102, 3], 6),            # Qwen3 with enable_thinking off: closed in the prompt
    ([101, 102, 100, 4], None),               # an earlier turn's closing tag, then a new opening
])
def test_the_prompt_decides_where_generation_starts(prompt, end):
    assert _seq(prompt).reasoning_end == end


@pytest.mark.parametrize("text,opened,expected", [
    ("<think>\nplan\n</think>\n\nAnswer", False, ("plan", "Answer")),
    ("plan</think>Answer", True, ("plan", "Answer")),                # R1: the template opened it
    ("<think>\nstill thinking", False, ("still thinking", None)),    # cut while reasoning: no answer (null)
    ("still thinking", True, ("still thinking", None)),              # R1, cut while reasoning
    ("<think>\nplan\n</think>", False, ("plan", None)),              # no answer after the reasoning
    ("Answer only", False, (None, "Answer only")),                   # no marker: all of it is the answer
])
def test_split_reasoning(text, opened, expected):
    assert split_reasoning("qwen3", text, opened) == expected
    assert split_reasoning("deepseek_r1", text, opened) == expected


def test_the_prompt_opening_the_reasoning_is_told_from_one_closing_it():
    from jobrunner.jobs.reasoning import prompt_opens_reasoning
    markers = ((100,), (101,))
    assert prompt_opens_reasoning([5, 100], markers)                 # R1's template
    assert not prompt_opens_reasoning([5, 100, 7, 101, 3], markers)  # closed (enable_thinking off)
    assert not prompt_opens_reasoning([5, 6], markers)               # Qwen3 thinking: the model opens it


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_engine_counts_reasoning_tokens(async_scheduling):
    engine = engine_for(hf_model("llama"), async_scheduling=async_scheduling)
    p = prompts(4, lengths=(6, 9))
    # a one-token closing tag that the bias makes the first token: one reasoning token
    forced = SamplingParams(max_tokens=6, ignore_eos=True, reasoning_markers=((100,), (101,)),
                            logit_bias=((101, 30.0),))
    outs = engine.generate([
        Request("closed-in-prompt", p[0] + [100, 101, 102], SamplingParams(max_tokens=4, ignore_eos=True,
                                                                           reasoning_markers=MARKERS)),
        Request("cut-while-reasoning", p[1], SamplingParams(max_tokens=4, ignore_eos=True, reasoning_markers=MARKERS)),
        Request("plain", p[1], SamplingParams(max_tokens=4, ignore_eos=True)),
        Request("n2", p[0], SamplingParams(max_tokens=4, ignore_eos=True, reasoning_markers=MARKERS, n=2,
                                           temperature=1.0, seed=3)),
        Request("forced", p[1], forced),
    ])
    by_id = {o.id: o for o in outs}
    assert by_id["closed-in-prompt"].completions[0].reasoning_tokens == 0
    assert by_id["cut-while-reasoning"].completions[0].reasoning_tokens == 4
    assert by_id["plain"].completions[0].reasoning_tokens is None
    assert [c.reasoning_tokens for c in by_id["n2"].completions] == [4, 4]
    assert by_id["forced"].token_ids[0] == 101 and by_id["forced"].completions[0].reasoning_tokens == 1


def test_job_splits_the_answer_and_reports_reasoning(tiny_hf_model_dir, tmp_path):
    from jobrunner.pipeline.build import load_engine
    from jobrunner.config.job import job_config
    from jobrunner.pipeline.build import open_job
    from openai.types.chat import ChatCompletion

    engine = load_engine(job_config("unused", model=str(tiny_hf_model_dir("llama")), kv_cache_memory=8 * 2**20))
    engine.tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
        "<think>\n\n</think>\n\n{% endif %}")
    line = lambda cid, **body: {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                                "body": {"messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 4,
                                         "ignore_eos": True, **body}}
    ds = tmp_path / "b.jsonl"
    ds.write_text("\n".join(json.dumps(x) for x in [
        line("thinking"), line("no-thinking", chat_template_kwargs={"enable_thinking": False})]))
    job = open_job(job_config(str(ds), output=str(tmp_path / "out"), output_format="openai-batch", reasoning_parser="qwen3"), engine=engine)
    res = job.run()
    out = {x["custom_id"]: ChatCompletion.model_validate(x["response"]["body"])
           for x in map(json.loads, open(os.path.join(res.output, "results.openai.jsonl")))}
    thinking, plain = out["thinking"], out["no-thinking"]
    # a random model writes no reasoning markers: all of its text is the answer, no reasoning, none counted
    # (it was once all reasoning with content "")
    message = thinking.choices[0].message
    assert message.content and len(engine.tokenizer.encode(message.content, add_special_tokens=False)) >= 1
    assert getattr(message, "reasoning", None) is None and getattr(message, "reasoning_content", None) is None
    assert thinking.usage.completion_tokens_details.reasoning_tokens == 0
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    assert not hasattr(plain.choices[0].message, "reasoning_content") or plain.choices[0].message.reasoning_content is None
    assert plain.usage.prompt_tokens > thinking.usage.prompt_tokens      # the template closed the reasoning
