"""How a Ray job's driver joins its cluster, and what its workers take of the driver's process: the
settings in its environment, and its local paths made absolute (a worker's working directory is Ray's)."""
from __future__ import annotations

import logging
import os

from jobrunner.config.job import JobConfigError

NAMESPACE = "jobrunner"


def import_ray(address: str):
    """Ray, or JobConfigError naming the extra. A private local cluster (or one on a loopback address) stays
    on loopback: Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import (0: every address 127.0.0.1)."""
    if address == "local" or address.split("://")[-1].startswith(("127.", "localhost")):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError:
        raise JobConfigError("--ray needs Ray: pip install 'jobrunner[ray]'") from None
    return ray


def connect(ray, address: str) -> None:
    """Joins the cluster as Ray's own clients do: with its token when one is there (RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH or the ~/.ray/auth_token that `ray start` writes) and RAY_AUTH_MODE is unset."""
    kwargs = dict(namespace=NAMESPACE, log_to_driver=True, logging_level=logging.WARNING)
    with_token = False
    try:
        if address == "local":
            ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", **kwargs)
        else:
            with_token = _token_auth_if_available()
            ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError, ValueError, getattr(ray.exceptions, "AuthenticationError", ConnectionError)) as e:
        if _is_auth_failure(e) or not with_token and address != "local":
            # Ray says a refused token only in its own log lines (InvalidAuthToken), then "Failed to connect"
            refused = "refused this client's token" if with_token else "could not be joined"
            raise JobConfigError(
                f"--ray {address}: the Ray cluster {refused} ({first_line(e)}). A cluster started with "
                "`ray start` uses token authentication by default: give this machine its token, as "
                "~/.ray/auth_token (`ray get-auth-token` on the head node prints it) or RAY_AUTH_TOKEN, with "
                "RAY_AUTH_MODE=token or unset. Else check that the address is the head's (`ray start --head` "
                "prints it), or use --ray local") from None
        raise JobConfigError(f"--ray {address}: cannot join the Ray cluster ({e}); start one with "
                             "`ray start --head`, give its address, or use --ray local") from None


def _token_auth_if_available() -> bool:
    """Token mode when RAY_AUTH_MODE is unset and a token is at hand: what Ray's CLI does (its ray.init alone
    does not, and then fails against a `ray start` cluster with InvalidAuthToken). Whether in token mode."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available)
    except ImportError:         # a Ray without token authentication
        return False
    return maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _is_auth_failure(e: Exception) -> bool:
    text = f"{type(e).__name__} {e}"
    return any(s in text for s in ("AuthenticationError", "InvalidAuthToken", "Unauthenticated", "UNAUTHENTICATED",
                                   "authentication token", "auth token"))


def first_line(e: Exception) -> str:
    """The error's type and first line; a task's error is its cause's (Ray's own first line is
    `ray::RayWorker.run() (pid=..., ip=...)`, which says nothing)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        e = cause
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


# The driver's settings a worker's process keeps: where models, conversions and kernels are cached, and
# how they are built (engine.config.cache_root, engine/run/cpu_decode.py; the Hub's cache for Hub names).
WORKER_ENV_PREFIXES = ("JOBRUNNER_", "HF_", "HUGGINGFACE_")
_PATH_VARS = ("JOBRUNNER_CACHE", "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")


def worker_env(environ=None) -> dict[str, str]:
    """The driver's JOBRUNNER_*, HF_* variables for the workers' runtime_env; relative paths made absolute
    (a worker's working directory is Ray's)."""
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items() if k.startswith(WORKER_ENV_PREFIXES)}
    for k in _PATH_VARS:
        if env.get(k):
            env[k] = os.path.abspath(os.path.expanduser(env[k]))
    return env


def absolute_url(url: str) -> str:
    """A local path made absolute; a URL (s3://, file://, memory://, ...) as it is."""
    if "://" in url or not url:
        return url
    return os.path.abspath(os.path.expanduser(url))


def absolute_if_here(model: str) -> str:
    """A model or adapter that is a local path here, made absolute (dummy:<config path> too); a URL or a
    name (dummy:tiny-llama) as it is."""
    if model.startswith("dummy:"):
        return "dummy:" + absolute_if_here(model.removeprefix("dummy:"))
    return absolute_url(model) if "://" not in model and os.path.exists(model) else model
