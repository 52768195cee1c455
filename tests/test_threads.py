"""--threads and the automatic choice of CPU compute threads."""
import pytest

from jobrunner import threads
from jobrunner.config import job_config, JobConfigError


def test_free_cores_leaves_the_cores_other_threads_are_running_on(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 4)
    busy = iter([1, 3, 1, 1, 0])                           # a passing burst (3) does not decide
    monkeypatch.setattr(threads, "_running_elsewhere", lambda: next(busy))
    monkeypatch.setattr(threads, "_GAP_S", 0)
    assert threads.free_cores() == 3


def test_free_cores_is_at_least_one(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.setattr(threads, "_running_elsewhere", lambda: 7)
    monkeypatch.setattr(threads, "_GAP_S", 0)
    assert threads.free_cores() == 1


def test_without_proc_stat_every_core_is_used(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 6)
    monkeypatch.setattr(threads, "_running_elsewhere", lambda: None)
    assert threads.free_cores() == 6


def test_the_user_choice_wins_and_is_checked(monkeypatch):
    monkeypatch.setattr(threads, "free_cores", lambda: 5)
    assert job_config(dataset="d.csv", threads=3).cpu_threads() == 3
    assert job_config(dataset="d.csv").cpu_threads() == 5
    with pytest.raises(JobConfigError, match="--threads"):
        job_config(dataset="d.csv", threads=0)


def test_threads_do_not_change_what_a_resume_accepts():
    assert "threads" not in job_config(dataset="d.csv", threads=2).fingerprint_fields()
