"""Hugging Face Hub names: `-m Qwen/Qwen3-8B` or `-m org/name@revision` becomes a local snapshot
directory through `huggingface_hub`, which the engine then loads like any HF directory.

Only what the engine reads is fetched (config, generation config, tokenizer, safetensors; never
pickles or checkpoint code). Everything else is huggingface_hub's, so its conventions hold:
the standard cache (HF_HOME, HF_HUB_CACHE), HF_TOKEN for gated and private repos, and
HF_HUB_OFFLINE=1, under which a pre-fetched cache works on a machine without internet. Layout:

    <HF_HUB_CACHE>/models--<org>--<name>/refs/<revision>          the commit a branch or tag points at
                                         snapshots/<commit>/<file>  links into blobs/
                                         blobs/<hash>

Invariant: the directory returned is snapshots/<commit>, so its name is the commit resolved.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from jobrunner.engine import ModelError

__all__ = ["ALLOW_PATTERNS", "fetch", "is_hub_name", "parse"]

# The files the engine reads from an HF directory (engine/load/loader.py), and nothing else.
ALLOW_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja", "*.safetensors", "model.safetensors.index.json",
                  "adapter_config.json"]     # a LoRA adapter (jobrunner.models.resolve_adapter)

# org/name[@revision]: the Hub's repo id characters; a revision is a branch, tag or commit.
_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


def is_hub_name(model: str) -> bool:
    """`org/name` or `org/name@revision` (callers check local paths first: an existing path wins)."""
    return _NAME.match(model) is not None and not model.startswith(("./", "../"))


def parse(model: str) -> tuple[str, str | None]:
    """'org/name@rev' -> ('org/name', 'rev'); 'org/name' -> ('org/name', None)."""
    m = _NAME.match(model)
    if m is None:
        raise ModelError(f"{model!r} is not a Hugging Face Hub name (org/name or org/name@revision)")
    return m.group("repo"), m.group("revision")


def fetch(model: str) -> Path:
    """The snapshot directory of a Hub model (its name is the commit), downloaded if needed or found in
    the cache offline; ModelError with what to do when it cannot be had."""
    repo, revision = parse(model)
    try:        # huggingface_hub loads only for a Hub name (the command line's start imports this module)
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                            RevisionNotFoundError)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ModelError(f"model {model!r} looks like a Hugging Face Hub name; fetching it needs "
                         "huggingface_hub (pip install huggingface_hub)") from e
    try:
        path = Path(snapshot_download(repo, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except LocalEntryNotFoundError as e:
        fix = "unset HF_HUB_OFFLINE" if _offline() else "check this machine's connection to huggingface.co"
        raise ModelError(
            f"model {model!r} is not in the Hugging Face cache and the Hub cannot be reached ({_first_line(e)}). "
            "Fetch it on a machine with internet (`jobrunner models pull "
            f"{model}`) and copy the cache (HF_HUB_CACHE, default ~/.cache/huggingface/hub), or {fix}") from None
    except GatedRepoError:
        raise ModelError(f"model {model!r} is gated: accept its terms on huggingface.co and set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise ModelError(f"model {model!r}: revision {revision!r} does not exist") from None
    except RepositoryNotFoundError:
        raise ModelError(f"model {model!r} is not on the Hugging Face Hub (or is private: set HF_TOKEN), "
                         "nor an existing path") from None
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot fetch model {model!r} from the Hugging Face Hub: {_first_line(e)}") from None
    return path


def _offline() -> bool:
    """HF_HUB_OFFLINE set, as huggingface_hub reads it (1, true, yes or on)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
