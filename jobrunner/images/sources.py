"""Where a row's images come from, and their bytes: an image value as a dataset or a message gives it,
turned into one `Source`, and `Fetcher.read(source)` -> the encoded image's bytes (or an image object).

    value                                   source
    {"bytes": b"...", "path": "x.png"}      Hugging Face datasets' Image struct: its bytes, else its path
    b"..." (bytes, bytearray, memoryview)   the encoded file itself
    "data:image/png;base64,..."             a data: URL (base64, or percent-encoded)
    "http://..." / "https://..."            fetched with a timeout, a size limit and retries (urllib)
    "s3://...", "memory://...", "file://..." any fsspec URL
    "images/x.png", "/abs/x.png"            a path; a relative one is relative to the dataset's location
    a PIL image                             as it is (jobrunner.generate over rows holding them)

A row's --image-column holds one of these, or a list of them (several images a row), or null (none).
Every failure is an ImageError whose message says which image and why: the row's error, the job goes on.
"""
from __future__ import annotations

import base64
import binascii
import posixpath
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from jobrunner import storage

DEFAULT_MAX_PIXELS = 50_000_000       # --max-image-pixels: decompression bombs stop here (PIL warns at 89M)
DEFAULT_MAX_BYTES = 64 << 20          # an encoded image's bytes at most (a fetch stops reading past it)
DEFAULT_TIMEOUT_S = 30.0              # one fetch's connect and read timeout
FETCH_ATTEMPTS = 3                    # a URL's tries: a timeout, a connection error, 408, 429 and 5xx are retried
RETRY_BACKOFF_S = 0.5                 # before the second try; doubled before each later one
_RETRIED_STATUS = {408, 425, 429, 500, 502, 503, 504}


class ImageError(ValueError):
    """This image cannot be had (fetched, read, decoded, or it is too large): its row's error."""


@dataclass(frozen=True)
class ImageLimits:
    """How far a job goes for one image (the input section's --max-image-pixels, --max-image-bytes and
    --image-timeout); attempts and backoff_s: a URL's retries."""
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    attempts: int = FETCH_ATTEMPTS
    backoff_s: float = RETRY_BACKOFF_S


@dataclass(frozen=True)
class Source:
    """One image's origin: kind "bytes" (data: the encoded bytes), "url" (an http(s) URL), "fsspec" (any
    other URL or a path, relative ones to the dataset's location) or "image" (a PIL image)."""
    kind: str
    data: Any

    def describe(self) -> str:
        """A short name for messages (never the bytes)."""
        if self.kind == "bytes":
            return f"image of {len(self.data)} bytes"
        if self.kind == "image":
            return "image object"
        text = str(self.data)
        if text.startswith("data:"):
            return "data: URL image"
        return text if len(text) <= 120 else text[:117] + "..."


def column_images(value: Any) -> tuple:
    """An --image-column value as the row's image values, in order: a list (or tuple, or array) of them, one
    value, or none (null, an empty list)."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(v for v in value if v is not None)
    if hasattr(value, "tolist") and not isinstance(value, (bytes, bytearray, memoryview)) and getattr(value, "ndim", 0):
        return tuple(v for v in value.tolist() if v is not None)       # a numpy array of values (pandas)
    return (value,)


def source_of(value: Any) -> Source:
    """The Source of one image value (see the module's table); ImageError for a value that names none."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return Source("bytes", bytes(value))
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        if data is not None:
            return source_of(data) if isinstance(data, (bytes, bytearray, memoryview)) else _bad(value)
        if isinstance(path, str) and path:
            return source_of(path)
        raise ImageError("image struct has neither bytes nor a path")
    if isinstance(value, str):
        text = value.strip()
        if not text:
            raise ImageError("image is an empty string (a path or URL was expected)")
        if text.startswith("data:"):
            return Source("bytes", data_url_bytes(text))
        if text.startswith(("http://", "https://")):
            return Source("url", text)
        return Source("fsspec", text)
    if type(value).__module__.startswith("PIL.") and hasattr(value, "convert"):
        return Source("image", value)
    return _bad(value)


def _bad(value: Any):
    raise ImageError(f"an image must be bytes, a path or URL, or an image struct {{bytes, path}}, not a "
                     f"{type(value).__name__}")


def data_url_bytes(url: str) -> bytes:
    """A data: URL's bytes (RFC 2397: base64 when `;base64` is given, else percent-encoded)."""
    head, comma, payload = url.partition(",")
    if not comma:
        raise ImageError("data: URL without a comma before its data")
    if head.endswith(";base64"):
        text = "".join(urllib.parse.unquote(payload).split())
        text += "=" * (-len(text) % 4)          # padding left out
        try:
            return base64.b64decode(text, altchars=b"-_" if "-" in text or "_" in text else None, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"data: URL holds no valid base64 ({e})") from None
    return urllib.parse.unquote_to_bytes(payload)


class Fetcher:
    """An image's bytes from its Source, within `limits`. dataset: the dataset's URL, the base of relative
    paths: the dataset itself if it is a directory, the folder its glob or file is in otherwise (found on
    the first relative path: a job without one does no IO for it)."""

    def __init__(self, limits: ImageLimits = ImageLimits(), dataset: str | None = None, sleep=time.sleep):
        self.limits, self.dataset, self.sleep = limits, dataset, sleep
        self._base: str | None = None

    def read(self, source: Source):
        """The encoded bytes (or, kind "image", the image object itself); ImageError when they cannot be had."""
        if source.kind == "image":
            return source.data
        if source.kind == "bytes":
            data = source.data
        elif source.kind == "url":
            data = self._retried(source, self._http)
        else:
            data = self._retried(source, self._fsspec)
        if len(data) > self.limits.max_bytes:
            raise ImageError(f"{source.describe()}: over the {self.limits.max_bytes} bytes an image may have "
                             f"({len(data)} bytes)")
        return data

    def _retried(self, source: Source, fetch) -> bytes:
        """fetch(source) -> (bytes, None) or (None, (why, retry)); tried up to limits.attempts times."""
        wait = self.limits.backoff_s
        for attempt in range(1, self.limits.attempts + 1):
            data, failure = fetch(source)
            if failure is None:
                return data
            why, retry = failure
            if not retry or attempt == self.limits.attempts:
                tries = f" (after {attempt} tries)" if attempt > 1 else ""
                raise ImageError(f"{source.describe()}: {why}{tries}")
            self.sleep(wait)
            wait *= 2
        raise AssertionError("unreachable")

    def _http(self, source: Source):
        limit = self.limits.max_bytes
        request = urllib.request.Request(source.data, headers={"User-Agent": "jobrunner", "Accept": "image/*"})
        try:
            with urllib.request.urlopen(request, timeout=self.limits.timeout_s) as response:
                size = response.headers.get("Content-Length")
                if size is not None and size.isdigit() and int(size) > limit:
                    return None, (f"over the {limit} bytes an image may have ({size} bytes)", False)
                data = response.read(limit + 1)
        except urllib.error.HTTPError as e:
            return None, (f"HTTP {e.code} {e.reason}", e.code in _RETRIED_STATUS)
        except (TimeoutError, OSError, urllib.error.URLError) as e:      # a timeout, a refused connection, DNS
            reason = getattr(e, "reason", None) or e
            timed_out = isinstance(reason, TimeoutError) or "timed out" in str(reason)
            why = f"no answer within {self.limits.timeout_s:g} s" if timed_out else f"cannot fetch it ({reason})"
            return None, (why, True)
        if len(data) > limit:
            return None, (f"over the {limit} bytes an image may have", False)
        return data, None

    def _fsspec(self, source: Source):
        url = self._located(source.data)
        limit = self.limits.max_bytes
        try:
            fs, path = storage.url_fs(url)
        except ImportError as e:
            return None, (storage.missing_backend_message(url, e), False)
        except ValueError as e:
            return None, (f"cannot open it ({e})", False)
        try:
            with fs.open(path, "rb") as f:
                data = f.read(limit + 1)
        except FileNotFoundError:
            return None, ("no such file" + (f" ({url})" if url != source.data else ""), False)
        except (IsADirectoryError, PermissionError) as e:
            return None, (f"cannot read it ({type(e).__name__})", False)
        except OSError as e:        # an object store's or network file system's failure: tried again
            return None, (f"cannot read it ({e})", "://" in url and not url.startswith(("file://", "memory://")))
        if len(data) > limit:
            return None, (f"over the {limit} bytes an image may have", False)
        return data, None

    def _located(self, path: str) -> str:
        """A path or URL as fsspec opens it: relative paths joined to the dataset's location."""
        if "://" in path or path.startswith("/") or self.dataset is None:
            return path
        return posixpath.join(self.base(), path)

    def base(self) -> str:
        if self._base is None:
            self._base = dataset_base(self.dataset)
        return self._base


def dataset_base(dataset: str) -> str:
    """The folder a dataset's relative image paths start from: the dataset if it is a directory, else the
    folder of its file (or of its glob's first wildcard). Keeps the URL's protocol."""
    url = dataset.rstrip("/")
    wild = [url.index(ch) for ch in "*?[" if ch in url]
    if wild:
        return _folder(url[:min(wild)])
    try:
        fs, path = storage.url_fs(url)
        if fs.isdir(path):
            return url
    except Exception:  # noqa: BLE001 - no answer (credentials, a backend): a file's folder, then
        pass
    return _folder(url)


def _folder(url: str) -> str:
    protocol, sep, path = url.partition("://")
    if not sep:
        return posixpath.dirname(url) or "."
    return f"{protocol}://{posixpath.dirname(path)}"
