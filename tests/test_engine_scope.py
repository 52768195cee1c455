"""An engine's process-wide settings (engine/run/process_settings.py) last while it is open: a `with` block, close()
(twice is fine) or the collection of an engine never closed gives the process its values back."""
import gc

import pytest
import torch

from jobrunner.engine import Engine, EngineConfig, Request, SamplingParams
from tests.cache_helpers import tiny_model


@pytest.fixture
def config(tmp_path):
    def make(**kw) -> EngineConfig:
        return EngineConfig(model=tiny_model(tmp_path), kv_cache_memory=4 * 2**20, **kw)
    return make


@pytest.fixture
def settings():
    """The gc threshold and torch's thread count before the test, with no stale engine left to collect."""
    gc.collect()
    before = gc.get_threshold(), torch.get_num_threads()
    yield before
    torch.set_num_threads(before[1])


def _threads_other_than(n: int) -> int:
    return 1 if n != 1 else 2


def test_a_with_block_gives_the_settings_back(config, settings):
    gc_before, threads_before = settings
    threads = _threads_other_than(threads_before)
    with Engine(config(num_threads=threads)) as engine:
        assert isinstance(engine, Engine)
        assert gc.get_threshold()[0] >= 50_000 and torch.get_num_threads() == threads
        out = engine.generate([Request("a", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=2))])
        assert len(out[0].completions[0].token_ids) == 2
    assert gc.get_threshold() == gc_before and torch.get_num_threads() == threads_before
    engine.close()                                  # closing again changes nothing
    assert gc.get_threshold() == gc_before and torch.get_num_threads() == threads_before


def test_set_threads_is_undone_by_the_last_close(config, settings):
    gc_before, threads_before = settings
    first, second = Engine(config()), Engine(config())
    first.set_threads(_threads_other_than(threads_before))     # as the thread governor does
    first.close()
    first.close()
    assert torch.get_num_threads() == _threads_other_than(threads_before)    # the second engine is still open
    assert gc.get_threshold()[0] >= 50_000
    second.close()
    assert gc.get_threshold() == gc_before and torch.get_num_threads() == threads_before


def test_an_engine_never_closed_gives_them_back_when_collected(config, settings):
    gc_before, threads_before = settings
    engine = Engine(config(num_threads=_threads_other_than(threads_before)))
    assert torch.get_num_threads() != threads_before
    del engine
    gc.collect()
    assert gc.get_threshold() == gc_before and torch.get_num_threads() == threads_before


def test_an_engine_that_fails_to_open_gives_back_what_its_runtime_changed(config, settings, monkeypatch):
    from jobrunner.engine.core import engine as engine_module
    _, threads_before = settings

    def broken(*args, **kwargs):
        raise RuntimeError("no room for the runner")
    monkeypatch.setattr(engine_module, "ModelRunner", broken)
    with pytest.raises(RuntimeError, match="no room"):
        Engine(config(num_threads=_threads_other_than(threads_before)))
    assert torch.get_num_threads() == threads_before
