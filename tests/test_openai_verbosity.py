"""OpenAI's verbosity hint (issue 58, item 15): /v1/responses' text.verbosity and chat completions' verbosity (low,
medium, high) are accepted, recorded in the row's params and echoed by the Response (text.verbosity); they change
nothing (our models have no such control). Another value is an error line naming the key."""
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from jobrunner.openai.errors import error_param
from jobrunner.openai.request import body_params
from jobrunner.openai.responses import parse_responses_body
from tests.test_openai_tools import ASK, _line, qwen, run_batch  # noqa: F401 (qwen: the tiny Qwen2 engine)


@pytest.mark.parametrize("verbosity", ["low", "medium", "high"])
def test_text_verbosity_is_accepted_as_a_hint(verbosity):
    data, error = parse_responses_body({"input": "Hi.", "text": {"verbosity": verbosity,
                                                                "format": {"type": "text"}}})
    assert error is None and data["params"]["verbosity"] == verbosity
    params, error = body_params({"messages": ASK, "verbosity": verbosity}, chat=True)
    assert error is None and params["verbosity"] == verbosity
    loud = parse_responses_body({"input": "Hi.", "text": {"verbosity": "loud"}})[1]
    assert "verbosity" in loud and error_param(loud, "/v1/responses") == "text"
    three = body_params({"messages": ASK, "verbosity": 3}, chat=True)[1]
    assert "verbosity" in three and error_param(three) == "verbosity"


def test_text_verbosity_is_echoed_by_the_response(qwen, tmp_path):
    line = {"custom_id": "v", "method": "POST", "url": "/v1/responses",
            "body": {"model": "tiny", "input": "Hi.", "max_output_tokens": 3, "text": {"verbosity": "low"}}}
    chat = _line("c", messages=ASK, max_tokens=3, verbosity="high")
    out = run_batch(qwen, tmp_path, [line, chat])
    r = Response.model_validate(out["v"]["response"]["body"])
    assert r.text.verbosity == "low" and r.text.format.type == "text"
    assert out["v"]["error"] is None and out["c"]["error"] is None
    assert ChatCompletion.model_validate(out["c"]["response"]["body"]).choices[0].finish_reason == "length"
