"""Where a row's images come from (jobrunner/images/sources.py, decode.py): data: URLs, http(s) against a
loopback server (success, retries, 404, oversize, timeout), fsspec memory:// and local relative paths,
Hugging Face image structs; decoding, EXIF orientation and --max-image-pixels."""
from __future__ import annotations

import base64
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import fsspec
import numpy as np
import pytest
from PIL import Image

from jobrunner.images import Fetcher, ImageError, ImageLimits, column_images, dataset_base, source_of
from jobrunner.images.decode import decode

FAST = ImageLimits(timeout_s=0.3, backoff_s=0.0, allow_private=True)     # the loopback server: opted in


def png(w=12, h=8, color=(200, 30, 40), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h), color).save(buf, "PNG")
    return buf.getvalue()


def read(value, fetcher=None) -> bytes:
    return (fetcher or Fetcher(FAST)).read(source_of(value))


# --- a loopback HTTP server: each path's answers in turn (the last repeats) ------------------------

class _Server:
    def __init__(self):
        self.routes: dict[str, list] = {}
        self.hits: dict[str, int] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                server.hits[self.path] = server.hits.get(self.path, 0) + 1
                answers = server.routes.get(self.path, [(404, b"")])
                status, body, *rest = answers[min(server.hits[self.path], len(answers)) - 1]
                opts = rest[0] if rest else {}
                if opts.get("sleep"):
                    time.sleep(opts["sleep"])
                self.send_response(status)
                self.send_header("Content-Type", "image/png")
                if not opts.get("no_length"):
                    self.send_header("Content-Length", str(opts.get("length", len(body))))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


@pytest.fixture(scope="module")
def server():
    s = _Server()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


def test_http_success(server):
    server.routes["/ok.png"] = [(200, png())]
    assert read(server.url + "/ok.png") == png()
    assert server.hits["/ok.png"] == 1


def test_http_transient_failures_are_retried(server):
    server.routes["/flaky.png"] = [(503, b""), (502, b""), (200, png())]
    assert read(server.url + "/flaky.png") == png()
    assert server.hits["/flaky.png"] == 3


def test_http_fails_after_its_retries(server):
    server.routes["/down.png"] = [(503, b"")]
    with pytest.raises(ImageError, match=r"HTTP 503 .*\(after 3 tries\)"):
        read(server.url + "/down.png")
    assert server.hits["/down.png"] == 3


def test_http_404_is_not_retried(server):
    with pytest.raises(ImageError, match=r"/missing.png: HTTP 404") as e:
        read(server.url + "/missing.png")
    assert "tries" not in str(e.value)
    assert server.hits["/missing.png"] == 1


def test_http_oversize_stops_reading(server):
    limits = ImageLimits(max_bytes=1000, timeout_s=0.3, backoff_s=0.0, allow_private=True)
    server.routes["/big.png"] = [(200, b"x" * 5000)]                        # said by Content-Length
    server.routes["/big-stream.png"] = [(200, b"x" * 5000, {"no_length": True})]   # found while reading
    for path in ("/big.png", "/big-stream.png"):
        with pytest.raises(ImageError, match="over the 1000 bytes"):
            read(server.url + path, Fetcher(limits))
        assert server.hits[path] == 1


def test_http_timeout_is_retried_then_fails(server):
    server.routes["/slow.png"] = [(200, png(), {"sleep": 1.0})]
    t0 = time.perf_counter()
    with pytest.raises(ImageError, match=r"no answer within 0.3 s \(after 3 tries\)"):
        read(server.url + "/slow.png")
    assert server.hits["/slow.png"] == 3 and time.perf_counter() - t0 < 3


def test_http_backoff_doubles():
    waits = []
    fetcher = Fetcher(ImageLimits(timeout_s=0.2, attempts=3, backoff_s=0.5, allow_private=True), sleep=waits.append)
    with pytest.raises(ImageError):
        fetcher.read(source_of("http://127.0.0.1:9/refused.png"))      # the discard port: refused
    assert waits == [0.5, 1.0]


def test_data_urls():
    data = png()
    assert read("data:image/png;base64," + base64.b64encode(data).decode()) == data
    assert read("data:;base64," + base64.b64encode(data).decode()) == data
    assert read("data:text/plain,a%20b") == b"a b"
    with pytest.raises(ImageError, match="base64"):
        read("data:image/png;base64,@@@=")
    with pytest.raises(ImageError, match="comma"):
        read("data:image/png;base64")


def test_image_structs_bytes_and_values():
    data = png()
    assert read({"bytes": data, "path": "ignored.png"}) == data        # bytes win, as datasets decodes
    assert read(bytearray(data)) == data and read(memoryview(data)) == data
    with pytest.raises(ImageError, match="neither bytes nor a path"):
        source_of({"bytes": None, "path": None})
    with pytest.raises(ImageError, match="not a int"):
        source_of(3)
    assert column_images(None) == () and column_images([]) == ()
    assert column_images(["a", None, "b"]) == ("a", "b") and column_images("a") == ("a",)
    assert column_images(np.array(["a", "b"], dtype=object)) == ("a", "b")
    assert source_of(Image.new("RGB", (2, 2))).kind == "image"


def test_fsspec_memory_and_relative_paths(tmp_path):
    data = png()
    fs = fsspec.filesystem("memory")
    fs.pipe("/imgs-test/ds/pics/a.png", data)
    fs.pipe("/imgs-test/ds/data.jsonl", b"{}\n")
    assert read("memory://imgs-test/ds/pics/a.png", Fetcher(FAST, "memory://imgs-test/ds/data.jsonl")) == data
    # relative to the dataset's folder: its file's, a directory dataset itself, a glob's
    assert read("pics/a.png", Fetcher(FAST, "memory://imgs-test/ds/data.jsonl")) == data
    assert read({"bytes": None, "path": "pics/a.png"}, Fetcher(FAST, "memory://imgs-test/ds")) == data
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.png").write_bytes(data)
    (tmp_path / "x.parquet").write_bytes(b"")
    assert read("sub/b.png", Fetcher(FAST, str(tmp_path / "x.parquet"))) == data
    assert read("sub/b.png", Fetcher(FAST, str(tmp_path / "*.parquet"))) == data
    assert read(str(tmp_path / "sub" / "b.png"), Fetcher(FAST, str(tmp_path / "x.parquet"))) == data   # absolute
    with pytest.raises(ImageError, match="no such file"):
        read("sub/none.png", Fetcher(FAST, str(tmp_path / "x.parquet")))
    with pytest.raises(ImageError, match="over the 10 bytes"):
        read("sub/b.png", Fetcher(ImageLimits(max_bytes=10), str(tmp_path)))


def test_dataset_base(tmp_path):
    (tmp_path / "parts").mkdir()
    assert dataset_base(str(tmp_path / "parts")) == str(tmp_path / "parts")
    assert dataset_base(str(tmp_path / "x.jsonl")) == str(tmp_path)
    assert dataset_base(str(tmp_path / "parts" / "*.parquet")) == str(tmp_path / "parts")
    fsspec.filesystem("memory").pipe("/imgs-base/dir/x.parquet", b"")
    assert dataset_base("memory://imgs-base/dir/x.parquet") == "memory://imgs-base/dir"
    assert dataset_base("memory://imgs-base/dir") == "memory://imgs-base/dir"
    assert dataset_base("x.csv") == "."


def test_decode_checks_and_orientation():
    with pytest.raises(ImageError, match="not an image Pillow can read"):
        decode(b"not an image", 1000)
    with pytest.raises(ImageError, match=r"12x8 is 96 pixels, over --max-image-pixels 50"):
        decode(png(), 50)
    truncated = png(64, 64)[:80]
    with pytest.raises(ImageError, match="does not decode|not an image"):
        decode(truncated, 10**6)
    rgba = decode(png(mode="RGBA", color=(1, 2, 3, 0)), 1000)
    assert rgba.mode == "RGBA"              # the image processor converts (transparency over white)
    # EXIF orientation 6 (rotate 90 CW to view): a 12x8 photo is 8x12 upright, as datasets decodes it
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.new("RGB", (12, 8)).save(buf, "JPEG", exif=exif.tobytes())
    assert decode(buf.getvalue(), 1000).size == (8, 12)
