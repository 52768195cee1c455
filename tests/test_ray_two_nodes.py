"""`--ray` over two Ray nodes on this machine, each node in a network namespace of its own joined by a veth
pair (10.231.x.1 and .2), the driver in the head's. Ray listens on the namespaces' addresses only: nothing
of it is on the machine's own interfaces (checked), and it connects nowhere else. Making namespaces needs
root (CAP_NET_ADMIN) and iproute2: without them the test skips, saying why.
"""
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from jobrunner.config.job import job_config  # noqa: E402
from jobrunner.pipeline.exit_codes import EXIT_OK  # noqa: E402
from jobrunner.pipeline.build import open_job  # noqa: E402
from jobrunner.output import read_stats  # noqa: E402
from tests.test_ray import OPTIONS, ROOT, TINY, Driver, _outputs, _session_pids  # noqa: E402

NET = f"10.231.{os.getpid() % 250}"
ENV = dict(os.environ, PYTHONPATH=ROOT, RAY_DISABLE_USAGE_STATS="1", RAY_AUTH_MODE="disabled")
ENV.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)     # two nodes: each on its namespace's address


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def namespaces():
    a, b = f"jr{os.getpid()}a", f"jr{os.getpid()}b"
    if os.geteuid() != 0:
        pytest.skip("two Ray nodes need two network namespaces, and making them needs root (CAP_NET_ADMIN)")
    try:
        _ip("netns", "add", a)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot make a network namespace here ({getattr(e, 'stderr', '') or e}); two nodes need one each")
    try:
        _ip("netns", "add", b)
        _ip("link", "add", "jrv0", "netns", a, "type", "veth", "peer", "name", "jrv1", "netns", b)
        for ns, dev, host in ((a, "jrv0", 1), (b, "jrv1", 2)):
            _ip("-n", ns, "addr", "add", f"{NET}.{host}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _start(ns: str, args: list[str], ready: str) -> subprocess.Popen:
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    p = subprocess.Popen(["ip", "netns", "exec", ns, ray_bin, "start", "--block", "--num-cpus", "1",
                          "--disable-usage-stats", "--object-store-memory", str(100 * 2**20), *args],
                         env=ENV, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started, lines = time.time(), []
    for line in p.stdout:
        lines.append(line)
        if ready in line:
            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
            return p
        assert time.time() - started < 180, "ray start took over 3 minutes:\n" + "".join(lines[-20:])
    pytest.fail(f"ray start in {ns} failed (exit {p.wait()}):\n" + "".join(lines[-30:]))


@pytest.fixture(scope="module")
def two_nodes(namespaces):
    a, b = namespaces
    head = _start(a, ["--head", "--port", "6380", "--node-ip-address", f"{NET}.1", "--include-dashboard", "false",
                      "--temp-dir", f"/tmp/jr-ray2n-{os.getpid()}"], "Ray runtime started")
    procs = [head]
    try:
        procs.append(_start(b, ["--address", f"{NET}.1:6380", "--node-ip-address", f"{NET}.2"], "Ray runtime started"))
        yield {"address": f"{NET}.1:6380", "ns": a, "sids": [p.pid for p in procs]}
    finally:
        for p in procs:
            for pid in [p.pid] + _session_pids(p.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()


def test_two_nodes_each_run_a_worker_and_the_rows_are_a_local_runs(two_nodes, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY))
    rnd = random.Random(2)
    rows = [{"id": f"n{i}", "prompt": "".join(rnd.choice("abcdefghij ") for _ in range(10 + i % 13))} for i in range(80)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = f"dummy:{tmp_path / 'model'}"
    cfg = job_config(str(path), model=model, max_tokens=8, max_num_seqs=2, part_rows=4, device="cpu",
                     output=str(tmp_path / "local"))
    job = open_job(cfg)
    try:
        assert job.run().exit_code == EXIT_OK
    finally:
        job.engine.close()
    out = tmp_path / "two-nodes"
    d = Driver(["ip", "netns", "exec", two_nodes["ns"], sys.executable, "-m", "jobrunner.cli.main", "submit", str(path),
                "-m", model, "-o", str(out), *OPTIONS, "--ray", two_nodes["address"], "--data-parallel", "2",
                "--ray-min-workers", "2", "--ray-timeout", "180"], env=ENV)
    assert d.wait(300) == 0, d.log[-4000:]
    assert _outputs(str(out)) == _outputs(cfg.output_url)
    nodes = set(re.findall(r"ray: worker \d loaded on \S+ \(node (\w+), pid", d.log))
    assert len(nodes) == 2, d.log[-3000:]       # one CPU a node: a worker on each
    s = read_stats(str(out))
    assert set(s["workers"]) == {"rank0", "rank1"} and all(w["rows"] > 0 for w in s["workers"].values())
    # nothing of Ray's listens in this machine's own network namespace (the nodes' are their own)
    ours = {pid for sid in two_nodes["sids"] for pid in _session_pids(sid)}
    listing = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    assert not [line for line in listing.splitlines() if {int(p) for p in re.findall(r"pid=(\d+)", line)} & ours]
