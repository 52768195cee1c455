"""One http(s) image download (issue 58): every hop's host checked by the host rule (addresses.py) and the
connection made to the very address that passed (no second lookup: no DNS-rebinding gap); redirects
followed by hand, at most `max_redirects`, each checked as the first URL, never to another scheme but
http -> https; the whole download (connect, redirects, headers, body) cut at its deadline, however
slowly a server trickles bytes; every download under way cut at once when the job stops (cancel).

    downloads = Downloads(HostRule(), max_bytes=64 << 20)
    data = downloads.get("https://example.com/cat.png", seconds=30)    # Failure(why, retry) otherwise

No proxy is used: a proxy would resolve the host itself, past the rule.
"""
from __future__ import annotations

import http.client
import socket
import ssl
import threading
import urllib.parse

from jobrunner.images.addresses import HostRule
from jobrunner.images.image_error import ImageError

REDIRECT_STATUS = {301, 302, 303, 307, 308}
RETRIED_STATUS = {408, 425, 429, 500, 502, 503, 504}    # with a timeout and a connection error: tried again
MAX_REDIRECTS = 5
_CHUNK = 1 << 16
_SAFE = "!#$%&'()*+,/:;=?@[]~"          # a selector's characters kept as they are (the rest percent-encoded)


class Failure(Exception):
    """A download that did not give an image: why (the row's error) and whether another try may."""

    def __init__(self, why: str, retry: bool):
        super().__init__(why)
        self.why, self.retry = why, retry


class _Cut:
    """The sockets of one download (duplicates of their descriptors: shutting one down ends any read or
    write on the connection, TLS or not). shut(): at the deadline (a timer thread) or when the job stops."""

    def __init__(self):
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self.done = False

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.append(sock.dup())
            if self.done:
                _shutdown(self._socks[-1])

    def shut(self) -> None:
        with self._lock:
            self.done = True
            for s in self._socks:
                _shutdown(s)

    def close(self) -> None:
        with self._lock:
            for s in self._socks:
                s.close()
            self._socks.clear()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass                # closed already


class Downloads:
    """The http(s) downloads of one job's images, under `rule`, each at most `max_bytes`."""

    def __init__(self, rule: HostRule = HostRule(), max_bytes: int = 64 << 20, max_redirects: int = MAX_REDIRECTS):
        self.rule, self.max_bytes, self.max_redirects = rule, max_bytes, max_redirects
        self._lock = threading.Lock()
        self._cuts: set[_Cut] = set()
        self.cancelled = False

    def cancel(self) -> None:
        """The job stops: every download under way ends now, and no other starts."""
        with self._lock:
            self.cancelled = True
            cuts = list(self._cuts)
        for cut in cuts:
            cut.shut()

    def get(self, url: str, seconds: float) -> bytes:
        """The body of `url` within `seconds` in all; Failure otherwise (refusals: not to be tried again)."""
        cut = _Cut()
        with self._lock:
            if self.cancelled:
                raise Failure("not fetched: the job is stopping", False)
            self._cuts.add(cut)
        timer = threading.Timer(seconds, cut.shut)
        timer.daemon = True
        timer.start()
        try:
            return self._follow(url, seconds, cut)
        except ImageError as e:
            raise Failure(str(e), False) from None
        except (OSError, http.client.HTTPException) as e:
            if self.cancelled:
                raise Failure("not fetched: the job is stopping", False) from None
            if cut.done or isinstance(e, TimeoutError):
                raise Failure(f"no answer within {seconds:g} s", True) from None
            raise Failure(f"cannot fetch it ({e})", True) from None
        finally:
            timer.cancel()
            with self._lock:
                self._cuts.discard(cut)
            cut.close()

    def _follow(self, url: str, seconds: float, cut: _Cut) -> bytes:
        """The body at the end of url's redirects."""
        for _ in range(self.max_redirects + 1):
            host, port = self.rule.target(url)
            address = self.rule.address(host, port)
            conn = _connection(url, host, port, address, seconds, cut)
            try:
                conn.request("GET", _selector(url), headers={"User-Agent": "jobrunner", "Accept": "image/*",
                                                             "Connection": "close"})
                response = conn.getresponse()
                if response.status in REDIRECT_STATUS:
                    url = redirect_target(url, response.getheader("Location"))
                    continue
                if not 200 <= response.status < 300:
                    raise Failure(f"HTTP {response.status} {response.reason}", response.status in RETRIED_STATUS)
                return self._body(response, cut, seconds)
            finally:
                conn.close()
        raise ImageError(f"refused: more than {self.max_redirects} redirects")

    def _body(self, response, cut: _Cut, seconds: float) -> bytes:
        """The response's body, read one receive at a time: past max_bytes it stops."""
        limit = self.max_bytes
        size = response.getheader("Content-Length")
        if size is not None and size.strip().isdigit() and int(size) > limit:
            raise Failure(f"over the {limit} bytes an image may have ({size.strip()} bytes)", False)
        chunks, total = [], 0
        while chunk := response.read1(_CHUNK):
            total += len(chunk)
            if total > limit:
                raise Failure(f"over the {limit} bytes an image may have", False)
            chunks.append(chunk)
        if cut.done:            # cut mid-body: what came is not the whole image
            raise TimeoutError
        if response.length:     # the server closed before the Content-Length it announced
            raise http.client.IncompleteRead(b"".join(chunks), response.length)
        return b"".join(chunks)


def redirect_target(current: str, location: str | None) -> str:
    """The URL a redirect sends `current` to; ImageError for none, or for a scheme change other than
    http -> https (never to ftp:, file: or any other scheme)."""
    if not location or not location.strip():
        raise ImageError("refused: a redirect without a Location")
    target = urllib.parse.urljoin(current, location.strip())
    old, new = urllib.parse.urlsplit(current).scheme.lower(), urllib.parse.urlsplit(target).scheme.lower()
    if new not in ("http", "https") or (old, new) == ("https", "http"):
        raise ImageError(f"refused: a redirect from {old}: to {new or 'no scheme'}: (only http: to https: "
                         f"may change the scheme)")
    return target


def _connection(url: str, host: str, port: int, address: str, seconds: float, cut: _Cut):
    """An HTTP(S) connection to `host` (its Host header, TLS name and certificate check) whose socket goes
    to `address`, the one the rule passed."""
    if urllib.parse.urlsplit(url).scheme.lower() == "https":
        conn = http.client.HTTPSConnection(host, port, timeout=seconds, context=ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(host, port, timeout=seconds)

    def pinned(_where, timeout, source_address=None, *rest):
        sock = socket.create_connection((address, port), timeout, source_address)
        cut.add(sock)
        return sock
    conn._create_connection = pinned        # http.client's hook for its socket (connect(); TLS wraps it after)
    return conn


def _selector(url: str) -> str:
    """The request's path and query, percent-encoded where they hold spaces, controls or other scripts."""
    parts = urllib.parse.urlsplit(url)
    selector = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return urllib.parse.quote(selector, safe=_SAFE)
