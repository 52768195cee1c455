"""What an output's manifest says about the job that writes it."""
from __future__ import annotations

import logging

from jobrunner.pipeline.resolve import adapters, model_path, shipped_scheme
from jobrunner.models.known import describe, model_record
from jobrunner.output import OutputError
from jobrunner.output.lease import OutputLease
from jobrunner.output.manifest import rebuild_manifest

log = logging.getLogger("jobrunner")


def job_manifest(cfg, resolved, info, engine_model: str, rank: int = 0, fingerprint: dict | None = None) -> dict:
    """The job's configuration (its resume fingerprint: `fingerprint`, else cfg's), the model (a Hub model's
    repo and commit) and, for generation, which sampling values came from where; rank 0 warns of what the
    checkpoint's generation_config.json says that we ignore. resolved: jobrunner.job.resolve's Resolved."""
    manifest = {"config": fingerprint if fingerprint is not None else resolved.fingerprint(cfg),
                "model_source": describe(cfg.engine.model, info.source), "dataset_format": resolved.fmt}
    if info.quantization != "none":     # ours (--quantization) or the checkpoint's own scheme
        manifest["quantization"] = info.quantization
    if info.packed_weights:     # CPU float linears on oneDNN (engine/run/packed_weights.py): float32 not F.linear's bits
        manifest["packed_weights"] = True
    if resolved.calibration is not None:    # how --quantization auto chose on this CPU, and the figures it rested on
        manifest["calibration"] = resolved.calibration
    if resolved.lora:       # name, path as given and content hash of each adapter
        manifest["lora"] = [{"name": name, "path": given, "content_hash": digest}
                            for (name, given), (_, _, digest) in zip(cfg.lora.adapters, resolved.lora)]
    if (hub := model_record(cfg.engine.model, engine_model)) is not None:
        manifest["hub"] = hub       # repo, revision asked, commit resolved
    if cfg.kind.name == "generate":
        manifest["sampling"] = cfg.sampling_sources(info.generation.sampling)
        if info.generation.ignored:
            manifest["generation_config_ignored"] = info.generation.ignored
            if rank == 0:
                for key, why in info.generation.ignored.items():
                    log.warning("the model's generation_config.json: %s ignored (%s)", key, why)
    return manifest


def repair_manifest(cfg) -> dict:
    """`jobrunner repair`: the output's damaged manifest rebuilt from its parts and cfg's fingerprint, under
    the output's lease (no job may write meanwhile). OutputError for an output it refuses."""
    hashes = {name: digest for name, _, digest in adapters(cfg.lora)}
    shipped = shipped_scheme(cfg, model_path(cfg.engine.model))
    lease = OutputLease(cfg.output_url)
    if not lease.fs.isdir(lease.root):      # before the lease, which would create it
        raise OutputError(f"output {cfg.output_url} not found; nothing to repair")
    with lease:
        return rebuild_manifest(cfg.output_url, cfg.fingerprint_fields(hashes, shipped))
