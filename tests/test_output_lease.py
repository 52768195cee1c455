"""One writer at a time on an output (jobrunner/output/lease.py): two real `jobrunner submit` processes on
one output, a killed holder's rerun, a stale lease taken over, SIGTERM during start-up, and a damaged
manifest repaired from the parts."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobrunner.cli.main import main
from jobrunner.output import read_results
from jobrunner.output.lease import OutputBusyError, OutputLease
from tests.cache_helpers import prompts, tiny_model, write_jsonl

ROOT = Path(__file__).resolve().parents[1]


def _record(path: Path) -> dict:
    return json.loads((path / "_lease.json").read_text())


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_a_held_lease_refuses_a_second_holder_until_released(tmp_path, kind):
    url = str(tmp_path / "out") if kind == "local" else f"memory://lease-{os.getpid()}/out"
    first = OutputLease(url).acquire()
    with pytest.raises(OutputBusyError, match=rf"being written by another job \(pid {os.getpid()} on "):
        OutputLease(url).acquire()
    first.release()
    with OutputLease(url) as again:
        assert again.held
    assert not OutputLease(url).fs.exists(OutputLease(url).path)


def test_the_holder_renews_its_heartbeat_and_an_empty_directory_it_made_goes_with_it(tmp_path):
    out = tmp_path / "out"
    lease = OutputLease(str(out), stale_s=0.3).acquire()
    beat = _record(out)["heartbeat"]
    time.sleep(0.25)
    assert _record(out)["heartbeat"] > beat
    lease.release()
    assert not out.exists()         # the job wrote nothing: no empty directory left behind


def test_a_stale_or_torn_lease_is_taken_over_with_a_warning(tmp_path, caplog):
    out = tmp_path / "out"
    out.mkdir()
    (out / "_lease.json").write_text(json.dumps({"format": "jobrunner-lease", "holder": "x", "host": "elsewhere",
                                                 "pid": 1, "since": "yesterday", "heartbeat": time.time() - 600}))
    with OutputLease(str(out), stale_s=60):
        assert _record(out)["pid"] == os.getpid()
    assert "taking over the lease of a job that stopped without releasing it (pid 1 on elsewhere" in caplog.text
    (out / "_lease.json").write_text('{"format": "jobrunn')          # killed while writing it
    with OutputLease(str(out), stale_s=60):
        assert _record(out)["pid"] == os.getpid()
    # a live holder on another host, heartbeat fresh: busy
    (out / "_lease.json").write_text(json.dumps({"format": "jobrunner-lease", "holder": "y", "host": "elsewhere",
                                                 "pid": 1, "since": "now", "heartbeat": time.time()}))
    with pytest.raises(OutputBusyError, match="pid 1 on elsewhere"):
        OutputLease(str(out), stale_s=60).acquire()


def test_a_dead_process_on_this_host_gives_its_lease_up_at_once(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom jobrunner.output.lease import "
                               "OutputLease\nOutputLease(sys.argv[1]).acquire()\nprint('held', flush=True)\n"
                               "time.sleep(600)", str(out)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(OutputBusyError):
        OutputLease(str(out)).acquire()
    holder.kill()
    holder.wait()
    with OutputLease(str(out)):         # stale_s is 120 s: the pid check, not the clock, freed it
        assert _record(out)["pid"] == os.getpid()


# -- real jobs ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """(model, dataset of 300 rows, the command line of a job over it that takes a few seconds)."""
    root = tmp_path_factory.mktemp("lease-job")
    model = tiny_model(root)
    ds = write_jsonl(root / "p.jsonl", [{"id": f"p{i:03d}", "prompt": p} for i, p in enumerate(prompts(300))])

    def cmd(out):
        return [sys.executable, "-m", "jobrunner.cli.main", "submit", ds, "-m", model, "-o", str(out), "--device", "cpu",
                "--max-tokens", "16", "--ignore-eos", "--max-num-seqs", "2", "--flush-seconds", "0.2",
                "--threads", "1"]
    return model, ds, cmd


def _wait_for(path: Path, proc, timeout=120.0) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.02)


def _ids(out) -> list[str]:
    return sorted(read_results(str(out)).column("id").to_pylist())


def test_two_jobs_on_one_output_the_second_exits_2_naming_the_first(tmp_path, job):
    _, _, cmd = job
    out = tmp_path / "both"
    first = subprocess.Popen(cmd(out), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for(out / "_lease.json", first)
    second = subprocess.run(cmd(out), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert second.returncode == 2, second.stderr
    assert f"is being written by another job (pid {first.pid} on " in second.stderr
    assert " loaded in " not in second.stderr     # refused at once: no model loaded, no row read
    assert first.poll() is None             # the refusal came while the first job ran
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert _ids(out) == [f"p{i:03d}" for i in range(300)]      # every row once
    assert not (out / "_lease.json").exists()                   # released at the end


def test_a_killed_holder_never_blocks_its_rerun(tmp_path, job):
    _, _, cmd = job
    out = tmp_path / "killed"
    first = subprocess.Popen(cmd(out), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(out / "_lease.json", first)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert (out / "_lease.json").exists()
    rerun = subprocess.run(cmd(out), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert "taking over the lease of a job that stopped without releasing it" in rerun.stderr
    assert _ids(out) == [f"p{i:03d}" for i in range(300)]


def test_sigterm_during_start_up_exits_130_with_its_line(tmp_path, job):
    _, _, cmd = job
    p = subprocess.Popen(cmd(tmp_path / "term"), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    _wait_for(tmp_path / "term" / "_lease.json", p)     # the command has started: before any model loads
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert "interrupted; the parts already written are kept" in err
    assert not (tmp_path / "term" / "_lease.json").exists()


def test_a_signal_caught_inside_an_import_still_exits_with_its_code(tmp_path):
    """What the handlers raise (SignalInterrupt) passes out of an exec'd string, as when SIGTERM lands while a
    dataclass is built during an import, and the command (run with -m, as jobrunner's is) still exits 130:
    a bare KeyboardInterrupt there makes CPython 3.11 end the process by SIGINT (-2) whatever it exits with."""
    body = ("import sys\n"
            "from jobrunner.common.signal_interrupt import SignalInterrupt\n"
            "try:\n"
            "    exec('raise {}')\n"
            "except KeyboardInterrupt:\n"
            "    sys.exit(130)\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    for name in ("SignalInterrupt", "KeyboardInterrupt"):
        (tmp_path / f"exits_{name}.py").write_text(body.format(name))
    ours = subprocess.run([sys.executable, "-m", "exits_SignalInterrupt"], cwd=tmp_path, env=env)
    assert ours.returncode == 130
    if sys.version_info < (3, 12):      # the interpreter's own behaviour, which the subclass avoids
        bare = subprocess.run([sys.executable, "-m", "exits_KeyboardInterrupt"], cwd=tmp_path, env=env)
        assert bare.returncode == -signal.SIGINT


def test_a_damaged_manifest_is_rebuilt_by_repair_and_the_job_resumes(tmp_path, job):
    model, ds, _ = job
    out = tmp_path / "out"
    args = [ds, "-o", str(out), "-m", model, "--device", "cpu", "--max-tokens", "4", "--ignore-eos", "--limit", "40"]
    first = CliRunner().invoke(main, ["submit", *args])
    assert first.exit_code == 0, first.output
    before = read_results(str(out)).to_pylist()
    (out / "_manifest.json").write_text('{"format": "jobrunner-out')       # a full disk cut it short
    refused = CliRunner().invoke(main, ["submit", *args])
    assert refused.exit_code == 2
    assert "_manifest.json is damaged" in refused.output and "`jobrunner repair`" in refused.output
    wrong = CliRunner().invoke(main, ["repair", ds, "-o", str(tmp_path / "nothing-here"), "-m", model])
    assert wrong.exit_code == 2 and "not found; nothing to repair" in wrong.output
    repaired = CliRunner().invoke(main, ["repair", *args])
    assert repaired.exit_code == 0, repaired.output
    assert "rebuilt" in repaired.output
    again = CliRunner().invoke(main, ["repair", *args])
    assert again.exit_code == 2 and "intact and matches this job" in again.output
    resumed = CliRunner().invoke(main, ["submit", *args])
    assert resumed.exit_code == 0, resumed.output
    assert sorted(map(str, read_results(str(out)).to_pylist()), key=str) == sorted(map(str, before), key=str)
    other = CliRunner().invoke(main, ["submit", *args[:-2], "--limit", "41", "--max-tokens", "5"])
    assert other.exit_code == 2 and "holds a different job" in other.output   # the rebuilt fingerprint is this job's
