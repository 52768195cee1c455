"""What an embedding checkpoint says about its own pooling: the sentence-transformers files beside
its weights. No torch.

    modules.json            [{"type": "sentence_transformers.models.Transformer", "path": ""},
                             {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"},
                             {"type": "sentence_transformers.models.Normalize", "path": "2_Normalize"}]
    1_Pooling/config.json   {"pooling_mode_lasttoken": true, "pooling_mode_mean_tokens": false, ...}

A Normalize module means L2-normalized vectors. Anything after the transformer that we do not
apply (a Dense projection, max pooling) is reported, so a job refuses it instead of writing vectors
that differ from the model's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# sentence-transformers' pooling flags -> our pooling; the others (max, mean_sqrt_len, weightedmean) are not ours
_POOLING_FLAGS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class CheckpointPooling:
    pooling: str | None                 # last | mean | cls; None: no Pooling module
    normalize: bool                     # a Normalize module follows
    unsupported: str | None = None      # what the checkpoint does that we don't, to refuse it by name


def read_checkpoint_pooling(root: str | Path) -> CheckpointPooling | None:
    """The pooling a local HF directory's sentence-transformers files declare; None without modules.json."""
    root = Path(root)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
        kinds = {str(m["type"]).rsplit(".", 1)[-1]: str(m.get("path") or "") for m in modules}
    except (ValueError, KeyError, TypeError) as e:
        return CheckpointPooling(None, False, f"an unreadable modules.json ({e})")
    others = [k for k in kinds if k not in _KNOWN_MODULES]
    normalize = "Normalize" in kinds
    if others:
        return CheckpointPooling(None, normalize, f"sentence-transformers module(s) {', '.join(others)}")
    if "Pooling" not in kinds:
        return CheckpointPooling(None, normalize)
    config_file = root / kinds["Pooling"] / "config.json"
    try:
        flags = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return CheckpointPooling(None, normalize, f"an unreadable {config_file} ({e})")
    if not isinstance(flags, dict):
        return CheckpointPooling(None, normalize, f"an unreadable {config_file}")
    on = [k for k, v in flags.items() if k.startswith("pooling_mode_") and v is True]
    ours = [_POOLING_FLAGS[k] for k in on if k in _POOLING_FLAGS]
    if len(on) != 1 or len(ours) != 1:
        return CheckpointPooling(None, normalize, f"pooling {', '.join(on) or 'none'} in {config_file}")
    return CheckpointPooling(ours[0], normalize)
