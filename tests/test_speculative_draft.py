"""--speculative draft --draft-model M (engine/core/draft_model.py): a smaller model of the same vocabulary
drafts, the target verifies. The tokens are the plain engine's (greedy and seeded sampling) whatever the draft
model guesses; a draft model that is the target itself has every draft accepted; one of another vocabulary,
or the option without its mode, is refused before any row runs."""
from __future__ import annotations

import json

import polars as pl
import pytest
from click.testing import CliRunner

import jobrunner
from jobrunner.cli.main import main
from tests.cache_helpers import tiny_model, write_jsonl

ROWS = [{"id": f"r{i}", "prompt": f"Copy this list: {', '.join(str(i * j % 17) for j in range(12))}. Again:"}
        for i in range(6)] + [{"id": "short", "prompt": "Hi"}]
RUN = dict(device="cpu", kv_cache_memory="32MB", max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tiny_hf_model_dir):
    return str(tiny_hf_model_dir("llama"))


def _generate(target, **options) -> pl.DataFrame:
    df = jobrunner.generate(ROWS, model=target, **RUN, **options)
    assert df["error"].null_count() == len(ROWS), df["error"].to_list()
    return df.sort("id")


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 5}], ids=["greedy", "sampled"])
def test_the_tokens_are_the_plain_engines_whatever_the_draft_model(target, tiny_hf_model_dir, sampling):
    plain = _generate(target, **sampling)
    other = str(tiny_hf_model_dir("qwen2"))            # the same tokenizer, other weights: few drafts kept
    for draft in (target, other):
        spec = _generate(target, speculative="draft", draft_model=draft, **sampling)
        assert spec["output"].to_list() == plain["output"].to_list(), draft
        assert spec["completion_tokens"].to_list() == plain["completion_tokens"].to_list()
        assert spec["draft_tokens"].sum() > 0


def test_the_target_as_its_own_draft_model_has_every_greedy_draft_accepted(target):
    spec = _generate(target, speculative="draft", draft_model=target, speculative_tokens=3)
    drafted, accepted = spec["draft_tokens"].sum(), spec["accepted_tokens"].sum()
    assert drafted > 0 and accepted == drafted
    # each verify step keeps its 3 drafts and adds the target's own next token: 4 tokens a step after the first
    assert drafted >= 3 * len(ROWS) * ((24 - 1) // 4 - 1)


def test_a_draft_model_of_another_vocabulary_is_refused_before_any_row(target, tmp_path):
    dataset = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    other_vocab = tiny_model(tmp_path)                  # a dummy model: a byte-level vocabulary of 259 tokens
    r = CliRunner().invoke(main, ["submit", dataset, "-m", target, "-o", str(tmp_path / "out"), "--device", "cpu",
                                  "--kv-cache-memory", "32MB", "--speculative", "draft", "--draft-model", other_vocab])
    assert r.exit_code == 2, r.output
    assert "the draft model's vocabulary differs from the model's" in r.output
    assert not (tmp_path / "out" / "part-00000.parquet").exists()


@pytest.mark.parametrize("args, says", [
    (["--speculative", "draft"], "--speculative draft needs --draft-model"),
    (["--speculative", "ngram", "--draft-model", "x"], "--draft-model drafts for --speculative draft or auto, not ngram"),
    (["--draft-model", "x"], "--draft-model drafts for --speculative draft or auto, not off"),
])
def test_the_draft_options_without_each_other_stop_before_any_work(tmp_path, args, says):
    dataset = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    r = CliRunner().invoke(main, ["submit", dataset, "-m", "dummy:x", "-o", str(tmp_path / "out"), *args])
    assert r.exit_code == 2 and says in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_auto_with_a_draft_model_drafts_where_it_pays_and_keeps_the_plain_tokens(target, monkeypatch):
    """Under auto a draft model is asked only for the rows the switch lets draft: untried rows explore, then
    a draft model that is the target itself (every draft kept) keeps drafting."""
    from jobrunner.engine.core.draft_model import DraftModelDrafter

    asked = []
    propose = DraftModelDrafter.propose_rows
    monkeypatch.setattr(DraftModelDrafter, "propose_rows",
                        lambda self, rows, k: asked.append(len(rows)) or propose(self, rows, k))
    plain = _generate(target)
    spec = _generate(target, speculative="auto", draft_model=target)
    assert spec["output"].to_list() == plain["output"].to_list()
    assert spec["accepted_tokens"].sum() == spec["draft_tokens"].sum() > 0
    assert asked and max(asked) <= len(ROWS)


def test_auto_asks_a_costly_drafter_for_the_planned_rows_only():
    """No shadow drafts from a model: before any step is timed every untried row explores; once a plain
    step is cheaper than what drafting adds, the drafter is not asked at all."""
    from jobrunner.engine.api.request import SamplingParams
    from jobrunner.engine.schedule.kv_manager import KVCacheManager
    from jobrunner.engine.schedule.scheduler import Scheduler
    from jobrunner.engine.schedule.sequence import Sequence
    from jobrunner.engine.spec.speculator import Speculator

    class Costly:
        costly, calls = True, []

        def propose_rows(self, rows, k):
            self.calls.append([seq_id for seq_id, _, _ in rows])
            return {seq_id: [7] * k for seq_id, _, _ in rows}

        def forget(self, seq_id):
            pass

        def close(self):
            pass

    spec = Speculator("auto", 4, Costly())
    sched = Scheduler(KVCacheManager(num_blocks=64, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
    rows = [Sequence(str(i), [1, 2, 3], 3, SamplingParams(max_tokens=20, ignore_eos=True)) for i in range(3)]
    for seq in rows:
        sched.add(seq)
    sched.finish_step(sched.schedule())
    for seq in rows:
        seq.token_ids.append(9)             # each row's first sample: decoding one token a step from here
    spec.propose(rows, 1024)
    assert Costly.calls == [[r.seq_id for r in rows]] and all(len(r.draft) == 2 for r in rows)   # untried: explore
    for _ in range(30):                      # drafting costs far more than the tokens it could add
        spec.timed(3, 6, 1.0)
        spec.timed(3, 0, 0.01)
    Costly.calls.clear()
    spec.propose(rows, 1024)
    assert Costly.calls == [] and all(r.draft == [] for r in rows)


def test_the_draft_model_is_not_part_of_the_resume_fingerprint(target, tmp_path):
    """Drafts change no token: a run with a draft model resumes one without (and its rows are the same)."""
    dataset = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    out = tmp_path / "out"
    assert jobrunner.submit(dataset, str(out), model=target, limit=3, **RUN).exit_code == 0
    result = jobrunner.submit(dataset, str(out), model=target, speculative="draft", draft_model=target, **RUN)
    assert result.exit_code == 0
    stats = json.loads((out / "_stats.json").read_text())
    assert stats["rows"] == len(ROWS)


def test_a_drafted_positions_samples_follow_the_targets_distribution(target):
    """Speculative sampling's accept/resample rule, tested statistically: 600 seeded rows at temperature 0.5,
    each row's second token drafted (greedily, by the target itself) and verified, some drafts kept and some
    refused. Each second token's randomized probability integral transform under the target's own softmax
    after the row's first token is uniform (Kolmogorov-Smirnov, p > 0.001); the drafts themselves, which
    keeping every draft would give, are not."""
    import torch
    from scipy.stats import kstest
    from transformers import AutoModelForCausalLM

    from jobrunner.engine import Engine, EngineConfig
    from jobrunner.engine.api.request import Request, SamplingParams

    prompt, temperature = [5, 77, 130, 9, 42, 200, 17], 0.5
    config = EngineConfig(model=target, kv_cache_memory=32 * 2**20, speculative="draft", draft_model=target,
                          num_speculative_tokens=2, async_scheduling=False)    # the first token known before step 2
    with Engine(config) as engine:
        params = [SamplingParams(max_tokens=3, temperature=temperature, seed=s, ignore_eos=True) for s in range(600)]
        outs = engine.generate([Request(f"r{s}", prompt, p) for s, p in enumerate(params)])
        counters = engine.counters()
    assert 0 < counters.accepted_tokens < counters.draft_tokens         # both branches of the rule ran
    pairs = [o.completions[0].token_ids[:2] for o in outs]
    firsts = sorted({a for a, _ in pairs})
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + [a] for a in firsts])).logits[:, -1, :]
    probs = dict(zip(firsts, torch.softmax(logits.double() / temperature, -1)))
    drafts = dict(zip(firsts, logits.argmax(-1).tolist()))
    jitter = torch.Generator().manual_seed(0)

    def pit(a: int, token: int) -> float:
        """F(token - 1) + V * p(token), V uniform: uniform on (0, 1) when token ~ p."""
        p = probs[a]
        return (p[:token].sum() + torch.rand((), generator=jitter, dtype=torch.float64) * p[token]).item()
    assert kstest([pit(a, b) for a, b in pairs], "uniform").pvalue > 1e-3
    assert kstest([pit(a, drafts[a]) for a, _ in pairs], "uniform").pvalue < 1e-3     # the test has the power
