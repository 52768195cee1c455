"""Where a row's images come from, and their bytes: an image value as a dataset or a message gives it,
turned into one `Source`, and `Fetcher.read(source)` -> the encoded image's bytes (or an image object).

    value                                   source
    {"bytes": b"...", "path": "x.png"}      Hugging Face datasets' Image struct: its bytes, else its path
    b"..." (bytes, bytearray, memoryview)   the encoded file itself
    "data:image/png;base64,..."             a data: URL (base64, or percent-encoded)
    "http://..." / "https://..."            downloaded under the host rule (download.py, addresses.py): public
                                            hosts only unless allowed; a deadline, a size limit and retries
    "s3://...", "memory://...", "file://..." an fsspec URL of the dataset's store, under its folder
    "images/x.png", "/abs/x.png"            a path; a relative one is relative to the dataset's location
    a PIL image                             as it is (jobrunner.generate over rows holding them)

A row's --image-column holds one of these, or a list of them (several images a row), or null (none).
Every failure is an ImageError whose message says which image and why: the row's error, the job goes on.

Paths and storage URLs are read only under the dataset's folder (its store, bucket and prefix) or an
--image-root: `../../etc/passwd`, `/proc/self/environ`, another bucket's object or a link out of the folder
is refused with one message, whether or not anything is there; chained URLs (`simplecache::...`) never.
"""
from __future__ import annotations

import base64
import binascii
import os
import posixpath
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any

import fsspec.core

from jobrunner.common import storage
from jobrunner.images.addresses import HostRule
from jobrunner.images.download import Downloads, Failure
from jobrunner.images.image_error import ImageError

DEFAULT_MAX_PIXELS = 50_000_000       # --max-image-pixels: decompression bombs stop here (PIL warns at 89M)
DEFAULT_MAX_BYTES = 64 << 20          # an encoded image's bytes at most (a fetch stops reading past it)
DEFAULT_TIMEOUT_S = 30.0              # one download's deadline, all of it (connect, redirects, body)
FETCH_ATTEMPTS = 3                    # a URL's tries: a timeout, a connection error, 408, 429 and 5xx are retried
RETRY_BACKOFF_S = 0.5                 # before the second try; doubled before each later one
# a path or storage URL outside the places images may be read from: one message, whatever is there
OUTSIDE = "not read: outside the dataset's folder and every --image-root"
CHAINED = "not read: chained URLs (simplecache::, zip::, ...) are never read for images"
_PROTOCOLS = {"local": "file", "s3a": "s3", "gcs": "gs", "az": "abfs"}     # one store's other names


@dataclass(frozen=True)
class ImageLimits:
    """How far a job goes for one image (the input section's --max-image-pixels, --max-image-bytes,
    --image-timeout, --image-hosts, --image-allow-private and --image-root); attempts and backoff_s: a
    URL's retries."""
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_bytes: int = DEFAULT_MAX_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    attempts: int = FETCH_ATTEMPTS
    backoff_s: float = RETRY_BACKOFF_S
    hosts: tuple[str, ...] = ()             # http(s) hosts allowed (patterns); empty: any public host
    allow_private: bool = False             # private hosts too (loopback, 10/8, ...; never metadata)
    roots: tuple[str, ...] = ()             # folders or store prefixes paths may be read from, past the dataset's


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
        if text[:8].lower().startswith(("http://", "https://")):
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
    paths and the folder paths are confined to: the dataset itself if it is a directory, the folder its
    glob or file is in otherwise (found on the first path: a job without one does no IO for it); None:
    the current directory. cancel(): the job stops, every download under way ends (any thread)."""

    def __init__(self, limits: ImageLimits = ImageLimits(), dataset: str | None = None, sleep=None):
        self.limits, self.dataset = limits, dataset
        self._stop = threading.Event()
        self.sleep = sleep or self._stop.wait          # a retry's backoff; cancel() ends it
        self.downloads = Downloads(HostRule(limits.hosts, limits.allow_private), limits.max_bytes)
        self._base: str | None = None
        self._places: list[tuple[str, str]] | None = None

    def cancel(self) -> None:
        self._stop.set()
        self.downloads.cancel()

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
            if not retry or attempt == self.limits.attempts or self._stop.is_set():
                tries = f" (after {attempt} tries)" if attempt > 1 else ""
                raise ImageError(f"{source.describe()}: {why}{tries}")
            self.sleep(wait)
            wait *= 2
        raise AssertionError("unreachable")

    def _http(self, source: Source, url: str | None = None):
        try:
            return self.downloads.get(url or source.data, self.limits.timeout_s), None
        except Failure as f:
            return None, (f.why, f.retry)

    def _fsspec(self, source: Source):
        try:
            url = self._confined(source.data)
        except ImageError as e:
            return None, (str(e), False)
        if url[:8].lower().startswith(("http://", "https://")):       # a dataset on a web server: its rule too
            return self._http(source, url)
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

    def _confined(self, value: str) -> str:
        """value as fsspec opens it (a relative path joined to the dataset's folder) if it lies under the
        dataset's folder or an --image-root; ImageError otherwise, before any IO on it."""
        if "::" in value:
            raise ImageError(CHAINED)
        url = self._located(value)
        protocol, path = _place(url)
        if not any(protocol == p and (path == root or path.startswith(root.rstrip("/") + "/"))
                   for p, root in self.places()):
            raise ImageError(OUTSIDE)
        return url

    def places(self) -> list[tuple[str, str]]:
        """(protocol, path) of the dataset's folder and of each --image-root."""
        if self._places is None:
            self._places = [_place(root) for root in (self.base(), *self.limits.roots)]
        return self._places

    def _located(self, path: str) -> str:
        """A path or URL as fsspec opens it: relative paths joined to the dataset's location."""
        if "://" in path or path.startswith("/"):
            return path
        return posixpath.join(self.base(), path)          # never bare: fsspec would expand a leading ~

    def base(self) -> str:
        if self._base is None:
            self._base = dataset_base(self.dataset) if self.dataset is not None else "."
        return self._base


def _place(url: str) -> tuple[str, str]:
    """(store, path) of a URL or path, as confinement compares them: a local path absolute with its links
    resolved (a link out of the folder is outside), a store's path with its `..` taken out."""
    protocol, path = fsspec.core.split_protocol(url)
    protocol = (protocol or "file").lower()
    protocol = _PROTOCOLS.get(protocol, protocol)
    if protocol == "file":
        return protocol, os.path.realpath(path)
    return protocol, posixpath.normpath("/" + path.lstrip("/"))


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
