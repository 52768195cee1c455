"""The manifest (_manifest.json) and the policy it carries: resume, refuse, or overwrite.

_manifest.json holds the job's output-affecting configuration and its fingerprint (sha256 of
the configuration's canonical JSON), when it was created and updated, whether the job is
complete, and the part files seen at the last update.

Invariants:
- An existing output with our manifest and the same fingerprint is resumed; one with another
  fingerprint is refused, and the message names the options that differ.
- --overwrite deletes only files our naming says are ours (layout.OURS_RE), in a directory our
  manifest says is ours, and refuses when anything else is inside.  The manifest is replaced
  last, so an overwrite killed halfway leaves a directory that is still ours.
- The manifest is informative: the listing of part files is the truth (layout.py), so a failed
  manifest update only warns, and its parts list is rewritten from a listing, never by reading parts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from collections.abc import Mapping
from typing import Any

from jobrunner.output import layout
from jobrunner.output.layout import FORMAT_MARK, LEASE_RE, MANIFEST, MANIFEST_TMP_RE, OURS_RE, PART_RE, OutputError
from jobrunner.output.values import json_default, to_json, to_json_pretty
from jobrunner.common.storage import atomic_write, join

__all__ = ["ManifestDamagedError", "fingerprint", "load_manifest", "check_output", "prepare_output", "rebuild_manifest",
           "write_manifest"]
log = logging.getLogger("jobrunner")


def fingerprint(config: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of a job's output-affecting configuration."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=json_default)
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, Mapping) or (prefix and not d):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _config_diff(old: Any, new: Any, limit: int = 8) -> str:
    a, b = _flatten(json.loads(to_json(old))), _flatten(json.loads(to_json(new)))
    diffs = []
    for k in sorted(set(a) | set(b)):
        if k not in b:
            diffs.append(f"{k}: {a[k]!r} (existing) -> unset (now)")
        elif k not in a:
            diffs.append(f"{k}: unset (existing) -> {b[k]!r} (now)")
        elif a[k] != b[k]:
            diffs.append(f"{k}: {a[k]!r} (existing) -> {b[k]!r} (now)")
    more = f"; and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more if diffs else "(configurations differ)"


class ManifestDamagedError(OutputError):
    """_manifest.json is there but cannot be read (truncated, empty); `jobrunner repair` rebuilds it."""


def load_manifest(fs: Any, root: str) -> dict | None:
    """root's manifest; None when it has none; OutputError when it is unreadable or not ours."""
    path = join(root, MANIFEST)
    try:
        with fs.open(path, "rb") as f:
            m = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (ValueError, OSError) as e:
        raise ManifestDamagedError(
            f"{path} is damaged ({e}); the parts beside it are intact. Run `jobrunner repair` with the "
            "job's dataset and options (the submit command with `repair` for `submit`) to rebuild it from "
            "the parts, then submit again to resume") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT_MARK:
        raise OutputError(f"{path} is not a jobrunner manifest; choose another --output")
    return m


def _check_existing(fs: Any, root: str, output_url: str, config: Mapping[str, Any],
                    overwrite: bool) -> tuple[dict | None, list[str]]:
    """The rules for an existing output: (its manifest or None, names to delete before starting afresh).

    Raises OutputError for every refusal; reads only.  A manifest with our fingerprint and no
    overwrite means resume.  Overwrite deletes only files our naming says are ours, in a directory
    our manifest says is ours, and refuses when anything else is inside.
    """
    if not fs.exists(root):
        return None, []
    if not fs.isdir(root):
        raise OutputError(f"output {output_url} exists and is a file; choose a directory for --output")
    entries = _entries(fs, root)
    names = sorted(entries)
    old = load_manifest(fs, root) if MANIFEST in entries else None
    if old is None:
        if all(MANIFEST_TMP_RE.match(n) for n in names):  # empty, or killed writing its first manifest
            return None, names
        if any(PART_RE.match(n) for n in names):    # a jobrunner output whose manifest was deleted
            raise OutputError(
                f"output {output_url} holds part files but no {MANIFEST}. If it is a jobrunner output whose "
                f"manifest was lost, `jobrunner repair` with the job's dataset and options (the submit command "
                f"with `repair` for `submit`) rebuilds it from the parts; then submit again to resume. Else "
                f"choose another --output")
        raise OutputError(
            f"output {output_url} exists, is not empty and is not a jobrunner output "
            f"(no {MANIFEST}); choose another --output"
            + (" (--overwrite only ever deletes jobrunner outputs)" if overwrite else ""))
    if not overwrite:
        if old.get("fingerprint") == fingerprint(config):
            return old, []
        raise OutputError(
            f"output {output_url} holds a different job: {_config_diff(old.get('config'), config)}. "
            "Run with the same options to resume it, pass --overwrite to replace it, "
            "or choose another --output")
    foreign = [n for n in names if entries[n] != "file" or not OURS_RE.match(n)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputError(f"--overwrite: output {output_url} also holds files jobrunner did not write "
                          f"({shown}); nothing was deleted. Move them away or choose another --output")
    # the manifest is replaced last, so an overwrite killed halfway leaves a directory still ours
    return old, [n for n in names if n != MANIFEST]


def check_output(output_url: str, config: Mapping[str, Any], overwrite: bool = False) -> None:
    """prepare_output's refusals, found before a model loads: raises OutputError for each.

    Creates the directory (an OSError saying so when it can't be) and changes nothing else.
    """
    fs, root = layout.output_fs(output_url)
    _check_existing(fs, root, output_url, config, overwrite)
    try:
        fs.makedirs(root, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create the output directory {output_url}: {e}") from e
    _check_writable(fs, root, output_url)


def _check_writable(fs: Any, root: str, output_url: str) -> None:
    """An OSError when no file can be written in root (a read-only existing output): found here, before a
    model loads, not at the first part. The probe has the lease's temporary name: ours, and ignored as the
    lease is by every check of the directory's contents should a kill leave it."""
    probe = join(root, f"_tmp-{layout.LEASE}.{secrets.token_hex(6)}")
    try:
        fs.pipe_file(probe, b"")
    except OSError as e:
        raise OSError(f"cannot write in the output directory {output_url}: {e}") from e
    try:
        fs.rm(probe)
    except FileNotFoundError:
        pass


def prepare_output(output_url: str, manifest: Mapping[str, Any], overwrite: bool = False) -> dict:
    """Check (and create, or with overwrite reset) an output directory; returns the manifest.

    Resume when the existing manifest has the same fingerprint; refuse a different
    job.  overwrite starts afresh (same configuration or not), deleting only our own
    files, and only in a directory that holds our _manifest.json and nothing foreign
    (see _check_existing).  Data-parallel launchers call this once (with overwrite),
    then start workers with overwrite=False.
    """
    config = manifest.get("config")
    if not isinstance(config, Mapping):
        raise ValueError('manifest needs a "config" dict (what affects the outputs)')
    fp = fingerprint(config)
    fs, root = layout.output_fs(output_url)
    old, stale = _check_existing(fs, root, output_url, config, overwrite)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if old is not None and not overwrite:  # resume
        merged = {**old, **{k: v for k, v in manifest.items() if k != "config"}}
        merged.update(format=FORMAT_MARK, fingerprint=fp, created_at=old.get("created_at", now))
        return merged
    for n in stale:
        try:
            fs.rm(join(root, n))
        except FileNotFoundError:
            pass
    fresh = _fresh_manifest(manifest, config, [])
    fs.makedirs(root, exist_ok=True)
    atomic_write(fs, join(root, MANIFEST), manifest_bytes(fresh))
    return fresh


def manifest_bytes(m: Mapping[str, Any]) -> bytes:
    """The manifest file's content: indented JSON, UTF-8."""
    return to_json_pretty(m).encode("utf-8", errors="replace")


def write_manifest(fs: Any, root: str, output_url: str, manifest: dict, complete: bool) -> None:
    """Rewrite _manifest.json atomically with `complete`; its parts list comes from the listing.

    Updates `manifest` in place.  A failure only warns: the manifest is informative, the part files
    are the truth.
    """
    manifest["parts"] = [n for n in layout.names(fs, root) if PART_RE.match(n)]
    manifest["complete"] = complete
    manifest["updated_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        atomic_write(fs, join(root, MANIFEST), manifest_bytes(manifest))
    except Exception as e:  # noqa: BLE001 - informative only: the listing is the truth
        log.warning("updating %s in %s failed (%s); the parts written are kept, and the next update "
                    "rewrites it", MANIFEST, output_url, e)


def rebuild_manifest(output_url: str, config: Mapping[str, Any]) -> dict:
    """A damaged or missing _manifest.json written anew from the part files and the job's configuration
    (`jobrunner repair`); returns it. Refuses (OutputError) a directory with no part, a readable manifest of
    another job, or files that are not ours: repair never adopts what jobrunner did not write."""
    fs, root = layout.output_fs(output_url)
    if not fs.exists(root) or not fs.isdir(root):
        raise OutputError(f"output {output_url} not found; nothing to repair")
    entries = _entries(fs, root)
    foreign = [n for n, t in entries.items() if t != "file" or not OURS_RE.match(n)]
    if foreign:
        raise OutputError(f"output {output_url} holds files jobrunner did not write ({', '.join(sorted(foreign)[:5])}); "
                          "it is not repaired")
    if MANIFEST in entries:
        try:
            old = load_manifest(fs, root)
        except ManifestDamagedError:
            old = None
        if old is not None:
            if old.get("fingerprint") == fingerprint(config):
                raise OutputError(f"{join(root, MANIFEST)} is intact and matches this job; nothing to repair: "
                                  "submit again to resume")
            raise OutputError(f"{join(root, MANIFEST)} is intact and holds a different job: "
                              f"{_config_diff(old.get('config'), config)}; it is not replaced")
    if not any(PART_RE.match(n) for n in entries):
        raise OutputError(f"output {output_url} has no part files; nothing to repair (submit starts it afresh "
                          f"once {MANIFEST} is deleted)")
    fresh = _fresh_manifest({}, config, [n for n in sorted(entries) if PART_RE.match(n)])
    fresh["repaired_at"] = fresh["created_at"]
    atomic_write(fs, join(root, MANIFEST), manifest_bytes(fresh))
    return fresh


def _entries(fs: Any, root: str) -> dict[str, str]:
    """layout.entries without the lease (ours, held by the job that is looking)."""
    return {n: t for n, t in layout.entries(fs, root).items() if not LEASE_RE.match(n)}


def _fresh_manifest(manifest: Mapping[str, Any], config: Mapping[str, Any], parts: list[str]) -> dict:
    """A new job's manifest: `manifest`'s records over config's fingerprint, not complete."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {**manifest, "config": json.loads(to_json(config)), "format": FORMAT_MARK, "version": 1,
            "fingerprint": fingerprint(config), "created_at": now, "updated_at": now, "parts": parts,
            "complete": False,
            "run_salt": secrets.token_hex(8)}     # per job, kept on resume: the OpenAI output's ids (openai_batch)
