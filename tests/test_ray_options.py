"""`--ray` without a cluster: the options (CLI, TOML, API), their checks, and the work queue's tickets."""
import json

import pytest
from click.testing import CliRunner

from jobrunner.api import build_config
from jobrunner.cli import main
from jobrunner.config import JobConfigError
from jobrunner.parallel.ray_queue import WorkQueue
from jobrunner.ray_options import RayOptions, fold_cli


def test_the_command_line_folds_into_one_section():
    params = fold_cli({"ray": "auto", "ray_max_workers": 4, "ray_resources": '{"CPU": 2, "TPU": 1}', "n": 1})
    cfg = build_config("x.jsonl", params)
    assert cfg.parallel.ray == RayOptions(address="auto", max_workers=4, resources=(("CPU", 2.0), ("TPU", 1.0)))
    assert cfg.parallel.ray.resource_dict == {"CPU": 2.0, "TPU": 1.0}
    assert "ray" not in cfg.fingerprint_fields()        # where a job runs never changes its rows
    assert build_config("x.jsonl").parallel.ray is None
    assert fold_cli({"n": 1}) == {"n": 1}


def test_toml_takes_an_address_or_a_table(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text('[ray]\naddress = "ray://head:10001"\nmin_workers = 2\ntimeout_s = 60\n')
    cfg = build_config("x.jsonl", config=str(toml))
    assert cfg.parallel.ray == RayOptions(address="ray://head:10001", min_workers=2, timeout_s=60.0)
    toml.write_text('ray = "auto"\n')
    assert build_config("x.jsonl", config=str(toml)).parallel.ray == RayOptions()


@pytest.mark.parametrize("value, message", [
    ({"address": "auto", "workers": 2}, "unknown keys workers"),
    ({"address": "auto", "min_workers": "2"}, "min_workers must be an integer"),
    ({"address": "auto", "resources": "{not json"}, "--ray-resources is not valid JSON"),
    ({"address": "auto", "resources": '{"GPU": -1}'}, "must be a non-negative number"),
    (3, "ray must be an address"),
])
def test_bad_values_say_what_to_fix(value, message):
    with pytest.raises(JobConfigError, match=message):
        build_config("x.jsonl", {"ray": value})


@pytest.mark.parametrize("options, message", [
    ({"min_workers": 0}, "--ray-min-workers must be >= 1"),
    ({"min_workers": 3, "max_workers": 2}, "--ray-max-workers 2 is below --ray-min-workers 3"),
    ({"timeout_s": 0.0}, "--ray-timeout must be > 0"),
    ({"max_restarts": -1}, "--ray-max-restarts must be >= 0"),
])
def test_the_section_checks_itself_when_built(options, message):
    with pytest.raises(JobConfigError, match=message):
        build_config("x.jsonl", {"ray": {"address": "auto", **options}})
    with pytest.raises(JobConfigError, match=message):
        RayOptions(**options)


def test_the_config_goes_to_the_workers_as_json_and_back():
    from jobrunner.parallel.launcher import config_from_json, config_to_json
    cfg = build_config("x.jsonl", {"ray": {"address": "ray://h:1", "resources": {"TPU": 1}}, "max_tokens": 3})
    assert config_from_json(config_to_json(cfg)) == cfg


def test_a_ray_option_without_ray_exits_2(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": 1, "prompt": "hi"}) + "\n")
    r = CliRunner().invoke(main, ["submit", str(data), "--ray-max-workers", "2"])
    assert r.exit_code == 2 and "--ray-max-workers need --ray [ADDRESS]" in r.output
    r = CliRunner().invoke(main, ["submit", str(data), "--ray", "--ray-min-workers", "0"])
    assert r.exit_code == 2 and "--ray-min-workers must be >= 1" in r.output     # --ray alone: auto


def test_the_queue_hands_each_ticket_out_once():
    q = WorkQueue()
    assert q.next_tickets(0, 1) == [0] and q.next_tickets(0, 2, 3) == [1, 2, 3] and q.next_tickets(0, 1) == [4]
    assert q.next_tickets(1, 2) == [0]      # each round its own counter
    assert q.report(0, 1, {"rows": 5}) is False
    q.done(0, 2)
    assert q.status(0) == {"progress": {1: {"rows": 5}}, "tickets": {1: 2, 2: 3}, "done": [2]}
    q.stop()
    assert q.report(0, 1, {"rows": 6}) is True


def test_the_claim_takes_its_slot_then_tickets_in_plan_order(monkeypatch):
    """Two workers walk the same plan of 10 units: units 0 and 1 by slot, then tickets as each draws them;
    every unit is claimed by exactly one, and a late worker (slot past the members) takes tickets only."""
    ray = pytest.importorskip("ray")
    from jobrunner.parallel.ray_worker import QueueClaim
    monkeypatch.setattr(ray, "get", lambda value: value)
    queue = WorkQueue()

    class Handle:           # queue.next_tickets.remote(...) -> the value (ray.get is the identity here)
        next_tickets = type("M", (), {"remote": staticmethod(queue.next_tickets)})
    a, b = QueueClaim(Handle, 0, 0, slot=0, members=2), QueueClaim(Handle, 0, 1, slot=1, members=2)
    late = QueueClaim(Handle, 0, 5, slot=7, members=2)
    owners = {}
    for index in range(10):         # interleaved as their engines make room
        for name, claim in (("a", a), ("b", b), ("late", late)):
            if claim(index):
                assert index not in owners
                owners[index] = name
    assert sorted(owners) == list(range(10))
    assert owners[0] == "a" and owners[1] == "b" and "late" in owners.values()
    assert a.units + b.units + late.units == 10
