"""--quantization auto: the fastest mode within 2% perplexity of float, by what the CPU has."""
import pytest

from jobrunner.pipeline import precision
from jobrunner.config.job import JobConfigError, job_config
from jobrunner.pipeline.resolve import resolve_engine


@pytest.mark.parametrize("flags,expected", [
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, ("bfloat16", "none")),
    ({"avx2", "avx512f", "avx512_vnni"}, ("auto", "w8a8")),
    ({"avx2", "avx_vnni"}, ("auto", "w8a8")),
    ({"avx2"}, ("auto", "none")),
    (set(), ("auto", "none")),
])
def test_cpu_choice_by_flags(monkeypatch, flags, expected):
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset(flags))
    assert precision.auto_precision("cpu", "auto")[:2] == expected


def test_a_gpu_or_a_chosen_dtype_is_left_alone(monkeypatch):
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert precision.auto_precision("cuda", "auto")[:2] == ("auto", "none")
    assert precision.auto_precision("cpu", "float32")[:2] == ("float32", "none")


def test_engine_config_resolves_auto(monkeypatch, tiny_hf_model_dir):
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    cfg = job_config("d.csv", model=str(tiny_hf_model_dir("llama")), device="cpu", quantization="auto")
    engine_cfg = cfg.engine_config(resolve_engine(cfg))     # jobrunner.job.resolve: auto, once
    assert (engine_cfg.dtype, engine_cfg.quantization) == ("bfloat16", "none")
    with pytest.raises(JobConfigError, match="--quantization"):
        job_config("d.csv", quantization="fastest")
