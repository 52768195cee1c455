"""What an output's manifest says about the job that writes it."""
from __future__ import annotations

import logging

from jobrunner.config.lora import LoraOptions
from jobrunner.engine import NUMERICS_VERSION, EngineInfo
from jobrunner.pipeline.resolve import Resolved
from jobrunner.models.known import describe, model_record
from jobrunner.output import OutputError
from jobrunner.output.lease import OutputLease
from jobrunner.output.manifest import rebuild_manifest

log = logging.getLogger("jobrunner")


def job_manifest(fingerprint: dict, resolved: Resolved, info: EngineInfo, engine_model: str, model: str,
                 lora: LoraOptions, sampling: dict | None, rank: int = 0) -> dict:
    """The job's configuration (its resume fingerprint), the model (`model`: --model as given; a Hub model's
    repo and commit), its LoRA adapters and, for generation, which sampling values came from where
    (`sampling`: JobConfig.sampling_sources, None for another kind); rank 0 warns of what the checkpoint's
    generation_config.json says that we ignore. engine_model: the checkpoint's path as the engine loaded it."""
    manifest = {"config": fingerprint, "model_source": describe(model, info.source), "dataset_format": resolved.fmt}
    if info.quantization != "none":     # ours (--quantization) or the checkpoint's own scheme
        manifest["quantization"] = info.quantization
    if info.packed_weights:     # CPU float linears on oneDNN (engine/run/packed_weights.py): float32 not F.linear's bits
        manifest["packed_weights"] = True
    if info.batch_invariant:    # --deterministic: rows' bits independent of their batch, by this numeric path's version
        manifest["batch_invariant"] = True
        manifest["numerics_version"] = NUMERICS_VERSION
    if resolved.calibration is not None:    # how --quantization auto chose on this CPU, and the figures it rested on
        manifest["calibration"] = resolved.calibration
    if resolved.lora:       # name, path as given and content hash of each adapter
        manifest["lora"] = [{"name": name, "path": given, "content_hash": digest}
                            for (name, given), (_, _, digest) in zip(lora.adapters, resolved.lora)]
    if (hub := model_record(model, engine_model)) is not None:
        manifest["hub"] = hub       # repo, revision asked, commit resolved
    if sampling is not None:
        manifest["sampling"] = sampling
        if info.generation.ignored:
            manifest["generation_config_ignored"] = info.generation.ignored
            if rank == 0:
                for key, why in info.generation.ignored.items():
                    log.warning("the model's generation_config.json: %s ignored (%s)", key, why)
    return manifest


def repair_manifest(url: str, fingerprint: dict) -> dict:
    """`jobrunner repair`: the damaged manifest of the output at `url` rebuilt from its parts and the job's
    fingerprint (resolve.repair_fingerprint), under the output's lease (no job may write meanwhile). OutputError for an output it refuses."""
    lease = OutputLease(url)
    if not lease.fs.isdir(lease.root):      # before the lease, which would create it
        raise OutputError(f"output {url} not found; nothing to repair")
    with lease:
        return rebuild_manifest(url, fingerprint)
