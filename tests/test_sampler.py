"""The batched sampler: the right distribution after temperature, top-k, top-p and min-p,
rows independent of their batch mates, one fixed draw per (seed, sample, position)."""
import pytest
import torch

from jobrunner.engine.api.request import SamplingParams
from jobrunner.engine.sample.sampler import SampleRow, draw_uniform, sample

LOGITS = torch.log(torch.tensor([0.05, 0.30, 0.10, 0.40, 0.15]))
N = 20000


def _draw(params: SamplingParams, logits=LOGITS, n=N) -> torch.Tensor:
    rows = [SampleRow(i, params, draw_uniform(11, 0, i)) for i in range(n)]
    tokens, _ = sample(logits.expand(n, -1).clone(), rows)
    return torch.bincount(torch.tensor(tokens), minlength=logits.numel()).float() / n


def _expected(keep: list[int], temperature: float = 1.0) -> torch.Tensor:
    x = torch.full_like(LOGITS, float("-inf"))
    x[keep] = LOGITS[keep] / temperature
    return torch.softmax(x, -1)


@pytest.mark.parametrize("params,keep", [
    (SamplingParams(temperature=1.0), [0, 1, 2, 3, 4]),
    (SamplingParams(temperature=0.5), [0, 1, 2, 3, 4]),
    (SamplingParams(temperature=1.0, top_k=2), [1, 3]),
    (SamplingParams(temperature=1.0, top_p=0.8), [1, 3, 4]),      # 0.40 + 0.30 < 0.8 <= + 0.15
    (SamplingParams(temperature=1.0, min_p=0.3), [1, 3, 4]),      # p >= 0.3 * 0.40
    (SamplingParams(temperature=1.0, top_k=3, top_p=0.6), [1, 3]),
], ids=["plain", "temperature", "top-k", "top-p", "min-p", "top-k+top-p"])
def test_frequencies_follow_the_filtered_distribution(params, keep):
    t = params.temperature
    freq = _draw(params)
    assert freq[[i for i in range(5) if i not in keep]].sum() == 0          # filtered tokens never drawn
    torch.testing.assert_close(freq, _expected(keep, t), atol=0.015, rtol=0)


def test_rows_ignore_their_batch_mates_and_greedy_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=10),
             SamplingParams(temperature=1.3, top_p=0.5), SamplingParams(temperature=0.0, logprobs=2),
             SamplingParams(temperature=0.9, min_p=0.05), SamplingParams(temperature=1.0)]
    rows = [SampleRow(i, p, draw_uniform(5, 0, 100 + i)) for i, p in enumerate(mixed)]
    together, logprobs = sample(logits, rows)
    alone = [sample(logits[i:i + 1], [SampleRow(0, r.params, r.uniform)])[0][0] for i, r in enumerate(rows)]
    assert together == alone
    assert together[0] == int(logits[0].argmax()) and together[3] == int(logits[3].argmax())
    assert logprobs[3].token_id == together[3] and len(logprobs[3].top) == 2 and logprobs[0] is None


def test_draw_uniform_is_fixed_by_its_key():
    draws = [draw_uniform(s, k, p) for s in range(3) for k in range(3) for p in range(50)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) == len(draws)
    assert draw_uniform(1, 2, 3) == draw_uniform(1, 2, 3)
