"""Embeddings (--kind embed, /v1/embeddings): the engine's pooled vectors against transformers' hidden
states pooled the same way, the checkpoint's sentence-transformers files, the Parquet column, the
OpenAI batch lines, and rows flushed in parts."""
from __future__ import annotations

import base64
import json
import shutil
from array import array

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import jobrunner
from jobrunner.engine.config.embedding import CheckpointPooling, read_checkpoint_pooling
from jobrunner.engine.api.request import EmbedParams, Request
from jobrunner.config.job import JobConfigError
from jobrunner.output import read_results
from jobrunner.jobs.spec import EmbedSpec
from tests.kernel_cases import cuda_only
from tests.tiny import engine_for, forbid_launch_syncs, hf_model, prompts

COMBOS = [(pooling, normalize, dims) for pooling in ("last", "mean", "cls")
          for normalize, dims in ((False, None), (True, None), (True, 24), (False, 24))]


def pooled(hidden: torch.Tensor, pooling: str, normalize: bool, dims: int | None) -> torch.Tensor:
    """The reference: [T, hidden] final hidden states (after the final norm) -> one vector."""
    v = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    v = v[:dims] if dims else v
    return torch.nn.functional.normalize(v, dim=-1) if normalize else v


def hf_hidden(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf.model(torch.tensor([ids])).last_hidden_state[0]


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_embeddings_match_transformers_with_chunks_and_prefix_cache(arch):
    hf = hf_model(arch)
    # 24-token steps split the 40-token prompts into chunks; 4-token blocks let the shared prefix be cached
    engine = engine_for(hf, max_num_batched_tokens=24, block_size=4)
    instruction = prompts(7, (18,))[0]                           # shared by every row, as an instruction prefix
    texts = [instruction + p for p in prompts(3, (5, 17, 22, 1, 9))]
    reference = [hf_hidden(hf, ids) for ids in texts]
    for pooling, normalize, dims in COMBOS:
        params = EmbedParams(pooling, normalize, dims)
        outs = engine.generate([Request(f"{pooling}-{normalize}-{dims}-{i}", ids, embed=params)
                                for i, ids in enumerate(texts)])
        for out, ids, h in zip(outs, texts, reference):
            assert out.error is None and out.prompt_tokens == len(ids) and out.completion_tokens == 0
            want = pooled(h, pooling, normalize, dims)
            assert len(out.embedding) == len(want)
            assert torch.allclose(torch.tensor(out.embedding), want, atol=1e-5, rtol=0), (pooling, normalize, dims)
        cached = [o.cached_tokens for o in outs]
        # last pooling reads only the last position: the shared prefix comes from the cache; mean and cls
        # read every (first) position, so they compute the prompt in full (exact, never a partly cached sum)
        # (all but the first row of the first pass, which computes it)
        assert (sorted(cached)[1] >= 16) if pooling == "last" else cached == [0] * len(outs)
    assert engine.kv.pool.num_free == engine.kv.num_blocks      # every block released (cached, unreferenced)
    assert not engine.scheduler.has_unfinished() and not engine.runner.pooler._partial


def test_mean_pooling_is_exact_when_sequences_are_preempted():
    hf = hf_model("qwen3")
    # 24 blocks of 4 tokens: six 45-token prompts in 16-token chunks cannot all stay; some are recomputed
    engine = engine_for(hf, max_num_batched_tokens=16, block_size=4, kv_cache_memory=24 * 4 * 512)
    texts = prompts(5, (45, 44, 43, 45, 42, 41))
    outs = engine.generate([Request(f"m{i}", ids, embed=EmbedParams("mean", False)) for i, ids in enumerate(texts)])
    assert engine.counters().preemptions > 0
    for out, ids in zip(outs, texts):
        assert torch.allclose(torch.tensor(out.embedding), pooled(hf_hidden(hf, ids), "mean", False, None), atol=1e-5)


def test_one_request_embeds_several_inputs_and_refuses_too_many_dimensions():
    hf = hf_model("qwen3")
    engine = engine_for(hf)
    a, b, c = prompts(9, (6, 11, 3))
    out, bad = engine.generate([Request("multi", a, embed=EmbedParams("last", True), more_inputs=[b, c]),
                                Request("bad", a, embed=EmbedParams("last", True, dimensions=65))])
    assert out.prompt_tokens == 20 and len(out.embeddings) == 3
    for got, ids in zip(out.embeddings, (a, b, c)):
        assert torch.allclose(torch.tensor(got), pooled(hf_hidden(hf, ids), "last", True, None), atol=1e-5)
    assert bad.error == "dimensions 65 exceeds the model's embedding size 64" and bad.embeddings is None


@cuda_only[0]
@cuda_only[1]
def test_on_cuda_embeddings_match_transformers_and_launch_never_waits():
    """Pooling stays on the device: with torch's sync debug mode on during launch(), any host sync
    would raise. float32 vectors equal transformers' (Triton attention: a looser tolerance)."""
    hf = hf_model("qwen3")
    engine = engine_for(hf, device="cuda", dtype="float32", max_num_batched_tokens=24, block_size=4)
    texts = [prompts(7, (18,))[0] + p for p in prompts(3, (5, 17, 22, 1, 9))]
    requests = lambda tag: [Request(f"{tag}-{pooling}-{i}", ids, embed=EmbedParams(pooling, True, 24))
                            for pooling in ("last", "mean", "cls") for i, ids in enumerate(texts)]
    engine.generate(requests("warm"))                  # compiles every kernel first
    forbid_launch_syncs(engine)
    outs = engine.generate(requests("strict"))
    for k, out in enumerate(outs):
        pooling, ids = ("last", "mean", "cls")[k // len(texts)], texts[k % len(texts)]
        want = pooled(hf_hidden(hf, ids), pooling, True, 24)
        assert torch.allclose(torch.tensor(out.embedding), want, atol=1e-3), (pooling, k)


# --- the checkpoint's sentence-transformers files ---------------------------------------------------------

def write_st_files(root, pooling_flag: str | None, normalize: bool = True, extra_module: str | None = None):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling_flag:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (root / "1_Pooling").mkdir(exist_ok=True)
        flags = {f"pooling_mode_{m}": m == pooling_flag for m in
                 ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")}
        (root / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags}))
    if extra_module:
        modules.append({"idx": 2, "name": "2", "path": "2_X", "type": f"sentence_transformers.models.{extra_module}"})
    if normalize:
        modules.append({"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"})
    (root / "modules.json").write_text(json.dumps(modules))


@pytest.mark.parametrize("flag,normalize,extra,want", [
    ("lasttoken", True, None, CheckpointPooling("last", True)),
    ("mean_tokens", False, None, CheckpointPooling("mean", False)),
    ("cls_token", True, None, CheckpointPooling("cls", True)),
    ("max_tokens", True, None, "pooling pooling_mode_max_tokens"),
    ("lasttoken", True, "Dense", "module(s) Dense"),
])
def test_checkpoint_pooling_is_read_from_sentence_transformers_files(tmp_path, flag, normalize, extra, want):
    assert read_checkpoint_pooling(tmp_path) is None            # no modules.json: not an embedding checkpoint
    write_st_files(tmp_path, flag, normalize, extra)
    got = read_checkpoint_pooling(tmp_path)
    if isinstance(want, CheckpointPooling):
        assert got == want and EmbedSpec().params(got) == EmbedParams(want.pooling, want.normalize)
        assert EmbedSpec("cls", False, 8).params(got) == EmbedParams("cls", False, 8)     # options win
    else:
        assert got.unsupported and want in got.unsupported
        with pytest.raises(ValueError, match="does not apply; pass --pooling"):
            EmbedSpec().params(got)
    assert EmbedSpec().params(None) == EmbedParams("last", True)    # no files: last token, normalized


# --- jobs: Parquet, polars, OpenAI batch --------------------------------------------------------------------

SMALL = dict(device="cpu", kv_cache_memory="16MB", kind="embed")
INSTRUCTION = "Instruct: find reviews of the same product\\nQuery: "


@pytest.fixture
def embed_model(tiny_hf_model_dir, tmp_path):
    """The tiny Qwen3 checkpoint with sentence-transformers files: mean pooling, normalized."""
    root = tmp_path / "tiny-qwen3-embed"
    shutil.copytree(tiny_hf_model_dir("qwen3"), root)
    write_st_files(root, "mean_tokens", normalize=True)
    return root


def hf_reference(model_dir, texts: list[str], pooling: str, normalize: bool, dims: int | None) -> list[torch.Tensor]:
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return [pooled(hf_hidden(hf, tok(t)["input_ids"]), pooling, normalize, dims) for t in texts]


def test_embed_job_writes_a_float32_array_column_pooled_as_the_checkpoint_says(embed_model, tmp_path):
    import polars as pl
    words = ["great blender, loud", "the kettle leaks", "fine toaster", "blender broke in a week", "love it"]
    ds = tmp_path / "docs.jsonl"
    ds.write_text("".join(json.dumps({"id": f"d{i}", "text": w}) + "\n" for i, w in enumerate(words))
                  + json.dumps({"id": "bad", "text": None}) + "\n")
    result = jobrunner.submit(str(ds), model=str(embed_model), template=INSTRUCTION + "{text}", dimensions=32,
                              **SMALL)
    assert result.exit_code == 0 and result.stats["rows"] == 6 and result.stats["rows_failed"] == 1
    part = pq.read_table(next((tmp_path / "docs.jsonl.results").glob("part-*.parquet")))
    kind = part.schema.field("embedding").type
    assert pa.types.is_fixed_size_list(kind) and kind.list_size == 32 and kind.value_type == pa.float32()
    df = pl.read_parquet(str(tmp_path / "docs.jsonl.results" / "part-*.parquet"))
    assert df.schema["embedding"] == pl.Array(pl.Float32, 32)
    rows = {r["id"]: r for r in read_results(result.output).to_pylist()}
    assert rows["bad"]["embedding"] is None and "text" in rows["bad"]["error"]
    texts = [INSTRUCTION.replace("\\n", "\n") + w for w in words]
    for i, want in enumerate(hf_reference(embed_model, texts, "mean", True, 32)):
        row = rows[f"d{i}"]
        assert row["finish_reason"] == "stop" and row["prompt_tokens"] > 0 and row["cached_tokens"] == 0
        assert torch.allclose(torch.tensor(row["embedding"]), want, atol=1e-5)
    # last pooling over the same rows: the shared instruction comes from the prefix cache
    last = jobrunner.submit(str(ds), str(tmp_path / "last"), model=str(embed_model), pooling="last",
                            normalize_embeddings=False, template=INSTRUCTION + "{text}", block_size=4, **SMALL)
    got = {r["id"]: r for r in read_results(last.output).to_pylist()}
    assert sum(r["cached_tokens"] for r in got.values()) > 0
    for i, want in enumerate(hf_reference(embed_model, texts, "last", False, None)):
        assert torch.allclose(torch.tensor(got[f"d{i}"]["embedding"]), want, atol=1e-5)


def test_embedding_rows_are_flushed_in_parts_as_compact_float_arrays(embed_model, tmp_path, monkeypatch):
    """Memory: vectors never pile up for the whole job; the writer holds at most part_rows of them, each
    an array('f') of 4 bytes a value, and writes them out as parts while the job runs."""
    from jobrunner.output import ResultWriter
    seen = []
    write = ResultWriter.write

    def spy(self, rows):
        write(self, rows)
        seen.append((len(self._buffer), len(self.parts)))
        for r in rows:
            if r.get("embedding") is not None:
                assert isinstance(r["embedding"], array) and r["embedding"].itemsize == 4
    monkeypatch.setattr(ResultWriter, "write", spy)
    ds = tmp_path / "many.jsonl"
    ds.write_text("".join(json.dumps({"id": str(i), "prompt": f"document number {i}"}) + "\n" for i in range(11)))
    result = jobrunner.submit(str(ds), model=str(embed_model), part_rows=3, **SMALL)
    assert result.exit_code == 0 and len(seen) == 11
    assert max(buffered for buffered, _ in seen) < 3                     # flushed as soon as a part is full
    assert [parts for _, parts in seen][-1] == 3                         # 3 parts during the run, 1 at the end
    assert len(list((tmp_path / "many.jsonl.results").glob("part-*.parquet"))) == 4


@pytest.mark.parametrize("options,message", [
    ({"pooling": "mean", "kind": "generate"}, "need kind embed"),        # the API's names, not the CLI's
    ({"dimensions": 0}, "dimensions must be >= 1"),
    ({"dimensions": 65}, "dimensions 65 exceeds the model's embedding size 64"),
])
def test_bad_embed_options_stop_before_any_work(embed_model, tmp_path, options, message):
    ds = tmp_path / "d.jsonl"
    ds.write_text('{"id": "a", "prompt": "hi"}\n')
    with pytest.raises(JobConfigError, match=message):
        jobrunner.submit(str(ds), model=str(embed_model), **(SMALL | options))
    assert not (tmp_path / "d.jsonl.results" / "part-00000.parquet").exists()


def test_a_checkpoint_pooling_we_cannot_reproduce_stops_the_job(embed_model, tmp_path):
    write_st_files(embed_model, "lasttoken", extra_module="Dense")
    ds = tmp_path / "d.jsonl"
    ds.write_text('{"id": "a", "prompt": "hi"}\n')
    with pytest.raises(JobConfigError, match="Dense, which jobrunner does not apply"):
        jobrunner.submit(str(ds), model=str(embed_model), **SMALL)


def test_openai_embeddings_batch_lines_parse_with_the_openai_types(embed_model, tmp_path):
    from openai.types import CreateEmbeddingResponse

    def line(cid, body, url="/v1/embeddings"):
        return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": {"model": "m", **body}}) + "\n"
    ds = tmp_path / "batch.jsonl"
    ds.write_text(line("one", {"input": "a blender"})
                  + line("many", {"input": ["a kettle", "a toaster", "a blender"], "dimensions": 16})
                  + line("b64", {"input": "a blender", "encoding_format": "base64"})
                  + line("empty-list", {"input": []})
                  + line("tokens", {"input": [1, 2, 3]})
                  + line("blank", {"input": ["ok", " "]})
                  + line("number", {"input": 7})
                  + line("bad-dims", {"input": "x", "dimensions": -3})
                  + line("bad-format", {"input": "x", "encoding_format": "int8"})
                  + line("chat", {"messages": [{"role": "user", "content": "hi"}]}, url="/v1/chat/completions"))
    result = jobrunner.submit(str(ds), model=str(embed_model), output_format="openai-batch", served_model_name=["m"],
                              **SMALL)
    assert result.exit_code == 0
    out = tmp_path / "batch.jsonl.results"
    lines = {r["custom_id"]: r for name in ("results.openai.jsonl", "errors.openai.jsonl")
             for r in map(json.loads, open(out / name))}
    assert len(lines) == 10
    raw_b64 = lines["b64"]["response"]["body"]["data"][0]["embedding"]
    assert isinstance(raw_b64, str)
    for d in lines["b64"]["response"]["body"]["data"]:     # decoded as the openai client does (float32 bytes)
        d["embedding"] = np.frombuffer(base64.b64decode(d["embedding"]), dtype="float32").tolist()
    bodies = {cid: CreateEmbeddingResponse.model_validate(r["response"]["body"])
              for cid, r in lines.items() if r["error"] is None}
    assert set(bodies) == {"one", "many", "b64"}
    assert [len(d.embedding) for d in bodies["many"].data] == [16, 16, 16]
    assert [d.index for d in bodies["many"].data] == [0, 1, 2]
    assert bodies["many"].usage.prompt_tokens == bodies["many"].usage.total_tokens > 0
    one = np.array(bodies["one"].data[0].embedding, dtype=np.float32)
    b64 = np.array(bodies["b64"].data[0].embedding, dtype=np.float32)
    assert one.shape == (64,) and np.array_equal(one, b64) and abs(np.linalg.norm(one) - 1) < 1e-5
    blender = hf_reference(embed_model, ["a blender"], "mean", True, 16)[0]
    assert torch.allclose(torch.tensor(bodies["many"].data[2].embedding), blender, atol=1e-5)
    for cid, message in [("empty-list", "non-empty list"), ("tokens", "token-id inputs"), ("blank", "empty string"),
                         ("number", "a string or"), ("bad-dims", "dimensions"), ("bad-format", "encoding_format"),
                         ("chat", "--kind embed serves /v1/embeddings")]:
        assert lines[cid]["response"] is None and message in lines[cid]["error"]["message"], cid
