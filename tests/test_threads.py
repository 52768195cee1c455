"""--threads and the automatic choice of CPU compute threads."""
import hashlib
import os
import subprocess
import sys
import threading
import time

import pytest

from jobrunner.common import threads
from jobrunner.config.job import job_config, JobConfigError


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


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _run_governor(other: list[float], current=2, ceiling=2):
    """The threads set at each of the readings `other` (busy cores of other processes), 2 s apart."""
    clock, seen, readings = _Clock(), [], iter(other)
    gov = threads.ThreadGovernor(seen.append, current, ceiling, every_s=2.0, other=lambda: next(readings),
                                 clock=clock)
    gov.tick()                              # before its first interval: no reading
    for k in range(1, len(other) + 1):
        clock.now = 2.0 * k
        gov.tick()
        clock.now += 1.0
        gov.tick()                          # between readings: nothing read
    return gov, seen


def test_the_governor_drops_threads_at_once_and_takes_them_back_after_three_free_readings():
    gov, seen = _run_governor([1.0, 0.0, 0.1, 0.0])
    assert seen == [1, 2] and gov.current == 2 and gov.changes == 2


def test_a_passing_burst_does_not_flip_the_governor_up():
    gov, seen = _run_governor([0.0, 0.0, 1.0, 0.0, 0.0, 0.9], current=1)
    assert seen == [] and gov.current == 1


def test_a_small_share_of_a_core_does_not_count_but_a_third_does():
    assert _run_governor([0.2, 0.1])[1] == []
    assert _run_governor([0.35])[1] == [1]


def test_the_governor_stays_within_the_cores_it_may_use():
    gov, seen = _run_governor([3.0, 0.0, 0.0, 0.0, 0.0], current=2, ceiling=2)
    assert seen == [1, 2]                   # never below one, never above the ceiling


def test_other_load_leaves_out_this_process_own_threads(monkeypatch):
    def machine_busy_s():                   # a machine where only this process works (and 0.5 s else)
        t = os.times()
        return t.user + t.system + 0.5 * time.monotonic()
    monkeypatch.setattr(threads.OtherLoad, "_machine_busy_s", staticmethod(machine_busy_s))
    stop = threading.Event()

    def spin():                             # hashing a large buffer releases the GIL: this thread runs in C
        while not stop.is_set():
            hashlib.sha256(bytes(1 << 22)).digest()
    load = threads.OtherLoad()
    worker = threading.Thread(target=spin)
    worker.start()
    try:
        time.sleep(1.0)
        own = load.cores()
    finally:
        stop.set()
        worker.join()
    assert own == pytest.approx(0.5, abs=0.05)    # the spinning thread's core is not other load


def test_other_load_sees_another_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        load = threads.OtherLoad()
        time.sleep(1.5)
        other = load.cores()
    finally:
        proc.kill()
        proc.wait()
    assert other is not None and other > 0.3


def test_a_job_follows_the_load_unless_its_threads_are_fixed(monkeypatch, tmp_path, tiny_hf_model_dir):
    import torch
    from jobrunner.pipeline.build import open_job
    before = torch.get_num_threads()
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"id": {i}, "prompt": "p{i}"}}\n' for i in range(3)))
    model = str(tiny_hf_model_dir("llama"))
    try:
        fixed = open_job(job_config(dataset=str(data), model=model, threads=2, max_tokens=2, output=str(tmp_path / "f")))
        assert isinstance(fixed.threads, threads.FixedThreads)
        torch.set_num_threads(1)            # as a governor of an earlier job on the same engine may leave it
        again = open_job(job_config(dataset=str(data), model=model, threads=2, max_tokens=2, output=str(tmp_path / "g")),
                         engine=fixed.engine)
        assert isinstance(again.threads, threads.FixedThreads) and torch.get_num_threads() == 2
        fixed.engine.close()
        job = open_job(job_config(dataset=str(data), model=model, max_tokens=2, output=str(tmp_path / "out")))
        gov = job.threads
        assert isinstance(gov, threads.ThreadGovernor)
        gov.every_s, gov.next_check, gov.other = 0.0, 0.0, lambda: 5.0      # every core busy elsewhere
        assert job.run().exit_code == 0
        assert gov.current == 1 and torch.get_num_threads() == 1

        job.engine.close()
    finally:
        torch.set_num_threads(before)
