"""--quantization auto on CPU by measurement (jobrunner/pipeline/calibration.py): the pick rule on given
figures, the cache, the off switch, the paths that measure nothing, the record in Resolved and the
manifest, and one real calibration of a tiny model."""
import json

import pytest

from jobrunner.config.job import job_config
from jobrunner.pipeline import calibration, precision
from jobrunner.pipeline.resolve import Resolved, resolve_engine
from jobrunner.pipeline.resolve import precision as resolve_precision
from jobrunner.output.layout import FORMAT_MARK, MANIFEST

MODEL = "dummy:smollm2-135m"        # identified by its built-in config: nothing on disk


def figures(**modes):
    """mode=(perplexity, tokens/s) -> the figures pick() reads."""
    return {m: {"perplexity": p, "tokens_per_s": t} for m, (p, t) in modes.items()}


@pytest.mark.parametrize("given,chosen", [
    (figures(float32=(10.0, 50), bfloat16=(10.05, 100), w8a8=(10.09, 150)), "w8a8"),       # fastest within 1%
    (figures(float32=(10.0, 50), bfloat16=(10.05, 100), w8a8=(10.2, 150)), "bfloat16"),    # w8a8 2% over
    (figures(float32=(10.0, 50), bfloat16=(10.2, 100), w8a8=(10.5, 150)), "float32"),      # none within
    (figures(float32=(10.0, 50), bfloat16=(10.0, 40)), "float32"),          # within, but slower
    (figures(float32=(10.0, 50), bfloat16=(9.8, 60)), "bfloat16"),          # lower perplexity passes
    (figures(float32=(10.0, 50), bfloat16=(10.0, 80), w8a8=(10.0, 80)), "bfloat16"),   # a tie: the more exact
    (figures(float32=(10.0, 80), bfloat16=(10.0, 80)), "float32"),
    (figures(float32=(10.0, 50), bfloat16=(None, 900), w8a8=(10.0, None)), "float32"),  # unmeasurable figures
    (figures(bfloat16=(10.0, 100)), "float32"),                             # no float32 to compare with
    (figures(float32=(None, 50), bfloat16=(10.0, 100)), "float32"),
])
def test_pick_fastest_within_one_percent(given, chosen):
    assert calibration.pick(given) == chosen


def test_pick_under_tensor_parallel_takes_a_float_mode():
    given = figures(float32=(10.0, 50), bfloat16=(10.05, 100), w8a8=(10.05, 150))
    assert calibration.pick(given, allowed=calibration.FLOAT_MODES) == "bfloat16"


FAKE = {"float32": (12.0, 40.0), "bfloat16": (12.02, 90.0), "w8a8": (12.1, 120.0), "int4": (12.0, 150.0),
        "w4a8": (12.1, 200.0)}


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """calibration.measure_mode replaced by FAKE's figures; the modes it was asked for, in order."""
    calls = []

    def fake(model, mode, threads, packed_weights=True):
        calls.append(mode)
        ppl, tps = FAKE[mode]
        return {"perplexity": ppl, "tokens_per_s": tps, "cpu_tokens_per_s": tps, "load_s": 0.0}

    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(calibration.ENV, raising=False)
    monkeypatch.setattr(calibration, "measure_mode", fake)
    return calls


def cpu_auto_cfg(**options):
    return job_config("d.jsonl", model=MODEL, device="cpu", quantization="auto", **options)


def test_measured_once_then_cached(measured, caplog):
    caplog.set_level("INFO", logger="jobrunner")
    first = resolve_engine(cpu_auto_cfg())
    assert measured == ["float32", "bfloat16", "w8a8"]
    assert (first.dtype, first.quantization) == ("auto", "w8a8")        # 12.1 is within 1% of 12.0
    rec = first.calibration
    assert rec["source"] == "measured" and rec["mode"] == "w8a8"
    assert rec["exact"] == "--dtype float32 --quantization none"
    assert rec["modes"]["bfloat16"] == {"perplexity": 12.02, "tokens_per_s": 90.0, "cpu_tokens_per_s": 90.0,
                                        "load_s": 0.0}
    assert "cpu" in rec["machine"] and isinstance(rec["machine"]["flags"], list)
    line = [r.getMessage() for r in caplog.records if "--quantization auto" in r.getMessage()]
    assert len(line) == 1 and "w8a8 ppl 12.1 (+0.8%) 120 tok/s" in line[0] and "--dtype float32" in line[0]

    second = resolve_engine(cpu_auto_cfg())
    assert measured == ["float32", "bfloat16", "w8a8"]                  # no engine loaded again
    assert second.calibration["source"] == "cache" and second.calibration["modes"] == rec["modes"]
    assert (second.dtype, second.quantization) == ("auto", "w8a8")


def test_unpacked_weights_are_calibrated_apart(measured, monkeypatch):
    seen = []
    fake = calibration.measure_mode
    monkeypatch.setattr(calibration, "measure_mode",
                        lambda model, mode, threads, packed_weights=True: seen.append(packed_weights)
                        or fake(model, mode, threads, packed_weights))
    resolve_engine(cpu_auto_cfg())
    assert resolve_engine(cpu_auto_cfg(packed_weights=False)).calibration["source"] == "measured"
    assert seen == [True] * 3 + [False] * 3          # float32's speed differs: its own figures, its own file
    assert calibration.cache_path(MODEL, True) != calibration.cache_path(MODEL, False)


def test_refresh_measures_again(measured, monkeypatch):
    resolve_engine(cpu_auto_cfg())
    monkeypatch.setenv(calibration.ENV, "refresh")
    assert resolve_engine(cpu_auto_cfg()).calibration["source"] == "measured"
    assert len(measured) == 6


def test_off_switch_takes_the_flag_rule(measured, monkeypatch):
    monkeypatch.setenv(calibration.ENV, "off")
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    r = resolve_engine(cpu_auto_cfg())
    assert (r.dtype, r.quantization) == ("bfloat16", "none") and measured == []
    assert r.calibration["source"] == "flags" and "JOBRUNNER_CALIBRATION=off" in r.calibration["why"]


def test_a_dry_resolve_measures_nothing(measured, monkeypatch):
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "avx512_vnni"}))
    cfg = cpu_auto_cfg()
    dtype, quantization, rec = resolve_precision(cfg, None, MODEL, measure=False)
    assert (dtype, quantization) == ("auto", "w8a8") and measured == []
    assert rec["source"] == "flags" and "calibrated at first run" in rec["why"]
    resolve_engine(cfg)                                  # measured and cached: a dry resolve reads it
    assert resolve_precision(cfg, None, MODEL, measure=False)[2]["source"] == "cache" and len(measured) == 3


def test_a_torchrun_rank_measures_nothing(measured, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2"}))
    r = resolve_engine(cpu_auto_cfg())
    assert (r.dtype, r.quantization) == ("auto", "none") and measured == [] and r.calibration["source"] == "flags"


def test_paths_that_never_measure(measured, monkeypatch):
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx512_bf16", "avx512_vnni"}))
    assert resolve_precision(cpu_auto_cfg(dtype="bfloat16"), None, MODEL) == ("bfloat16", "none", None)
    assert resolve_precision(cpu_auto_cfg(), "W4A16", MODEL) == ("auto", "none", None)     # shipped: as shipped
    assert resolve_precision(job_config("d.jsonl", model=MODEL, device="cpu"), None, MODEL) == ("auto", "none", None)
    monkeypatch.setattr(precision, "cuda_count", lambda device: 1)
    gpu = job_config("d.jsonl", model=MODEL, quantization="auto")                         # device auto, a GPU
    assert resolve_precision(gpu, None, MODEL) == ("auto", "none", None)
    assert measured == []


def test_tensor_parallel_keeps_a_float_mode(measured):
    dtype, quantization, rec = resolve_precision(cpu_auto_cfg(tensor_parallel=2), None, MODEL)
    assert (dtype, quantization) == ("bfloat16", "none") and rec["mode"] == "bfloat16"
    assert "w8a8" in rec["modes"]               # measured all the same: the cache serves a one-rank job too


def test_a_resumed_output_keeps_its_mode(measured, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    kept = {"mode": "bfloat16", "dtype": "bfloat16", "quantization": "none", "why": "w", "source": "measured",
            "modes": {}, "machine": {}, "exact": calibration.EXACT, "seconds": 1.0}
    (out / MANIFEST).write_text(json.dumps({"format": FORMAT_MARK, "calibration": kept}))
    dtype, quantization, rec = resolve_precision(cpu_auto_cfg(), None, MODEL, resumes=str(out))
    assert (dtype, quantization) == ("bfloat16", "none") and rec["resumed"] and measured == []
    # without a record (a new output, or one begun before records): measured
    assert resolve_precision(cpu_auto_cfg(), None, MODEL, resumes=str(tmp_path / "new"))[1] == "w8a8"


def test_resolved_json_carries_the_record(measured):
    r = resolve_engine(cpu_auto_cfg())
    back = Resolved.from_json(r.to_json())
    assert back == r and back.calibration == r.calibration
    json.loads(r.to_json(), parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    old = json.loads(r.to_json())
    del old["calibration"]                      # a Resolved passed by a launcher from before the field
    assert Resolved.from_json(json.dumps(old)).calibration is None


def test_manifest_records_the_calibration(measured, tiny_hf_model_dir, tmp_path, monkeypatch):
    from jobrunner.api.submit import submit

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "prompt": f"row {i}"}) + "\n" for i in range(3)))
    model = str(tiny_hf_model_dir("llama"))
    result = submit(str(data), str(tmp_path / "out"), model=model, device="cpu", quantization="auto",
                    max_tokens=2, threads=1)
    assert result.exit_code == 0
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["quantization"] == "w8a8" and manifest["calibration"]["mode"] == "w8a8"
    assert manifest["calibration"]["modes"]["float32"]["perplexity"] == 12.0
    assert set(manifest["calibration"]["modes"]) == {"float32", "bfloat16", "w8a8"}

    # resumed where a calibration would now choose otherwise: the output keeps its mode
    monkeypatch.setitem(FAKE, "w8a8", (13.0, 120.0))
    monkeypatch.setenv(calibration.ENV, "refresh")
    with data.open("a") as f:
        f.write(json.dumps({"id": "3", "prompt": "row 3"}) + "\n")
    assert submit(str(data), str(tmp_path / "out"), model=model, device="cpu", quantization="auto",
                  max_tokens=2, threads=1).exit_code == 0
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["quantization"] == "w8a8" and manifest["calibration"]["resumed"] is True
    assert len(measured) == 3                   # the resumed job measured nothing


def test_a_real_calibration_of_a_tiny_model(tiny_hf_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(calibration.ENV, raising=False)
    model = str(tiny_hf_model_dir("llama"))
    rec = calibration.cpu_auto(model, threads=1)
    assert rec["source"] == "measured" and rec["mode"] in calibration.MODES
    assert rec["mode"] == calibration.pick(rec["modes"])
    f32 = rec["modes"]["float32"]
    assert 1 < f32["perplexity"] < 10_000 and f32["tokens_per_s"] > 0 and f32["cpu_tokens_per_s"] > 0
    assert set(rec["modes"]) | set(rec["skipped"]) == set(calibration.MODES)
    assert list((tmp_path / "cache" / "calibration").glob("*.json")) == [calibration.cache_path(model)]
    assert calibration.cpu_auto(model, threads=1)["source"] == "cache"


def test_a_mode_the_engine_refuses_is_skipped(measured, monkeypatch):
    from jobrunner.engine import ConfigError

    fake = calibration.measure_mode

    def refuse_w8a8(model, mode, threads, packed_weights=True):
        if mode == "w8a8":
            raise ConfigError("--quantization w8a8: not on this machine")
        return fake(model, mode, threads, packed_weights)

    monkeypatch.setattr(calibration, "measure_mode", refuse_w8a8)
    rec = calibration.cpu_auto(MODEL, 1)
    assert rec["mode"] == "bfloat16" and set(rec["modes"]) == {"float32", "bfloat16"}
    assert "not on this machine" in rec["skipped"]["w8a8"] and "w8a8 not run" in calibration.summary(rec)


def test_without_the_text_file_the_flag_rule(measured, monkeypatch, tmp_path):
    monkeypatch.setattr(calibration, "TEXT_FILE", tmp_path / "missing.txt")
    rec = calibration.cpu_auto(MODEL, 1)
    assert rec["source"] == "flags" and measured == []


@pytest.mark.parametrize("ships", [True, False])
def test_int4_and_w4a8_are_candidates_where_the_weights_ship_4_bit(measured, monkeypatch, ships):
    """Issue 62 item 2: a GGUF file of Q4_0/Q4_1 weights (the default model's Q4_1) runs int4 and w4a8 on its
    own blocks, so both are measured there, and chosen when fastest within 1%; elsewhere they are not run, and
    the summary says why."""
    monkeypatch.setattr(calibration.engine, "ships_int4", lambda model: ships)
    rec = calibration.cpu_auto(MODEL, 1)
    if ships:
        assert measured == ["float32", "bfloat16", "w8a8", "int4", "w4a8"]
        assert (rec["mode"], rec["dtype"], rec["quantization"]) == ("w4a8", "auto", "w4a8")
    else:
        assert measured == ["float32", "bfloat16", "w8a8"] and rec["mode"] == "w8a8"
        summary = calibration.summary(rec)
        assert "int4 not run: weights not shipped 4-bit" in summary and "w4a8 not run" in summary


def test_a_shipped_int4_checkpoint_is_measured_among_its_own_modes(measured, monkeypatch, tmp_path):
    """A GPTQ, AWQ or W4A16 checkpoint under auto on CPU: float32 runs it as shipped (the perplexity to stay
    within), bfloat16 and w4a8 (its int4 weights times int8 activations) are measured beside it; w8a8 and int4
    would quantize it again and are not. As shipped under --tensor-parallel, for other schemes, and where the
    output it resumes ran as shipped before any record."""
    monkeypatch.setattr(calibration.engine, "ships_int4", lambda model: True)
    dtype, quantization, rec = resolve_precision(cpu_auto_cfg(), "W4A16", MODEL)
    assert (dtype, quantization, rec["mode"]) == ("auto", "w4a8", "w4a8")
    assert measured == ["float32", "bfloat16", "w4a8"]
    assert "quantized int4 already" in rec["skipped"]["w8a8"] and "int4" in rec["skipped"]
    assert resolve_precision(cpu_auto_cfg(tensor_parallel=2), "W4A16", MODEL) == ("auto", "none", None)
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST).write_text(json.dumps({"format": FORMAT_MARK}))
    assert resolve_precision(cpu_auto_cfg(), "W4A16", MODEL, resumes=str(out)) == ("auto", "none", None)
    assert resolve_precision(cpu_auto_cfg(), "W4A16", MODEL, resumes=str(tmp_path / "new"))[1] == "w4a8"
    monkeypatch.setenv(calibration.ENV, "off")
    rec = calibration.cpu_auto(MODEL, 1, shipped=True)
    assert (rec["mode"], rec["quantization"]) == ("float32", "none") and "as shipped" in rec["why"]
    monkeypatch.setattr(calibration.engine, "ships_int4", lambda model: False)      # W8A16: nothing to measure
    assert len(measured) == 3 and resolve_precision(cpu_auto_cfg(), "W8A16", MODEL) == ("auto", "none", None)


def test_which_checkpoints_ship_int4(default_gguf_path, tiny_gguf_path, tiny_hf_model_dir, tmp_path):
    from jobrunner import engine

    assert engine.ships_int4(str(default_gguf_path))            # SmolLM2-135M-Instruct.Q4_1.gguf
    assert engine.ships_int4(str(tiny_gguf_path(qtype="Q4_0"))) and engine.ships_int4(str(tiny_gguf_path(qtype="Q4_1")))
    assert not engine.ships_int4(str(tiny_gguf_path(qtype="Q8_0")))
    assert not engine.ships_int4(str(tiny_gguf_path(qtype="F32")))
    assert not engine.ships_int4(str(tiny_hf_model_dir("llama")))
    assert not engine.ships_int4(MODEL)
    pytest.importorskip("compressed_tensors")
    from quantized_checkpoints import make_compressed, make_gptq
    assert engine.ships_int4(str(make_compressed(tmp_path / "w4a16", "llama", "W4A16")))
    assert engine.ships_int4(str(make_gptq(tmp_path / "gptq", "llama", bits=4, group_size=32)))
    assert not engine.ships_int4(str(make_compressed(tmp_path / "w8a16", "llama", "W8A16")))
    assert not engine.ships_int4(str(make_gptq(tmp_path / "gptq8", "llama", bits=8, group_size=32)))


def test_a_real_calibration_of_a_4_bit_gguf_measures_int4_on_its_own_blocks(tiny_gguf_path, tmp_path, monkeypatch):
    """int4 computes on the shipped Q4_1 blocks, the weights float32 dequantizes: the same perplexity but for
    the order of float sums."""
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(calibration.ENV, raising=False)
    rec = calibration.cpu_auto(str(tiny_gguf_path(qtype="Q4_1")), threads=1)
    f32, int4 = rec["modes"]["float32"]["perplexity"], rec["modes"]["int4"]["perplexity"]
    assert abs(int4 / f32 - 1) < 1e-3 and rec["modes"]["int4"]["tokens_per_s"] > 0
    assert rec["mode"] == calibration.pick(rec["modes"])


def test_a_real_calibration_of_a_shipped_w4a16_checkpoint(tmp_path, monkeypatch):
    """float32 runs the checkpoint's own int4 linears; w4a8 the same weights with int8 activations: measured,
    and picked by the rule like any mode."""
    pytest.importorskip("compressed_tensors")
    from quantized_checkpoints import make_compressed
    monkeypatch.setenv("JOBRUNNER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(calibration.ENV, raising=False)
    rec = calibration.cpu_auto(str(make_compressed(tmp_path / "ckpt", "llama", "W4A16")), threads=1, shipped=True)
    f32, w4a8 = rec["modes"]["float32"], rec["modes"]["w4a8"]
    assert abs(w4a8["perplexity"] / f32["perplexity"] - 1) < 0.05 and w4a8["tokens_per_s"] > 0
    assert "w8a8" not in rec["modes"] and rec["mode"] == calibration.pick(rec["modes"], allowed=calibration.SHIPPED_MODES)
