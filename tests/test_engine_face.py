"""The engine's public face (engine/__init__.py): the names the layers above use, torch-free to
import, a frozen EngineInfo and frozen counters."""
import dataclasses
import subprocess
import sys

import pytest

import jobrunner.engine as engine_pkg
from jobrunner.engine import EngineCounters, EngineInfo, Request, SamplingParams
from tests.tiny import engine_for, hf_model, prompts

# what jobrunner/ and jobs/ import from the engine (import-linter forbids them its submodules)
USED_ABOVE = ("Engine", "EngineConfig", "EngineInfo", "EngineCounters", "Request", "RequestOutput", "SamplingParams",
              "Constraint", "EmbedParams", "TokenLogprob", "Completion", "POOLINGS", "ModelError", "EngineFailure",
              "ConfigError", "Tokenizer", "common_prefix", "DUMMY_CONFIGS", "load_model_bundle", "NUMERICS_VERSION",
              "SAMPLING_KEYS", "cache_root", "CPU_KV_CACHE_BYTES", "KV_CACHE_DTYPES", "QUANTIZATIONS",
              "check_constraint", "CheckpointPooling", "check_split", "rank_plan")


def test_public_names_exist():
    assert set(USED_ABOVE) <= set(engine_pkg.__all__) <= set(dir(engine_pkg))
    for name in engine_pkg.__all__:
        assert getattr(engine_pkg, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'engine_internal'"):
        engine_pkg.engine_internal


def test_importing_the_face_and_the_job_kinds_loads_no_torch():
    code = ("import sys, pkgutil, importlib\nfrom jobrunner import engine, jobs\n"
            "for m in pkgutil.iter_modules(jobs.__path__): importlib.import_module('jobrunner.jobs.' + m.name)\n"
            "from jobrunner.engine import Request, SamplingParams, CheckpointPooling, common_prefix\n"
            "assert 'torch' not in sys.modules, 'torch loaded'\n"
            "engine.Engine\n"
            "assert 'torch' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture(scope="module")
def engine():
    return engine_for(hf_model("llama", seed=2))


def test_engine_info_is_frozen_and_describes_the_engine(engine):
    info = engine.info
    assert isinstance(info, EngineInfo)
    rt = engine.rt
    assert (info.max_model_len, info.max_num_seqs, info.max_num_batched_tokens) == (
        engine.max_model_len, rt.max_num_seqs, rt.max_num_batched_tokens)
    assert (info.device, info.device_type, info.dtype, info.num_blocks) == ("cpu", "cpu", "torch.float32", rt.num_blocks)
    assert (info.hidden_size, info.vocab_size, info.weight_bytes) == (64, 320, rt.weight_bytes) and info.weight_bytes > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.max_num_seqs = 1


def test_counters_are_snapshots_and_count_each_step(engine):
    before = engine.counters()
    steps_before = before.steps
    p = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3, ignore_eos=True)
    batch = prompts(9, lengths=(7, 12))
    outs = engine.generate([Request(str(i), ids, p) for i, ids in enumerate(batch)])
    after = engine.counters()
    assert before.steps == steps_before < after.steps               # the earlier snapshot did not move
    ran = after - before
    assert ran.generated_tokens == sum(len(c.token_ids) for o in outs for c in o.completions) == 2 * 3 * 6
    assert ran.prompt_tokens_computed + ran.prompt_tokens_cached == 7 + 12
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.steps = 0
    engine.reset_counters()
    assert engine.counters() == EngineCounters()


def test_an_open_engine_raises_the_gc_threshold_and_the_last_close_restores_it(tiny_hf_model_dir):
    """The engine's process-wide changes are scoped: they last while an engine is open (tests/test_engine_scope.py)."""
    import gc

    from jobrunner.engine import Engine, EngineConfig
    gc.collect()                                    # an unclosed engine of an earlier test, collected now, not below
    before = gc.get_threshold()
    path = str(tiny_hf_model_dir("llama"))
    first, second = Engine(EngineConfig(model=path)), Engine(EngineConfig(model=path))
    assert gc.get_threshold()[0] >= 50_000
    first.close()
    assert gc.get_threshold()[0] >= 50_000          # the second engine is still open
    second.close()
    second.close()                                  # closing twice gives back nothing twice
    assert gc.get_threshold() == before
