"""Image sources safe with hostile rows (issue 58, items 7-9): a loopback HTTP server (127.0.0.1 only) records
every request it gets; internal addresses in every form, and redirects to internal hosts or other schemes,
are refused with nothing reached; a private host is fetched only when opted in; a dataset's escaping paths
fail their rows with one message; a server trickling bytes ends at the deadline (the job goes on), and
SIGTERM during such a download exits 130 within seconds."""
from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import fsspec
import pytest
from PIL import Image

import jobrunner
from jobrunner.config.job import job_config
from jobrunner.images import Fetcher, ImageError, ImageLimits, source_of
from jobrunner.images.addresses import REFUSED, HostRule
from jobrunner.images.download import Downloads, Failure, redirect_target
from jobrunner.images.sources import CHAINED, OUTSIDE
from jobrunner.openai.errors import error_object
from jobrunner.output import read_results
from vision_checkpoints import checkpoint

TRICKLE_S = 40          # how long the trickling routes go on (a byte every half second) before they end
PRIVATE = ImageLimits(timeout_s=2.0, backoff_s=0.0, allow_private=True)     # opted in: the loopback server
DEFAULT = ImageLimits(timeout_s=2.0, backoff_s=0.0)


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 200, 30)).save(buf, "PNG")
    return buf.getvalue()


class Recorder:
    """A loopback HTTP server that records each request (path, Host header). Routes: /img.png an image;
    /go?to=URL a 302 to URL; /loop a redirect to itself; /trickle a body, /trickle-head the headers, a byte
    every half second for TRICKLE_S."""

    def __init__(self):
        self.requests: list[tuple[str, str]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                recorder.requests.append((self.path, self.headers.get("Host", "")))
                route = urllib.parse.urlsplit(self.path)
                try:
                    if route.path == "/img.png":
                        self._send(200, {"Content-Type": "image/png"}, png())
                    elif route.path == "/go":
                        self._send(302, {"Location": urllib.parse.parse_qs(route.query)["to"][0]}, b"")
                    elif route.path == "/loop":
                        self._send(302, {"Location": "/loop"}, b"")
                    elif route.path == "/trickle":
                        self._send(200, {"Content-Length": "100000"}, b"")
                        self._trickle(b"x" * 100000)
                    elif route.path == "/trickle-head":
                        self._trickle(b"HTTP/1.1 200 OK\r\nX-Slow: " + b"y" * 100000)
                    else:
                        self._send(404, {}, b"")
                except OSError:
                    pass                # the client went away

            def _send(self, status, headers, body):
                self.send_response(status)
                for k, v in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def _trickle(self, data: bytes):
                end = time.monotonic() + TRICKLE_S
                for byte in data:
                    if time.monotonic() > end:
                        return
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.5)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]


@pytest.fixture
def server():
    s = Recorder()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return str(checkpoint("qwen2_vl", tmp_path_factory.mktemp("qwen2_vl"))[0])


def fetch(value, limits=DEFAULT, dataset=None):
    return Fetcher(limits, dataset).read(source_of(value))


# every way of writing an address the loopback server listens on, or another internal one
INTERNAL_HOSTS = ["127.0.0.1", "localhost", "LocalHost.", "127.1", "2130706433", "0x7f000001", "0x7f.0.0.1",
                  "0177.0.0.1", "017700000001", "[::1]", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "[::127.0.0.1]",
                  "[64:ff9b::7f00:1]", "[2002:7f00:1::]", "0.0.0.0", "[::]", "169.254.169.254", "0xa9fea9fe",
                  "[fd00:ec2::254]", "[::ffff:169.254.169.254]", "10.0.0.1", "172.16.5.4", "192.168.1.1",
                  "100.64.0.1", "[fe80::1]", "[fc00::1]", "[fd12:3456::1]", "224.0.0.1", "255.255.255.255"]
ALWAYS_REFUSED = ["169.254.169.254", "0xa9fea9fe", "[fd00:ec2::254]", "[::ffff:169.254.169.254]", "0.0.0.0",
                  "[::]", "224.0.0.1", "255.255.255.255", "2130706433", "0x7f000001", "127.1", "0177.0.0.1"]


def test_every_internal_address_form_is_refused_and_nothing_is_reached(server):
    for host in INTERNAL_HOSTS:
        for url in (f"http://{host}:{server.port}/img.png", f"https://{host}:{server.port}/img.png"):
            with pytest.raises(ImageError, match="refused") as e:
                fetch(url)
            assert "after" not in str(e.value)              # a refusal is not tried again
    for odd in (f"HTTP://127.0.0.1:{server.port}/img.png", f"http://user:pw@127.0.0.1:{server.port}/img.png"):
        with pytest.raises(ImageError, match="refused"):
            fetch(odd)
    with pytest.raises(ImageError, match="chained URLs"):
        fetch(f"simplecache::http://127.0.0.1:{server.port}/img.png")
    assert server.requests == []
    # opted in: private hosts are fetched; the metadata, unspecified, multicast and odd forms still never
    for host in ALWAYS_REFUSED:
        with pytest.raises(ImageError, match="refused"):
            fetch(f"http://{host}:{server.port}/img.png", PRIVATE)
    assert server.requests == []
    assert fetch(f"{server.url}/img.png", PRIVATE) == png()
    assert fetch(f"http://localhost:{server.port}/img.png", PRIVATE) == png()
    assert server.paths() == ["/img.png", "/img.png"]


def test_one_message_for_every_refused_address():
    """The text does not tell one internal address from another (no map of internal services)."""
    messages = set()
    for host in ("127.0.0.1", "10.0.0.1", "169.254.169.254", "[fd00:ec2::254]", "[::ffff:10.1.2.3]"):
        with pytest.raises(ImageError) as e:
            fetch(f"http://{host}/x.png")
        messages.add(str(e.value).split(": ", 1)[1])
    assert messages == {REFUSED}


def test_image_hosts_allow_list():
    rule = HostRule(hosts=("images.example.com", "*.cdn.example.org"))
    assert rule.target("https://images.example.com/a.png") == ("images.example.com", 443)
    assert rule.target("http://x.y.cdn.example.org:8080/a") == ("x.y.cdn.example.org", 8080)
    for url in ("https://example.com/a.png", "https://evil.com/images.example.com", "https://cdn.example.org/a",
                "https://images.example.com.evil.com/a"):
        with pytest.raises(ImageError, match="not in --image-hosts"):
            rule.target(url)
    with pytest.raises(Exception, match="--image-hosts takes host names"):
        job_config("x.jsonl", image_hosts=("https://images.example.com/",))


def test_resolved_address_is_checked_and_is_the_one_connected_to(server, monkeypatch):
    """A name is resolved once: its address is checked, and the connection goes to that address (a second
    lookup could answer otherwise: DNS rebinding)."""
    real_resolve, real_connect = socket.getaddrinfo, socket.create_connection
    lookups, connects = [], []
    answers = {"internal.test": "127.0.0.1", "rebind.test": "93.184.216.34"}

    def resolve(host, port, *args, **kw):
        if host in answers:
            lookups.append(host)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (answers[host], port))]
        return real_resolve(host, port, *args, **kw)

    def connect(address, *args, **kw):
        connects.append(address)
        if address[0] != "127.0.0.1":
            raise ConnectionRefusedError("no network in tests")
        return real_connect(address, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(socket, "create_connection", connect)
    with pytest.raises(ImageError, match="refused: its host is not a public address"):
        fetch(f"http://internal.test:{server.port}/img.png")
    assert lookups == ["internal.test"] and connects == []
    lookups.clear()
    with pytest.raises(ImageError, match="cannot fetch it"):
        fetch(f"http://rebind.test:{server.port}/img.png", ImageLimits(attempts=1))
    assert lookups == ["rebind.test"] and connects == [("93.184.216.34", server.port)]
    assert fetch(f"http://internal.test:{server.port}/img.png", PRIVATE) == png()
    assert server.requests == [("/img.png", f"internal.test:{server.port}")]      # the name kept as the Host


def test_every_redirect_is_checked(server):
    go = f"{server.url}/go?to="
    within = ImageLimits(timeout_s=2.0, backoff_s=0.0, allow_private=True, hosts=("127.0.0.1",))
    for target in (f"http://localhost:{server.port}/img.png", "http://169.254.169.254/latest/meta-data/",
                   f"http://[::ffff:127.0.0.1]:{server.port}/img.png", f"http://2130706433:{server.port}/img.png",
                   "http://[fd00:ec2::254]/", f"ftp://127.0.0.1:{server.port}/img.png", "file:///etc/passwd",
                   "gopher://127.0.0.1/", "data:image/png;base64,AAAA"):
        server.requests.clear()
        with pytest.raises(ImageError, match="refused"):
            fetch(go + urllib.parse.quote(target, safe=""), within)
        assert server.paths() == [f"/go?to={urllib.parse.quote(target, safe='')}"], target     # nothing past it
    server.requests.clear()
    assert fetch(go + "/img.png", within) == png()          # a relative redirect on the same host: followed
    server.requests.clear()
    with pytest.raises(ImageError, match="more than 5 redirects"):
        fetch(f"{server.url}/loop", within)
    assert server.paths() == ["/loop"] * 6
    with pytest.raises(ImageError, match="only http: to https:"):
        redirect_target("https://a.example/x", "http://a.example/y")
    assert redirect_target("http://a.example/x", "https://b.example/y") == "https://b.example/y"


def test_a_redirect_from_a_public_host_to_a_private_one_is_refused(server):
    """The first hop passes (a rule that takes this one loopback connection for a public host), the redirect
    to the loopback server's secret path is checked like any URL, and refused."""
    class FirstHopPublic(HostRule):
        def __init__(self):
            super().__init__()
            object.__setattr__(self, "hops", [])

        def address(self, host, port):
            self.hops.append(host)
            return "127.0.0.1" if len(self.hops) == 1 else super().address(host, port)

    rule = FirstHopPublic()
    target = urllib.parse.quote(f"http://localhost:{server.port}/secret", safe="")
    with pytest.raises(Failure, match="refused: its host is not a public address"):
        Downloads(rule).get(f"http://public.test:{server.port}/go?to={target}", 2.0)
    assert rule.hops == ["public.test", "localhost"] and server.paths() == [f"/go?to={target}"]


def test_dataset_paths_are_confined_to_its_folder(tmp_path, monkeypatch):
    ds = tmp_path / "ds"
    (ds / "pics").mkdir(parents=True)
    (ds / "pics" / "a.png").write_bytes(png())
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "secret.png").write_bytes(png())
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for dataset in (str(ds / "rows.jsonl"), None):         # `~` is a folder's name, never the home directory
        with pytest.raises(ImageError, match="no such file"):
            fetch("~/secret.png", dataset=dataset)
    (tmp_path / "outside.png").write_bytes(png())
    os.symlink(tmp_path / "outside.png", ds / "pics" / "link.png")
    dataset = str(ds / "rows.jsonl")
    escaping = ["../outside.png", "../missing.png", "pics/../../outside.png", "../../../../../../etc/passwd",
                "/etc/passwd", "/proc/self/environ", "/nonexistent/x.png", str(tmp_path / "outside.png"),
                f"file://{tmp_path}/outside.png", "pics/link.png", "s3://other-bucket/x.png",
                "gs://b/x.png", "memory://x/y.png", "ftp://127.0.0.1/x.png", {"bytes": None, "path": "/etc/hostname"}]
    for value in escaping:
        with pytest.raises(ImageError) as e:
            fetch(value, dataset=dataset)
        assert str(e.value).endswith(": " + OUTSIDE), value             # one message, there or not
    for value in ("simplecache::file:///etc/passwd", f"simplecache::{ds}/pics/a.png", "zip://a.png::s3://b/x.zip"):
        with pytest.raises(ImageError) as e:
            fetch(value, dataset=dataset)
        assert str(e.value).endswith(": " + CHAINED), value
    assert fetch("pics/a.png", dataset=dataset) == png()
    assert fetch(str(ds / "pics" / "a.png"), dataset=dataset) == png()
    with pytest.raises(ImageError, match="no such file"):                # inside: what is there may be said
        fetch("pics/none.png", dataset=dataset)
    wider = ImageLimits(roots=(str(tmp_path),))                          # --image-root widens it
    assert fetch("../outside.png", wider, dataset) == fetch("pics/link.png", wider, dataset) == png()
    with pytest.raises(ImageError, match=OUTSIDE):
        fetch("/etc/passwd", wider, dataset)


def test_store_paths_are_confined_to_the_bucket_and_prefix():
    fs = fsspec.filesystem("memory")
    for path in ("/bucket-a/prefix/x.png", "/bucket-a/other/x.png", "/bucket-b/prefix/x.png"):
        fs.pipe(path, png())
    dataset = "memory://bucket-a/prefix/rows.parquet"
    assert fetch("x.png", dataset=dataset) == fetch("memory://bucket-a/prefix/x.png", dataset=dataset) == png()
    for value in ("memory://bucket-a/other/x.png", "memory://bucket-b/prefix/x.png", "../other/x.png",
                  "memory://bucket-a/prefix/../other/x.png", "memory://bucket-a/prefixed/x.png", "/etc/passwd",
                  "file:///etc/passwd"):
        with pytest.raises(ImageError, match=OUTSIDE):
            fetch(value, dataset=dataset)
    assert fetch("memory://bucket-b/prefix/x.png", ImageLimits(roots=("memory://bucket-b",)), dataset) == png()


def test_a_trickling_server_ends_at_the_deadline(server):
    once = ImageLimits(timeout_s=1.0, attempts=1, allow_private=True)
    for path in ("/trickle", "/trickle-head"):
        t0 = time.monotonic()
        with pytest.raises(ImageError, match=r"no answer within 1 s"):
            fetch(server.url + path, once)
        assert time.monotonic() - t0 < TRICKLE_S / 4, path     # the deadline, not the trickle's 40 s


def test_image_errors_of_openai_lines_name_their_field():
    message = "image: http://10.0.0.1/x.png: " + REFUSED
    assert error_object(message, 3)["param"] == "messages"
    assert error_object("image 2 of 3: x: HTTP 404 Not Found", 3, "/v1/responses")["param"] == "input"
    refused_url = error_object("message content part image_url: its url must be an http(s):// or data: URL", 3)
    assert error_object(message, 3)["code"] == refused_url["code"] == "invalid_request"


def _rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_job_refuses_hostile_images_row_by_row_and_goes_on(qwen, server, tmp_path):
    ds = tmp_path / "ds"
    (ds / "pics").mkdir(parents=True)
    (ds / "pics" / "a.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png())
    hostile = ["../secret.png", "../../../../etc/passwd", "/proc/self/environ", str(tmp_path / "secret.png"),
               "s3://other-bucket/key.png", "memory://elsewhere/x.png"]
    internal = [f"{server.url}/img.png", f"http://2130706433:{server.port}/img.png",
                "http://169.254.169.254/latest/meta-data/iam/", f"{server.url}/go?to=file%3A%2F%2F%2Fetc%2Fpasswd"]
    rows = [{"id": "good", "prompt": "what?", "image": "pics/a.png"}] + \
        [{"id": f"path{i}", "prompt": "what?", "image": v} for i, v in enumerate(hostile)] + \
        [{"id": f"url{i}", "prompt": "what?", "image": v} for i, v in enumerate(internal)]
    dataset = _rows(ds / "rows.jsonl", rows)
    result = jobrunner.submit(dataset, str(tmp_path / "out"), model=qwen, image_column="image", max_tokens=2)
    assert result.exit_code == 0
    out = {r["id"]: r for r in read_results(str(tmp_path / "out")).to_pylist()}
    assert out["good"]["error"] is None and len(out) == len(rows)
    assert {out[f"path{i}"]["error"].split(": ", 2)[-1] for i in range(len(hostile))} == {OUTSIDE}
    assert all("refused" in out[f"url{i}"]["error"] for i in range(len(internal)))
    assert server.requests == []
    # validate: the same rule, and nothing fetched
    from jobrunner.cli.validate import validate_job
    report = validate_job(job_config(dataset, model=qwen, image_column="image", output=str(tmp_path / "v")))
    assert report["rows_with_errors"] == len(hostile) + len(internal) and server.requests == []
    # --image-root and --image-allow-private open what they name
    opened = jobrunner.submit(dataset, str(tmp_path / "out2"), model=qwen, image_column="image", max_tokens=2,
                              image_root=(str(tmp_path),), image_allow_private=True)
    out = {r["id"]: r for r in read_results(str(tmp_path / "out2")).to_pylist()}
    assert out["path0"]["error"] is None and out["path3"]["error"] is None and out["url0"]["error"] is None
    assert out["path1"]["error"].endswith(OUTSIDE) and "refused" in out["url2"]["error"]
    assert opened.exit_code == 0 and server.paths().count("/img.png") == 1


def test_a_trickling_image_costs_its_row_not_the_job(qwen, server, tmp_path):
    rows = [{"id": "slow", "prompt": "what?", "image": f"{server.url}/trickle"},
            {"id": "slow-head", "prompt": "what?", "image": f"{server.url}/trickle-head"},
            {"id": "text", "prompt": "what?"}]
    dataset = _rows(tmp_path / "rows.jsonl", rows)
    t0 = time.monotonic()
    result = jobrunner.submit(dataset, str(tmp_path / "out"), model=qwen, image_column="image", max_tokens=2,
                              image_timeout=1.0, image_allow_private=True)
    elapsed = time.monotonic() - t0
    assert result.exit_code == 0 and elapsed < TRICKLE_S, elapsed     # two images: 3 tries of 1 s each, and backoff (before: 40 s each)
    out = {r["id"]: r for r in read_results(str(tmp_path / "out")).to_pylist()}
    assert "no answer within 1 s (after 3 tries)" in out["slow"]["error"]
    assert "no answer within 1 s" in out["slow-head"]["error"] and out["text"]["error"] is None


def test_sigterm_during_a_slow_download_exits_130_within_seconds(qwen, server, tmp_path):
    dataset = _rows(tmp_path / "rows.jsonl", [{"id": "slow", "prompt": "what?", "image": f"{server.url}/trickle"}])
    cmd = [sys.executable, "-m", "jobrunner.cli.main", "submit", dataset, "-o", str(tmp_path / "out"), "-m", qwen,
           "--image-column", "image", "--image-timeout", "120", "--image-allow-private", "--max-tokens", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not server.requests and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert server.requests, proc.stderr.read() if proc.poll() is not None else "no request"
        time.sleep(1.0)                                 # the download is under way, a byte at a time
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=TRICKLE_S * 4)   # a hang guard; the timing is checked below
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert took < TRICKLE_S / 4, took       # before: the process waited out the trickle (40 s), then exited 3
