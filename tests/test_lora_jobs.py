"""LoRA adapters in jobs: --lora NAME=PATH, --lora-column, an OpenAI batch line's body.model, the
`adapter` column, the manifest's records, resume refused when an adapter changed, refusals exit 2."""
from __future__ import annotations

import json

import pytest

from tests.lora_helpers import make_adapter
from tests.cli_helpers import jsonl, submit

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def tiny(tiny_hf_model_dir, tmp_path_factory):
    """(the checkpoint's options, {adapter name: directory})."""
    import torch
    import transformers
    path = tiny_hf_model_dir("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("job-loras")
    adapters = {}
    for i, name in enumerate(("a", "b", "c")):
        make_adapter(hf, root / name, seed=20 + i, r=2 + 2 * i)
        adapters[name] = root / name
    return ["-m", str(path), "--no-chat", "--max-tokens", "12", "--ignore-eos"], adapters


def _lora_args(adapters) -> list[str]:
    return [x for n, p in adapters.items() for x in ("--lora", f"{n}={p}")]


def _rows(n=12):
    names = ["a", "b", None, "c"]
    return [{"id": str(i), "prompt": f"row {i} says {'x ' * (i % 5)}", "which": names[i % 4]} for i in range(n)]


def test_a_mixed_job_equals_each_adapter_run_alone(tmp_path, tiny):
    opts, adapters = tiny
    ds = jsonl(tmp_path / "d.jsonl", _rows())
    r, mixed = submit(tmp_path, ds, *opts, *_lora_args(adapters), "--lora-column", "which")
    assert r.exit_code == 0, r.output
    by_id = {row["id"]: row for row in mixed}
    assert all(row["adapter"] == row["which"] for row in mixed)
    for name in ("a", "b", "c", None):
        subset = [row for row in _rows() if row["which"] == name]
        extra = ["--lora", f"{name}={adapters[name]}", "--lora-column", "which"] if name else []
        r, alone = submit(tmp_path, jsonl(tmp_path / f"{name}.jsonl", subset), *opts, *extra, out=f"out-{name}")
        assert r.exit_code == 0, r.output
        assert [by_id[row["id"]]["output"] for row in alone] == [row["output"] for row in alone]
    texts = {name: [row["output"] for row in mixed if row["which"] == name] for name in ("a", "b", "c", None)}
    assert len({tuple(t[:1]) for t in texts.values()}) > 1           # the adapters change the output
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert [m["name"] for m in manifest["lora"]] == ["a", "b", "c"]
    assert all(len(m["content_hash"]) == 64 and m["path"] == str(adapters[m["name"]]) for m in manifest["lora"])


def test_toml_table_and_an_unknown_name_is_an_error_row(tmp_path, tiny):
    opts, adapters = tiny
    toml = tmp_path / "job.toml"
    toml.write_text(f'lora = {{a = "{adapters["a"]}"}}\nlora_column = "which"\n')
    ds = jsonl(tmp_path / "d.jsonl", [{"id": "0", "prompt": "hi", "which": "a"},
                                      {"id": "1", "prompt": "hi", "which": "zzz"}])
    r, rows = submit(tmp_path, ds, *opts, "--config", str(toml))
    assert r.exit_code == 0, r.output
    ok, bad = sorted(rows, key=lambda x: x["id"])
    assert ok["adapter"] == "a" and ok["error"] is None
    assert "'zzz' is not one of this job's adapters" in bad["error"]


def test_a_lora_column_named_adapter_is_kept_as_input_adapter(tmp_path, tiny):
    """The README's `--lora-column adapter`: the input column survives as `input_adapter` beside the result's
    `adapter`, an unknown name and "" included (issue 41, item 6; classify's `input_label` rule)."""
    opts, adapters = tiny
    ds = jsonl(tmp_path / "d.jsonl", [{"id": "0", "prompt": "hi", "adapter": "a"},
                                      {"id": "1", "prompt": "hi", "adapter": "zzz"},
                                      {"id": "2", "prompt": "hi", "adapter": ""},
                                      {"id": "3", "prompt": "hi", "adapter": None}])
    r, rows = submit(tmp_path, ds, *opts, *_lora_args(adapters), "--lora-column", "adapter")
    assert r.exit_code == 0, r.output
    got = {row["id"]: (row["input_adapter"], row["adapter"], row["error"] is None) for row in rows}
    assert got == {"0": ("a", "a", True), "1": ("zzz", None, False), "2": ("", None, False), "3": (None, None, True)}


def test_an_openai_line_picks_its_adapter_by_model(tmp_path, tiny):
    opts, adapters = tiny
    def line(cid, model):
        return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
                "body": {"model": model, "prompt": "row says", "max_tokens": 8}}
    ds = jsonl(tmp_path / "b.jsonl", [line("x", "a"), line("y", "base"), line("z", "b")])
    r, rows = submit(tmp_path, ds, *opts, *_lora_args(adapters), "--served-model-name", "base")
    assert r.exit_code == 0, r.output
    assert {row["id"]: row["adapter"] for row in rows} == {"x": "a", "y": None, "z": "b"}


def test_resuming_after_an_adapter_changed_exits_2(tmp_path, tiny):
    opts, adapters = tiny
    import shutil
    mine = tmp_path / "mine"
    shutil.copytree(adapters["a"], mine)
    ds = jsonl(tmp_path / "d.jsonl", [{"id": "0", "prompt": "hi", "which": "a"}])
    args = [*opts, "--lora", f"a={mine}", "--lora-column", "which"]
    assert submit(tmp_path, ds, *args)[0].exit_code == 0
    assert submit(tmp_path, ds, *args)[0].exit_code == 0           # unchanged: resumes (nothing left)
    shutil.copy(adapters["b"] / "adapter_model.safetensors", mine / "adapter_model.safetensors")
    r, _ = submit(tmp_path, ds, *args)
    assert r.exit_code == 2 and "lora" in r.output


@pytest.mark.parametrize("change,message", [
    ({"use_dora": True}, "use_dora"), ({"bias": "lora_only"}, "bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"), ({"target_modules": ["embed_tokens"]}, "target_modules"),
])
def test_unsupported_adapters_exit_2_before_any_work(tmp_path, tiny, change, message):
    opts, adapters = tiny
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_model.safetensors").write_bytes((adapters["a"] / "adapter_model.safetensors").read_bytes())
    cfg = json.loads((adapters["a"] / "adapter_config.json").read_text()) | change
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    ds = jsonl(tmp_path / "d.jsonl", [{"id": "0", "prompt": "hi"}])
    r, _ = submit(tmp_path, ds, *opts, "--lora", f"x={bad}")
    assert r.exit_code == 2 and message in r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,message", [
    (["--lora-column", "which"], "--lora-column needs adapters"),
    (["--lora", "nopath"], "NAME=PATH"),
    (["--lora", "a=/does/not/exist"], "not a directory"),
])
def test_bad_lora_options_exit_2(tmp_path, tiny, args, message):
    opts, _ = tiny
    ds = jsonl(tmp_path / "d.jsonl", [{"id": "0", "prompt": "hi"}])
    r, _ = submit(tmp_path, ds, *opts, *args)
    assert r.exit_code == 2 and message in r.output, r.output


def test_data_parallel_workers_each_load_the_adapters(tmp_path, tiny):
    opts, adapters = tiny
    ds = jsonl(tmp_path / "d.jsonl", _rows(8))
    args = [*opts, *_lora_args(adapters), "--lora-column", "which"]
    r, one = submit(tmp_path, ds, *args)
    assert r.exit_code == 0, r.output
    r, two = submit(tmp_path, ds, *args, "--data-parallel", "2", out="dp")
    assert r.exit_code == 0, r.output
    key = lambda row: row["id"]
    assert [(x["adapter"], x["output"]) for x in sorted(two, key=key)] == \
        [(x["adapter"], x["output"]) for x in sorted(one, key=key)]


def test_the_planner_groups_rows_by_adapter():
    """Rows of two adapters and the base share a 40-token prefix: each unit holds one adapter's rows, so
    the engine computes the prefix once per adapter (tests/test_lora.py counts it)."""
    from jobrunner.config.lora import LoraOptions
    from jobrunner.planner import PlanItem, plan
    lora = LoraOptions((("a", "/a"), ("b", "/b")))
    shared = list(range(100, 140))
    names = ["a", "b", None, "b", "a", None]
    items = [PlanItem(i, lora.plan_tokens(n, shared + [i])) for i, n in enumerate(names)]
    units = list(plan(items, block_size=16))
    groups = [{names[k] for k in u.items} for u in units]
    assert sorted(map(sorted, groups), key=str) == sorted([["a"], ["b"], [None]], key=str)
    assert all(u.shared_prefix_len >= 40 for u in units)


def test_cache_keys_hash_the_adapter_content_not_its_name():
    from jobrunner.engine import Request
    from jobrunner.cache.key import request_key
    req = Request("1", [1, 2, 3], adapter="a")
    base = request_key(b"m", "generate", Request("1", [1, 2, 3]))
    one, same = (request_key(b"m", "generate", req, {"a": h}) for h in ("h1", "h1"))
    other = request_key(b"m", "generate", req, {"a": "h2"})
    renamed = request_key(b"m", "generate", Request("1", [1, 2, 3], adapter="z"), {"z": "h1"})
    assert one == same == renamed and len({base, one, other}) == 3
