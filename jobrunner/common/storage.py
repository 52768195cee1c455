"""fsspec URLs: the one helper that opens them, and the one atomic write.

Invariants:
- url_fs returns a root without a trailing slash (except a bare "/"), so join(root, name)
  is always "<root>/<name>".
- join only ever takes names jobrunner generates, never names from data: it refuses
  anything path-like.
- atomic_write makes a file appear complete or not at all: it writes a hidden temporary
  `_tmp-<name>.<hex>` beside the target, fsyncs where the filesystem allows, and renames it
  into place; on any failure the temporary is removed and the target is untouched.
"""

from __future__ import annotations

import io
import os
import secrets
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem

__all__ = ["url_fs", "join", "list_names", "atomic_write", "atomic_write_with", "write_lines",
           "missing_backend_message", "CredentialsError", "credentials_error", "store_failure"]

_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}   # URL protocol -> jobrunner extra


def missing_backend_message(url: str, err: ImportError) -> str:
    """What to install when fsspec has no filesystem for url's protocol."""
    protocol = url.split("://", 1)[0].lower() if "://" in url else ""
    extra = _EXTRAS.get(protocol)
    hint = f"pip install 'jobrunner[{extra}]'" if extra else "install the fsspec backend it names"
    return f"cannot open {url}: {err} ({hint})"


class CredentialsError(PermissionError):
    """An object store found no credentials; the message says which ones and where they come from."""


# The exceptions object-store clients raise when no credentials are found (by class name: none of
# these packages need be installed): botocore (s3fs), google-auth (gcsfs), azure-identity (adlfs).
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "NoAuthTokenError",
                   "DefaultCredentialsError", "RefreshError", "ClientAuthenticationError",
                   "CredentialUnavailableError"}
# The base classes of the errors object-store clients raise for a store that fails or cannot be reached, beside
# OSError (by class name, as above): botocore's (EndpointConnectionError, ReadTimeoutError, ClientError), aiohttp's,
# gcsfs's HttpError, azure-core's AzureError.
_STORE_FAILURES = {"BotoCoreError", "ClientError", "HttpError", "AzureError"}
_CREDENTIALS = {
    "s3": "AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE (a profile of "
          "~/.aws/credentials), or run where an instance or pod role provides them",
    "gcs": "Google Cloud credentials: set GOOGLE_APPLICATION_CREDENTIALS to a service account key file, or run "
           "`gcloud auth application-default login`",
}


def credentials_error(url: str, err: BaseException) -> CredentialsError | None:
    """err as a one-line CredentialsError naming url and the credentials it lacks, when it is an
    object store's "no credentials" error; else None."""
    if not {c.__name__ for c in type(err).__mro__} & _NO_CREDENTIALS:
        return None
    protocol = url.split("://", 1)[0].lower() if "://" in url else ""
    which = _CREDENTIALS.get(_EXTRAS.get(protocol, ""), f"credentials for {protocol or 'its storage'}")
    first = (str(err).strip().splitlines() or [""])[0]
    return CredentialsError(f"cannot open {url}: no {which} ({type(err).__name__}: {first})")


def store_failure(err: BaseException) -> bool:
    """err is a storage failure: an OSError, or an object-store client's own error for a store that failed
    or could not be reached (s3fs lets botocore's connection errors through untranslated)."""
    return isinstance(err, OSError) or bool({c.__name__ for c in type(err).__mro__} & _STORE_FAILURES)


def url_fs(url: str) -> tuple[Any, str]:
    """(filesystem, path) of a URL or plain path; the path has no trailing slash.

    Raises fsspec's ImportError when the protocol's backend is not installed (callers turn it
    into their own error with missing_backend_message) and ValueError for an unknown protocol.
    """
    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/") or root
    return fs, root


def join(root: str, name: str) -> str:
    """root/name for a name jobrunner generated (never one from data)."""
    assert "/" not in name and "\\" not in name and name not in ("", ".", ".."), name
    return f"{root}/{name}" if not root.endswith("/") else root + name


def list_names(fs: Any, root: str) -> list[str]:
    """Sorted base names in root, fresh (the listing cache is dropped); [] if root is missing."""
    try:
        fs.invalidate_cache(root)
    except Exception:  # noqa: BLE001 - cache invalidation is best effort
        pass
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)


def atomic_write(fs: Any, path: str, data: bytes) -> None:
    """Write data to path under a hidden temporary name, fsync where possible, rename into place."""
    atomic_write_with(fs, path, lambda f: _write_durably(f, data))


def atomic_write_with(fs: Any, path: str, write: Callable[[BinaryIO], Any]) -> None:
    """Like atomic_write, with write(f) filling the temporary file (for streamed content)."""
    head, name = path.rsplit("/", 1)
    tmp = f"{head}/_tmp-{name}.{secrets.token_hex(6)}"
    try:
        with fs.open(tmp, "wb") as f:
            write(f)
        fs.mv(tmp, path)
    except BaseException:
        try:
            fs.rm(tmp)
        except Exception:  # noqa: BLE001 - best effort cleanup
            pass
        raise
    if isinstance(fs, LocalFileSystem):  # make the rename itself durable
        _fsync_dir(head)


def write_lines(f: BinaryIO, lines: Iterable[str]) -> None:
    """Each text line plus a newline, as UTF-8 (unencodable characters replaced)."""
    for line in lines:
        f.write((line + "\n").encode("utf-8", "replace"))


def _write_durably(f: BinaryIO, data: bytes) -> None:
    f.write(data)
    try:  # durable before visible (local disks); a remote store commits on close
        f.flush()
        os.fsync(f.fileno())
    except (AttributeError, OSError, ValueError, NotImplementedError, io.UnsupportedOperation):
        pass


def _fsync_dir(head: str) -> None:
    try:
        fd = os.open(head, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
