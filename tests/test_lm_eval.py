"""lm-evaluation-harness's `jobrunner` backend against lm-eval's own `hf` backend, on the task YAMLs
in tests/lm_eval_tasks/ (local JSONL files; no dataset hub): every request's log-likelihood within
1e-4 and the same is_greedy, the task metrics equal to four decimals, greedy generations identical.
Tiny random checkpoints of three families, with max_length 32 so that the perplexity documents span
several rolling windows; the default model (as a float32 safetensors directory) on a few documents."""
from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
TASKS = ["jr_mc", "jr_ppl", "jr_gen"]
TINY_MAX_LENGTH = 32


@pytest.fixture(autouse=True)
def _in_tasks_dir(monkeypatch):
    """The task YAMLs name their data files relative to their own directory."""
    monkeypatch.chdir(TASKS_DIR)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def evaluate(model: str, model_args: str, tasks=TASKS, **kwargs) -> dict:
    import lm_eval
    import jobrunner.lm_eval_model  # noqa: F401  (registers `jobrunner`; an installed package's .pth does it)
    from lm_eval.tasks import TaskManager
    # our task YAMLs alone: indexing lm-eval's own thousands of task files cost seconds a call (the two
    # command-line tests below still go through lm-eval's CLI and its full index)
    tasks_only = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=True,
                                   task_manager=tasks_only, device="cpu",
                                   batch_size=kwargs.pop("batch_size", 4), **kwargs)


def responses(results: dict) -> dict:
    """(task, doc id) -> the doc's responses: [(loglikelihood, is_greedy), ...], [loglikelihood] or [text]."""
    out = {}
    for task, samples in results["samples"].items():
        for s in samples:
            out[(task, s["doc_id"])] = [r[0] for r in s["resps"]]
    return out


def assert_same(ours: dict, ref: dict) -> None:
    a, b = responses(ours), responses(ref)
    assert a.keys() == b.keys() and a
    for key in a:
        for x, y in zip(a[key], b[key], strict=True):
            if isinstance(y, str):                              # generate_until
                assert x == y, key
            elif isinstance(y, (tuple, list)):                  # loglikelihood: (logprob, is_greedy), a sum
                # over the continuation's tokens (float32 rounding of each: relative to the total, as below)
                assert float(x[0]) == pytest.approx(float(y[0]), rel=5e-6, abs=1e-4), (key, x, y)
                assert bool(x[1]) == bool(y[1]), (key, x, y)
            else:   # loglikelihood_rolling: a document's hundreds of tokens, which hf sums in float32
                # (rounding alone ~1e-4 on a total of -200), so relative to the total
                assert float(x) == pytest.approx(float(y), rel=1e-5, abs=1e-4), (key, x, y)
    for task, metrics in ref["results"].items():
        for name, value in metrics.items():
            if not isinstance(value, float) or "stderr" in name or not math.isfinite(value):
                continue
            if "perplexity" in name:    # exp(-mean logprob): a random model's runs to 1e10, so four decimals of
                # its exponent (the logprobs agree to 1e-4 above), i.e. a relative 1e-4
                assert ours["results"][task][name] == pytest.approx(value, rel=1e-4), (task, name)
            else:                       # accuracies, exact match, bits per byte
                assert round(ours["results"][task][name], 4) == round(value, 4), (task, name)


@pytest.fixture(scope="module")
def hf_reference():
    """reference(model_args, tasks) -> lm-eval's hf backend on those tasks: run once a module for all of TASKS
    and shared (each task's requests and results are its own: the hf backend never mixes a task's requests
    with another task's of the same type, as jr_mc is the only loglikelihood task)."""
    runs: dict[str, dict] = {}

    def reference(model_args: str, tasks=TASKS) -> dict:
        if model_args not in runs:
            runs[model_args] = evaluate("hf", model_args)
        full = runs[model_args]
        return {"samples": {t: full["samples"][t] for t in tasks}, "results": {t: full["results"][t] for t in tasks}}
    return reference


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_tiny_models_match_hf(tiny_hf_model_dir, hf_reference, arch):
    path = tiny_hf_model_dir(arch)
    common = f"pretrained={path},dtype=float32,max_length={TINY_MAX_LENGTH}"
    ref = hf_reference(common)
    ours = evaluate("jobrunner", common)
    assert_same(ours, ref)
    assert len(ours["samples"]["jr_ppl"]) == 3 and ours["results"]["jr_ppl"]["word_perplexity,none"] > 1


@pytest.fixture(scope="session")
def default_model_dir(hf_default_model, hf_default_tokenizer, tmp_path_factory):
    """The default model's float32 conversion and its tokenizer in one directory both backends load."""
    from jobrunner.models.known import cache_root
    import transformers
    ref = cache_root() / "test-reference"
    version = transformers.__version__
    path = tmp_path_factory.mktemp("smollm2-safetensors")
    for src in (ref / f"smollm2-135m-instruct-model-transformers-{version}",
                ref / f"smollm2-135m-instruct-tokenizer-transformers-{version}"):
        for f in src.iterdir():
            if f.name != "done":
                (path / f.name).symlink_to(f)
    return path


@pytest.mark.default_model
def test_default_model_matches_hf(default_model_dir):
    common = f"pretrained={default_model_dir},dtype=float32,max_length=64"
    ref = evaluate("hf", common, limit=3)
    ours = evaluate("jobrunner", common, limit=3)
    assert_same(ours, ref)


@pytest.mark.default_model
def test_default_model_chat_template_matches_hf(default_model_dir):
    common = f"pretrained={default_model_dir},dtype=float32"
    kw = dict(tasks=["jr_gen"], limit=3, apply_chat_template=True, system_instruction="Answer briefly.",
              fewshot_as_multiturn=True, num_fewshot=1)
    ref = evaluate("hf", common, **kw)
    ours = evaluate("jobrunner", common, **kw)
    assert_same(ours, ref)
    assert "<|im_start|>system\nAnswer briefly." in ours["samples"]["jr_gen"][0]["arguments"][0][0]


class _Spy:
    """Counts the requests our engine is given (every job's requests go through Engine.add_request)."""

    def __init__(self, monkeypatch):
        from jobrunner.engine.core.engine import Engine
        self.added = 0
        add = Engine.add_request

        def counted(engine, request):
            self.added += 1
            return add(engine, request)
        monkeypatch.setattr(Engine, "add_request", counted)


def test_use_cache_and_result_cache_compute_nothing_the_second_time(tiny_hf_model_dir, tmp_path, monkeypatch):
    spy = _Spy(monkeypatch)
    args = f"pretrained={tiny_hf_model_dir('llama')},dtype=float32,max_length={TINY_MAX_LENGTH}"
    first = evaluate("jobrunner", args, use_cache=str(tmp_path / "lm-eval-cache"))
    assert spy.added > 0
    spy.added = 0
    again = evaluate("jobrunner", args, use_cache=str(tmp_path / "lm-eval-cache"))      # lm-eval's CachingLM
    assert spy.added == 0
    assert responses(again) == responses(first)

    cached = f"{args},cache={tmp_path / 'result-cache'}"                                 # our result cache
    ours = evaluate("jobrunner", cached)
    assert spy.added > 0
    spy.added = 0
    again = evaluate("jobrunner", cached)      # another model object: another engine session
    assert spy.added == 0
    assert_same(again, ours)


def test_unknown_model_argument_is_refused(tiny_hf_model_dir):
    from jobrunner.api.submit import JobConfigError
    with pytest.raises(JobConfigError, match="max_tokenz"):
        evaluate("jobrunner", f"pretrained={tiny_hf_model_dir('llama')},max_tokenz=3", tasks=["jr_mc"])


def test_the_command_line_says_a_bad_model_argument_in_one_line_and_no_default_device_warning(
        tiny_hf_model_dir, tmp_path, caplog):
    """A bad --model_args value: its one line, no traceback; lm-eval's own default device (cuda:0, when none
    was named) is not warned of on a CPU machine, a device the user named is (issue 41, item 8)."""
    from jobrunner.lm_eval_model import _device
    with caplog.at_level(logging.WARNING, logger="jobrunner.lm_eval"):
        assert _device("cuda:0") is None and _device("cpu") == "cpu"
        assert caplog.text == ""
        assert _device("cuda:1") is None and "device cuda:1 is not available here" in caplog.text
    code = "from lm_eval.__main__ import cli_evaluate; import jobrunner.lm_eval_model; cli_evaluate()"
    args = f"pretrained={tiny_hf_model_dir('llama')},max_num_seqs=zero"
    run = subprocess.run([sys.executable, "-c", code, "--model", "jobrunner", "--model_args", args,
                          "--tasks", "jr_mc", "--include_path", str(TASKS_DIR), "--output_path", str(tmp_path / "o")],
                         cwd=TASKS_DIR, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent), "HF_DATASETS_OFFLINE": "1"})
    assert run.returncode != 0
    assert "error: --model_args:" in run.stderr and "max_num_seqs" in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]


def test_command_line_finds_the_backend_through_the_pth_hook(tiny_hf_model_dir, tmp_path):
    """`lm_eval --model jobrunner` as an installed package runs it: the .pth file (setup.py puts it in
    site-packages) registers the name when lm-eval's registry loads; here a site dir stands in."""
    repo = Path(__file__).parent.parent
    site = tmp_path / "site"
    site.mkdir()
    (site / "jobrunner-lm-eval.pth").write_text((repo / "jobrunner-lm-eval.pth").read_text())
    code = ("import site, sys; site.addsitedir(sys.argv.pop(1)); from lm_eval.__main__ import cli_evaluate; "
            "cli_evaluate()")
    args = f"pretrained={tiny_hf_model_dir('llama')},dtype=float32,max_length={TINY_MAX_LENGTH}"
    run = subprocess.run([sys.executable, "-c", code, str(site), "--model", "jobrunner", "--model_args", args,
                          "--tasks", "jr_mc", "--include_path", str(TASKS_DIR), "--device", "cpu",
                          "--output_path", str(tmp_path / "out")],
                         cwd=TASKS_DIR, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(repo), "HF_DATASETS_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "jr_mc" in run.stdout and "acc" in run.stdout


@pytest.mark.parametrize("parallel", ["data_parallel=2", "tensor_parallel=2"])
def test_parallel_runs_match_hf(tiny_hf_model_dir, hf_reference, parallel):
    """data_parallel runs each job over worker processes (jobrunner.submit), tensor_parallel splits the
    model over ranks: the same requests, the same answers."""
    common = f"pretrained={tiny_hf_model_dir('llama')},dtype=float32,max_length={TINY_MAX_LENGTH}"
    ref = hf_reference(common, tasks=["jr_mc", "jr_gen"])
    ours = evaluate("jobrunner", f"{common},{parallel}", tasks=["jr_mc", "jr_gen"])
    assert_same(ours, ref)


def test_requests_reach_the_engine_as_token_ids_and_results_come_back_as_values(tiny_hf_model_dir, monkeypatch):
    """In process, lm-eval's requests go to the job as Rows of token ids (no file, no prompt text, nothing
    rendered or tokenized again: EngineSession.run_rows) and the backend gets the kind's values back."""
    from jobrunner.engine.core.engine import Engine
    from jobrunner.engine.load.tokenizer import Tokenizer
    from jobrunner.jobs.base import PromptBuilder
    import jobrunner.api.session as session
    import jobrunner.lm_eval_model as backend
    lm = backend.JobrunnerLM(pretrained=str(tiny_hf_model_dir("llama")), dtype="float32", device="cpu",
                             max_length=TINY_MAX_LENGTH)
    prompts, returned = [], []
    add, run = Engine.add_request, backend._Jobs.run
    monkeypatch.setattr(Engine, "add_request", lambda e, r: (prompts.append(list(r.prompt_token_ids)), add(e, r))[1])
    monkeypatch.setattr(backend._Jobs, "run", lambda jobs, rows, **kw: returned.append(run(jobs, rows, **kw)) or
                        returned[-1])
    for name, where in (("render", PromptBuilder), ("encode_batch", Tokenizer), ("_write_rows", session)):
        monkeypatch.setattr(where, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} was called"))

    context = lm.tok_encode("The quick brown")
    endings = [lm.tok_encode(" fox", add_special_tokens=False), lm.tok_encode(" dog jumps", add_special_tokens=False)]
    scores = lm._loglikelihood_tokens([(("", ""), context, ending) for ending in endings])
    assert prompts == [context]
    assert all(type(logprob) is float and type(greedy) is bool for logprob, greedy in scores)
    (scored,) = returned[0]
    assert all(type(x) is float for x in scored["continuation_logprobs"]) and scored["continuation_logprobs"] == \
        [logprob for logprob, _ in scores]
    assert all(type(x) is bool for x in scored["continuation_greedy"])
    assert "prompt" not in scored

    (generated,) = lm.jobs.run([{"id": "0", "context_ids": context}], **backend._sampling({"max_gen_toks": 3}, []))
    assert prompts[-1] == context and isinstance(generated["output"], str) and generated["error"] is None
