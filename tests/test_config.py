"""The job configuration without a model: TOML keys checked by type with the command line's
conversions, the default output location, the chat default by kind, option checks."""
import dataclasses
import json
import types

import pytest
from click.testing import CliRunner

from jobrunner.cli.main import build_config, main, submit
from jobrunner.config.job import JobConfig, job_config, JobConfigError, config_fields, field_value
from jobrunner.jobs import PromptBuilder


def config_from(tmp_path, toml: str, *args: str) -> JobConfig:
    """The JobConfig that `submit ds --config job.toml ARGS` would run (nothing runs)."""
    path = tmp_path / "job.toml"
    path.write_text(toml)
    ctx = submit.make_context("submit", ["ds.jsonl", "--config", str(path), *args])
    params = {k: v for k, v in ctx.params.items() if k != "dataset"}
    return build_config(ctx, "ds.jsonl", params)


GOOD_TOML = [
    ('stop = "Paris"', "stop", ("Paris",)),               # one stop string, not P, a, r, i, s
    ('stop = ["a", "b"]', "stop", ("a", "b")),
    ('labels = "yes, no,maybe"', "labels", ("yes", "no", "maybe")),   # comma-separated, as --labels
    ('labels = ["yes", "no, really"]', "labels", ("yes", "no, really")),
    ("chat = false", "chat", False),
    ("chat = true", "chat", True),
    ("temperature = 1", "temperature", 1.0),
    ("max-tokens = 7", "max_tokens", 7),
    ("seed = 3", "seed", 3),
    ('kv_cache_memory = "1GiB"', "kv_cache_memory", 2**30),
    ("kv_cache_memory = 1024", "kv_cache_memory", 1024),
    ("max_error_rate = 0.5", "max_error_rate", 0.5),
    ('template = "Q: {q}\\nA:"', "template", "Q: {q}\nA:"),
]


@pytest.mark.parametrize("toml,key,value", GOOD_TOML)
def test_toml_values_convert_like_the_command_line(tmp_path, toml, key, value):
    kind = 'kind = "classify"\n' if key == "labels" else ""     # labels: a classify job's
    got = config_from(tmp_path, kind + toml + "\n").options()[key]
    assert got == value and type(got) is type(value)


BAD_TOML = [
    ('chat = "no"', "chat", "true or false"),              # was truthy: chat turned on
    ('max_tokens = "sixty"', "max_tokens", "an integer"),  # was a traceback
    ('temperature = "hot"', "temperature", "a number"),    # was a traceback
    ("labels = 5", "labels", "a string or a list of strings"),   # was a traceback
    ('choice = " , "', "choice", "holds no value"),       # was run unconstrained
    ("stop = 5", "stop", "a string or a list of strings"),
    ('stop = ["a", 1]', "stop", "a string or a list of strings"),
    ("max_tokens = true", "max_tokens", "an integer"),
    ("max_tokens = 1.5", "max_tokens", "an integer"),
    ("chat = 1", "chat", "true or false"),
    ("model = 3", "model", "a string"),
    ('kv_cache_memory = "lots"', "kv_cache_memory", "cannot read size"),
    ("kv_cache_memory = 1.5", "kv_cache_memory", "a size"),
    ("max_error_rate = [0.1]", "max_error_rate", "a number"),
]


@pytest.mark.parametrize("toml,key,expected", BAD_TOML)
def test_toml_value_of_the_wrong_type_exits_2_naming_the_key(tmp_path, toml, key, expected):
    with pytest.raises(JobConfigError, match=key) as e:
        config_from(tmp_path, toml + "\n")
    assert expected in str(e.value)
    (tmp_path / "ds.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    r = CliRunner().invoke(main, ["validate", str(tmp_path / "ds.jsonl"), "--config", str(tmp_path / "job.toml")])
    assert r.exit_code == 2 and key in r.output and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("name", sorted(config_fields()))
def test_every_field_is_type_checked(name):
    if name == "lora":                           # a table of adapters: {name: path}
        assert field_value(name, {"a": "/x"}) == field_value(name, ["a=/x"]) == (("a", "/x"),)
        with pytest.raises(JobConfigError, match=name):
            field_value(name, 3)
        return
    if name == "chat_template_kwargs":           # the other field that takes a table: as its JSON text
        assert json.loads(field_value(name, {"enable_thinking": False})) == {"enable_thinking": False}
        with pytest.raises(JobConfigError, match=name):
            field_value(name, 3)
        return
    with pytest.raises(JobConfigError, match=name):
        field_value(name, {"a": "table"})
    default = config_fields()[name].default
    if default is not None and default is not dataclasses.MISSING:
        assert field_value(name, default) == default


def test_command_line_wins_over_toml_with_the_same_conversions(tmp_path):
    cfg = config_from(tmp_path, 'kind = "classify"\nstop = "x"\nlabels = "a,b"\nmax_tokens = 9\nkv_cache_memory = "1MB"\n',
                      "--stop", "Paris", "--labels", "yes, no", "--kv-cache-memory", "2MB")
    assert cfg.sampling.stop == ("Paris",) and cfg.kind.labels == ("yes", "no") and cfg.engine.kv_cache_memory == 2 * 10**6
    assert cfg.sampling.max_tokens == 9 and cfg.input.dataset == "ds.jsonl"


@pytest.mark.parametrize("dataset,output", [
    ("x.csv", "x.csv.results"),
    ("x.jsonl", "x.jsonl.results"),                       # was x.results for both
    ("data/x.jsonl.gz", "data/x.jsonl.results"),
    ("s3://b/x.parquet.zst", "s3://b/x.parquet.results"),
    ("data/part-*.parquet", "data/part-_.parquet.results"),
    ("data/parts/", "data/parts.results"),
])
def test_default_output_keeps_the_format_suffix(dataset, output):
    assert job_config(dataset).output_url == output


def test_negative_device_hourly_cost_is_refused(tmp_path):
    with pytest.raises(JobConfigError, match="device-hourly-cost"):
        job_config("x", device_hourly_cost=-1.0)
    job_config("x", device_hourly_cost=0.0)
    r = CliRunner().invoke(main, ["validate", str(tmp_path / "x.jsonl"), "--device-hourly-cost", "-2"])
    assert r.exit_code == 2 and "--device-hourly-cost" in r.output


def test_show_prompt_does_not_change_the_fingerprint():
    assert job_config("x", show_prompt=True).fingerprint_fields() == job_config("x").fingerprint_fields()


class ChatTokenizer:
    has_chat_template = True

    def apply_chat_template(self, messages, add_generation_prompt):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


# what a kind's configuration cannot be built without
KIND_NEEDS = {"generate": {}, "classify": {"labels": ("a", "b")}, "score": {"score_column": "s"}}


@pytest.mark.parametrize("kind,chat,rendered", [
    ("generate", None, "<user>hello<assistant>"),
    ("classify", None, "hello"),            # raw text, as lm-eval scores it
    ("score", None, "hello"),               # raw text, as vLLM's prompt logprobs score it
    ("classify", True, "<user>hello<assistant>"),
    ("generate", False, "hello"),
])
def test_chat_template_default_by_kind(kind, chat, rendered):
    cfg = job_config("x", kind=kind, chat=chat, **KIND_NEEDS[kind])
    assert PromptBuilder(cfg.job_spec(), ChatTokenizer()).render({"prompt": "hello"})[0] == rendered


@pytest.mark.parametrize("kind", ["generate", "classify", "score"])
def test_messages_always_use_the_chat_template(kind):
    cfg = job_config("x", kind=kind, messages_column="m", chat=False, **KIND_NEEDS[kind])
    row = {"m": [{"role": "user", "content": "hi"}]}
    assert PromptBuilder(cfg.job_spec(), ChatTokenizer()).render(row)[0] == "<user>hi<assistant>"
    from jobrunner.openai.row_options import row_options
    openai_row = {"params": {}, "messages": [{"role": "user", "content": "hi"}]}
    spec = job_config("x", kind=kind, **KIND_NEEDS[kind]).job_spec()
    assert PromptBuilder(spec, ChatTokenizer()).render(openai_row, row_options(openai_row))[0] == "<user>hi<assistant>"


def test_system_prompt_escapes_like_the_template():
    cfg = job_config("x", system=r"Be brief.\nNo lists.")
    expected = "<system>Be brief.\nNo lists.<user>q<assistant>"
    assert PromptBuilder(cfg.job_spec(), ChatTokenizer()).render({"prompt": "q"})[0] == expected
    raw = job_config("x", system=r"Be brief.\tOK", chat=False)
    assert PromptBuilder(raw.job_spec(), types.SimpleNamespace()).render({"prompt": "q"})[0] == "Be brief.\tOK\n\nq"


def test_sections_round_trip_through_flat_options_and_stay_few():
    """The top object holds sections, not options; a worker rebuilds the launcher's config from its
    flat options (JSON) and gets the same object, fingerprint included."""
    import json as _json

    from jobrunner.config.job import JobConfig, job_config
    from jobrunner.parallel.launcher import config_from_json
    assert len(dataclasses.fields(JobConfig)) <= 12
    cfg = job_config("d.jsonl", kind="classify", labels=("a", "b"), stop=("x",), kv_cache_memory=2**20,
                     chat_template_kwargs='{"t": 1}', given=frozenset({"labels"}))
    back = config_from_json(_json.dumps({**cfg.options(), "given": sorted(cfg.given)}))
    assert back == cfg and back.fingerprint_fields() == cfg.fingerprint_fields()
    assert cfg.with_options(max_tokens=3).sampling.max_tokens == 3


def test_an_option_of_another_kind_is_refused_and_sampling_ranges_are_the_engines():
    with pytest.raises(JobConfigError, match="--labels/--labels-column need --kind classify"):
        job_config("d.jsonl", labels=("a", "b"))
    with pytest.raises(JobConfigError, match="--dimensions need --kind embed"):
        job_config("d.jsonl", dimensions=8)
    job_config("d.jsonl", normalize="sum")          # at its default: harmless, as it always was
    with pytest.raises(JobConfigError, match="^--top-p must be in"):      # SamplingParams' check, the CLI's name
        job_config("d.jsonl", top_p=1.5)


def test_resolved_round_trips_as_the_workers_get_it():
    from jobrunner.pipeline.resolve import Resolved
    r = Resolved(fmt="jsonl", columns=("id", "prompt"), model="dummy:x", dtype="auto", float_dtype="float32",
                 quantization="none", cache_url=None)
    assert Resolved.from_json(r.to_json()) == r
