import random

import pytest

from jobrunner.common import idset
from jobrunner.common.idset import IdSet


@pytest.fixture
def small_recent(monkeypatch):
    monkeypatch.setattr(idset, "RECENT", 4)     # many seals and merges from a few ids


def test_matches_a_python_set_through_many_merges(small_recent):
    rng = random.Random(0)
    s, ref = IdSet(), set()
    for step in range(60):
        batch = [f"id{rng.randrange(400)}" for _ in range(rng.randrange(1, 12))]
        want, seen = [], set(ref)
        for i in batch:                                  # sequential reference semantics
            want.append(i in seen)
            seen.add(i)
        assert s.add_new(batch) == want
        ref |= set(batch)
        assert len(s) == len(ref)
        probe = [f"id{k}" for k in range(0, 420, 7)]
        assert s.contains_many(probe) == [p in ref for p in probe]
    assert all(f"id{k}" in s for k in range(400) if f"id{k}" in ref)
    assert "nope" not in s


def test_a_repeat_within_one_call_is_caught_across_a_seal(small_recent):
    s = IdSet(["a", "b", "c"])                # one more id fills `recent` and seals it
    assert s.add_new(["x", "x", "y", "x"]) == [False, True, False, True]
    assert len(s) == 5 and "x" in s and "y" in s


def test_runs_stay_sorted_disjoint_and_logarithmic(small_recent):
    s = IdSet(f"row-{i}" for i in range(1000))
    assert len(s) == 1000
    sizes = [len(r) for r in s._runs]
    assert sum(sizes) + len(s._recent) == 1000
    assert all(2 * b < a for a, b in zip(sizes, sizes[1:]))       # each run under half the one before
    assert len(sizes) <= 9                                         # about log2(1000 / 4)
    for r in s._runs:
        raw = [bytes(x) for x in r]
        assert raw == sorted(raw)
    every = [bytes(x) for r in s._runs for x in r] + list(s._recent)
    assert len(set(every)) == 1000


def test_odd_ids_and_scalar_api():
    s = IdSet()
    for i in ("", "a", "\udc80 lone surrogate", "é", "a" * 10_000):
        assert i not in s
        s.add(i)
        assert i in s
    s.add("a")
    assert len(s) == 5 and "b" not in s
    assert s.add_new(["b", "b", "a"]) == [False, True, True]
    assert len(s) == 6


def test_about_16_bytes_an_id():
    s = IdSet(str(i) for i in range(100_000))
    assert len(s) == 100_000 and "99999" in s and "100000" not in s
    assert sum(r.nbytes for r in s._runs) <= 16 * 100_000
    assert len(s._recent) < idset.RECENT
