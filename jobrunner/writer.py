"""Resumable, atomic Parquet output directory on any fsspec URL.

Layout of an output directory:

    _manifest.json              job configuration, fingerprint, parts (informative)
    part-00000.parquet          result rows; written as _tmp-... then renamed
    part-r1-00000.parquet       parts of another process (part_prefix="part-r1")
    _corrupt-part-00007.parquet a damaged part set aside on resume (its rows are redone)
    _stats.json, _stats.parquet job summary (close / write_stats)
    results.openai.jsonl        optional, write_openai_batch_output

Invariants:
- A file named part*.parquet is always complete: it appears by rename only.
  The listing of part files is the truth about what is done; the manifest's parts
  list is informative, so several writers (distinct part_prefix) can share a dir.
- done_ids = ids in all readable part*.parquet files found at open (what a resumed
  job skips), kept as an IdSet (16 bytes an id); rows written since are not added,
  since the caller knows them.  A part that can't be read is renamed _corrupt-<name>
  and its ids are not done.
- Rows passed in one write() call always land in the same part (a multi-sample
  row is never half written).
- A part is flushed once part_rows rows are buffered, or once the oldest buffered row has
  waited flush_seconds (checked on write() and maybe_flush(), which a job calls after every
  engine step): a kill loses at most flush_seconds of finished rows.  (The first part also
  waits for a row without an error, as it pins the schema; error rows are no work to redo.)
- Every part has the same schema (so `polars.read_parquet("out/part*.parquet")`
  and `pyarrow.dataset.dataset("out")` read them together):
    fixed columns   id, output, finish_reason, error: string;
                    prompt_tokens, cached_tokens, completion_tokens: int64;
                    queue_s, prefill_s, decode_s: float64
    known columns   label: string; sample_index: int64;
                    label_probs: list<struct<label: string, prob: float64>> (from a dict label->prob)
                    label_logprobs: list<struct<label: string, logprob: float64>> (likewise)
    extra columns   pinned by the first part ever written (read back from it afterwards):
                    all values str -> string; all bool -> bool; all int -> int64;
                    int/float -> float64; anything else (nested, mixed, all-null,
                    bytes, dates) -> "json": a string column of JSON texts.
    extra_json      a JSON object (string) of the row's values that don't fit the pinned
                    schema: keys first seen after the first part, or values of another
                    type than the column's.  Null when everything fit.  Nothing is dropped;
                    stored_values(table, name) reads a column with these put back.
  Each column's kind is recorded in the parquet schema metadata "jobrunner.kinds".
  Files named _* are not parts: glob "part*.parquet" (not "*.parquet", which would
  also match _stats.parquet) or use pyarrow.dataset, which skips _* files.
- Data-parallel workers sharing a directory: the launcher calls prepare_output
  once (it alone may --overwrite), each worker uses its own part_prefix and
  closes with stats=None; the launcher then calls write_stats.  If two workers
  flush their very first parts at the same moment from data of different types,
  their pinned schemas can differ and a glob read then fails on that column;
  let one worker flush first when input types are mixed.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import hashlib
import io
import json
import numbers
import os
import re
import secrets
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from jobrunner.idset import IdSet

__all__ = ["OutputError", "ResultWriter", "prepare_output", "check_output", "fingerprint", "read_results",
           "iter_result_parts", "stored_values", "read_stats", "read_manifest", "write_stats",
           "write_openai_batch_output",
           "FIXED_COLUMNS", "EXTRA_JSON"]

MANIFEST = "_manifest.json"
FORMAT_MARK = "jobrunner-output"
EXTRA_JSON = "extra_json"
OPENAI_OUTPUT = "results.openai.jsonl"
LABEL_PROBS = pa.list_(pa.struct([("label", pa.string()), ("prob", pa.float64())]))
LABEL_LOGPROBS = pa.list_(pa.struct([("label", pa.string()), ("logprob", pa.float64())]))
_LABEL_LISTS = {"label_probs": "prob", "label_logprobs": "logprob"}   # kind -> its struct's number field
_ARROW = {"string": pa.string(), "json": pa.string(), "int": pa.int64(), "float": pa.float64(),
          "bool": pa.bool_(), "label_probs": LABEL_PROBS, "label_logprobs": LABEL_LOGPROBS}
FIXED_COLUMNS: dict[str, str] = {
    "id": "string", "output": "string", "finish_reason": "string",
    "prompt_tokens": "int", "cached_tokens": "int", "completion_tokens": "int",
    "queue_s": "float", "prefill_s": "float", "decode_s": "float", "error": "string"}
KNOWN_COLUMNS: dict[str, str] = {"label": "string", "label_probs": "label_probs",
                                 "label_logprobs": "label_logprobs", "sample_index": "int"}
_PART_RE = re.compile(r"^part[^/]*\.parquet$")
_MANIFEST_TMP_RE = re.compile(r"^_tmp-_manifest\.json\.[0-9a-f]+$")
_PREFIX_RE = re.compile(r"^part[A-Za-z0-9_]*(-[A-Za-z0-9_]+)*$")
_INT64 = (-(2**63), 2**63 - 1)


class OutputError(Exception):
    """The output directory can't be used as asked; the message says why and what to do."""


# ---------------------------------------------------------------- values


def _json_default(v: Any) -> Any:
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).decode("utf-8", errors="replace")
    if isinstance(v, (_dt.datetime, _dt.date, _dt.time)):
        return v.isoformat()
    if isinstance(v, (set, frozenset)):
        return sorted(v, key=repr)
    if isinstance(v, decimal.Decimal):
        return str(v)
    return str(v)


def _plain(v: Any) -> Any:
    """Containers with non-string keys made JSON-able (keys become str)."""
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def to_json(v: Any) -> str:
    """JSON text of any value; never raises (falls back to repr)."""
    try:
        return json.dumps(v, ensure_ascii=False, default=_json_default)
    except (TypeError, ValueError, RecursionError):
        try:
            return json.dumps(_plain(v), ensure_ascii=False, default=_json_default)
        except (TypeError, ValueError, RecursionError):
            return json.dumps(repr(v))


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and _INT64[0] <= v <= _INT64[1]


def _is_float(v: Any) -> bool:
    """A real number that a float64 holds exactly (ints up to 2**53)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return False
    if isinstance(v, numbers.Integral):
        return -(2**53) <= v <= 2**53
    try:
        float(v)
    except (OverflowError, ValueError, TypeError):
        return False
    return True


def _label_list(v: Any, field: str) -> list[dict] | None:
    """dict label->number, or [{label, <field>}], as a list of structs; None if neither."""
    items = v.items() if isinstance(v, Mapping) else None
    if items is None and isinstance(v, (list, tuple)) and all(
            isinstance(x, Mapping) and set(x) == {"label", field} for x in v):
        items = [(x["label"], x[field]) for x in v]
    if items is None:
        return None
    out = []
    for label, number in items:
        if not isinstance(label, str) or not (number is None or _is_float(number)):
            return None
        out.append({"label": label, field: None if number is None else float(number)})
    return out


_MISS = object()  # a value that doesn't fit its column's kind


def _fit(kind: str, v: Any) -> Any:
    """v converted for a column of `kind`, or _MISS. None always fits."""
    if v is None:
        return None
    if kind == "json":
        return to_json(v)
    if kind == "string":
        return v if isinstance(v, str) else _MISS
    if kind == "int":
        return int(v) if _is_int(v) else _MISS
    if kind == "float":
        return float(v) if _is_float(v) else _MISS
    if kind == "bool":
        return v if isinstance(v, bool) else _MISS
    if kind in _LABEL_LISTS:
        lp = _label_list(v, _LABEL_LISTS[kind])
        return _MISS if lp is None else lp
    raise AssertionError(kind)


def _infer_kind(name: str, values: list[Any]) -> str:
    """Kind of a new extra column from its values in the first part (see module doc)."""
    if name in KNOWN_COLUMNS:
        return KNOWN_COLUMNS[name]
    vals = [v for v in values if v is not None]
    if not vals:
        return "json"
    if all(isinstance(v, str) for v in vals):
        return "string"
    if all(isinstance(v, bool) for v in vals):
        return "bool"
    if all(_is_int(v) for v in vals):
        return "int"
    if all(_is_float(v) for v in vals):
        return "float"
    return "json"


def _scrub(v: Any) -> Any:
    """Strings made encodable as UTF-8 (lone surrogates -> '?'), recursively."""
    if isinstance(v, str):
        return v.encode("utf-8", errors="replace").decode("utf-8")
    if isinstance(v, list):
        return [_scrub(x) for x in v]
    if isinstance(v, dict):
        return {_scrub(k): _scrub(x) for k, x in v.items()}
    return v


def _array(values: list[Any], kind: str) -> pa.Array:
    try:
        return pa.array(values, type=_ARROW[kind])
    except (pa.ArrowException, UnicodeEncodeError):
        return pa.array(_scrub(values), type=_ARROW[kind])


# ---------------------------------------------------------------- schema


def _schema(kinds: dict[str, str]) -> pa.Schema:
    fields = [pa.field(n, _ARROW[k]) for n, k in kinds.items()]
    fields.append(pa.field(EXTRA_JSON, pa.string()))
    meta = {"jobrunner.kinds": json.dumps(kinds, ensure_ascii=False), "jobrunner.version": "1"}
    return pa.schema(fields, metadata=meta)


def _kinds_of(schema: pa.Schema) -> dict[str, str] | None:
    """The pinned kinds recorded in a part's schema, or None for a foreign file."""
    raw = (schema.metadata or {}).get(b"jobrunner.kinds")
    try:
        kinds = json.loads(raw) if raw else None
    except ValueError:
        return None
    if not isinstance(kinds, dict) or any(k not in _ARROW for k in kinds.values()):
        return None
    if any(kinds.get(n) != k for n, k in FIXED_COLUMNS.items()):
        return None
    return kinds


def _norm_row(row: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(row, Mapping):
        raise TypeError(f"result rows must be dicts, got {type(row).__name__}")
    rid = row.get("id")
    if rid is None:
        raise ValueError("result row without an id")
    out: dict[str, Any] = {}
    for k, v in row.items():
        name = k if isinstance(k, str) else str(k)
        out[name if name not in out else repr(k)] = v  # 1 and "1" both kept
    out["id"] = rid if isinstance(rid, str) else str(rid)
    return out


def _table(rows: list[dict[str, Any]], kinds: dict[str, str]) -> pa.Table:
    """Rows conformed to the pinned kinds; misfits go to extra_json."""
    cols: dict[str, list[Any]] = {n: [] for n in kinds}
    extra: list[str | None] = []
    for row in rows:
        over: dict[str, Any] = {}
        for n, k in kinds.items():
            v = _fit(k, row.get(n))
            if v is _MISS:
                over[n] = row[n]
                v = None
            cols[n].append(v)
        for n, v in row.items():
            if n not in kinds:
                over[n] = v
        extra.append(to_json(over) if over else None)
    arrays = [_array(cols[n], k) for n, k in kinds.items()]
    arrays.append(_array(extra, "string"))
    return pa.Table.from_arrays(arrays, schema=_schema(kinds))


# ---------------------------------------------------------------- files


def _url_fs(url: str) -> tuple[Any, str]:
    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/") or root
    return fs, root


def _join(root: str, name: str) -> str:
    # `name` is always generated here (never from data); refuse anything path-like
    assert "/" not in name and "\\" not in name and name not in ("", ".", ".."), name
    return f"{root}/{name}" if not root.endswith("/") else root + name


def _names(fs: Any, root: str) -> list[str]:
    try:
        fs.invalidate_cache(root)
    except Exception:  # noqa: BLE001 - cache invalidation is best effort
        pass
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)


def _atomic_write(fs: Any, path: str, data: bytes) -> None:
    """Write under a hidden temporary name, fsync where possible, rename into place."""
    head, name = path.rsplit("/", 1)
    tmp = f"{head}/_tmp-{name}.{secrets.token_hex(6)}"
    try:
        with fs.open(tmp, "wb") as f:
            f.write(data)
            try:  # durable before visible (local disks); a remote store commits on close
                f.flush()
                os.fsync(f.fileno())
            except (AttributeError, OSError, ValueError, NotImplementedError, io.UnsupportedOperation):
                pass
        fs.mv(tmp, path)
    except BaseException:
        try:
            fs.rm(tmp)
        except Exception:  # noqa: BLE001 - best effort cleanup
            pass
        raise
    if isinstance(fs, LocalFileSystem):  # make the rename itself durable
        try:
            fd = os.open(head, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass


def fingerprint(config: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of a job's output-affecting configuration."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=_json_default)
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


def _load_manifest(fs: Any, root: str) -> dict | None:
    path = _join(root, MANIFEST)
    try:
        with fs.open(path, "rb") as f:
            m = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (ValueError, OSError) as e:
        raise OutputError(f"{path} is unreadable ({e}); it can't be resumed. Choose another "
                          "--output, or delete the directory yourself") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT_MARK:
        raise OutputError(f"{path} is not a jobrunner manifest; choose another --output")
    return m


_OURS_RE = re.compile(r"^(?:_manifest\.json|_stats\.json|_stats\.parquet|results\.openai\.jsonl"
                      r"|(?:_corrupt-(?:\d+-)?)?part[^/]*\.parquet|_tmp-.+)$")


def _output_fs(output_url: str) -> tuple[Any, str]:
    try:
        return _url_fs(output_url)
    except ImportError as e:  # fsspec's "Install s3fs to access S3"
        from jobrunner.dataset import missing_backend_message
        raise OutputError(missing_backend_message(output_url, e)) from None


def _entries(fs: Any, root: str) -> dict[str, str]:
    """name -> "file" | "directory" (or another type) of each entry of root."""
    try:
        fs.invalidate_cache(root)
    except Exception:  # noqa: BLE001 - cache invalidation is best effort
        pass
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("type", "file")
            for e in fs.ls(root, detail=True)}


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
    old = _load_manifest(fs, root) if MANIFEST in entries else None
    if old is None:
        if all(_MANIFEST_TMP_RE.match(n) for n in names):  # empty, or killed writing its first manifest
            return None, names
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
    foreign = [n for n in names if entries[n] != "file" or not _OURS_RE.match(n)]
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
    fs, root = _output_fs(output_url)
    _check_existing(fs, root, output_url, config, overwrite)
    try:
        fs.makedirs(root, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create the output directory {output_url}: {e}") from e


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
    fs, root = _output_fs(output_url)
    old, stale = _check_existing(fs, root, output_url, config, overwrite)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if old is not None and not overwrite:  # resume
        merged = {**old, **{k: v for k, v in manifest.items() if k != "config"}}
        merged.update(format=FORMAT_MARK, fingerprint=fp, created_at=old.get("created_at", now))
        return merged
    for n in stale:
        try:
            fs.rm(_join(root, n))
        except FileNotFoundError:
            pass
    fresh = {**manifest, "config": json.loads(to_json(config)), "format": FORMAT_MARK,
             "version": 1, "fingerprint": fp, "created_at": now, "updated_at": now,
             "parts": [], "complete": False}
    fs.makedirs(root, exist_ok=True)
    _atomic_write(fs, _join(root, MANIFEST), _manifest_bytes(fresh))
    return fresh


def _manifest_bytes(m: Mapping[str, Any]) -> bytes:
    return to_json_pretty(m).encode("utf-8", errors="replace")


def to_json_pretty(v: Any) -> str:
    try:
        return json.dumps(v, ensure_ascii=False, indent=2, default=_json_default)
    except (TypeError, ValueError):
        return json.dumps(_plain(v), ensure_ascii=False, indent=2, default=_json_default)


# ---------------------------------------------------------------- writer


class ResultWriter:
    """Buffers result rows and writes them as atomic, resumable parquet parts.

    Not thread-safe; one writer per process and part_prefix.
    """

    clock = staticmethod(time.monotonic)    # seconds; tests replace it

    def __init__(self, output_url: str, manifest: dict, part_rows: int = 10000,
                 overwrite: bool = False, part_prefix: str = "part", flush_seconds: float = 60.0):
        if part_rows < 1:
            raise ValueError("part_rows must be >= 1")
        if not flush_seconds > 0:
            raise ValueError("flush_seconds must be > 0")
        if not _PREFIX_RE.match(part_prefix):
            raise ValueError(f"part_prefix must look like 'part' or 'part-r1', got {part_prefix!r}")
        self.output_url = output_url
        self.part_rows = part_rows
        self.flush_seconds = flush_seconds
        self.part_prefix = part_prefix
        self.manifest = prepare_output(output_url, manifest, overwrite)
        self.fs, self.root = _url_fs(output_url)
        self._own_re = re.compile(rf"^(?:_corrupt-(?:\d+-)?)?{re.escape(part_prefix)}-(\d+)\.parquet$")
        self._tmp_re = re.compile(rf"^_tmp-{re.escape(part_prefix)}-\d+\.parquet\.[0-9a-f]+$")
        self._buffer: list[dict[str, Any]] = []
        self._oldest: float | None = None      # clock() when the oldest buffered row came; None: buffer empty
        self._ok_buffered = False               # a buffered row has no error (see maybe_flush)
        self._kinds: dict[str, str] | None = None
        self.done_ids = IdSet()         # ids in the parts found at open; see the module doc
        self.parts: list[str] = []      # all valid part files at open, plus ours since
        self.corrupt: list[str] = []    # parts set aside at open (new names)
        self._next = 0
        self._scan()

    # -- resume

    def _scan(self) -> None:
        """Read every part's id column; set damaged parts aside; find our next part number."""
        names = _names(self.fs, self.root)
        for name in names:
            # our own stale temp part from a killed run, or anyone's stale manifest temp
            # (a writer racing with this loses one informative manifest update, no data)
            if self._tmp_re.match(name) or _MANIFEST_TMP_RE.match(name):
                try:
                    self.fs.rm(_join(self.root, name))
                except FileNotFoundError:
                    pass
        for name in names:
            if not _PART_RE.match(name):
                continue
            ids, kinds = self._read_part_ids(name)
            if ids is None:
                self.corrupt.append(self._set_aside(name, names))
                continue
            self.done_ids.update(ids)
            self.parts.append(name)
            if self._kinds is None and kinds is not None:
                self._kinds = kinds
        seqs = [int(m.group(1)) for n in _names(self.fs, self.root) if (m := self._own_re.match(n))]
        self._next = max(seqs, default=-1) + 1

    def _read_part_ids(self, name: str) -> tuple[list[str] | None, dict[str, str] | None]:
        try:
            with self.fs.open(_join(self.root, name), "rb") as f:
                pf = pq.ParquetFile(f)
                ids = pf.read(columns=["id"], use_threads=False).column("id")
                if ids.null_count or len(ids) != pf.metadata.num_rows:
                    return None, None
                return [str(x) for x in ids.to_pylist()], _kinds_of(pf.schema_arrow)
        except FileNotFoundError:
            return [], None  # moved aside by another writer meanwhile
        except (pa.ArrowException, OSError, KeyError, ValueError, EOFError):
            return None, None

    def _set_aside(self, name: str, names: list[str]) -> str:
        new = f"_corrupt-{name}"
        k = 1
        while new in names:
            new, k = f"_corrupt-{k}-{name}", k + 1
        warnings.warn(f"{self.output_url}: part {name} is damaged; set aside as {new}, "
                      "its rows will be done again", RuntimeWarning, stacklevel=3)
        try:
            self.fs.mv(_join(self.root, name), _join(self.root, new))
        except FileNotFoundError:
            pass  # another writer set it aside first
        return new

    # -- writing

    def write(self, rows: list[dict]) -> None:
        """Buffer rows; flush a part once part_rows are buffered or the oldest has waited
        flush_seconds. One call's rows share a part."""
        self._buffer.extend(_norm_row(r) for r in rows)
        if self._buffer and self._oldest is None:
            self._oldest = self.clock()
        self._ok_buffered = self._ok_buffered or any(r.get("error") is None for r in rows)
        if len(self._buffer) >= self.part_rows:
            self.flush()
        else:
            self.maybe_flush()

    def maybe_flush(self) -> None:
        """Flush when the oldest buffered row has waited flush_seconds (cheap: call it often).

        The very first part waits for a row without an error: it pins the schema, which error rows
        alone would leave without the job's own columns (and error rows cost no work to redo).
        """
        if self._oldest is None or (self._kinds is None and not self._ok_buffered):
            return
        if self.clock() - self._oldest >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows as the next part (atomic), then update the manifest."""
        if not self._buffer:
            return
        rows = self._buffer
        if self._kinds is None:
            self._kinds = self._pinned_by_others() or self._infer(rows)
        table = _table(rows, self._kinds)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd", row_group_size=max(len(rows), 1))
        data = sink.getvalue().to_pybytes()
        name = f"{self.part_prefix}-{self._next:05d}.parquet"
        while self.fs.exists(_join(self.root, name)):  # never replace a part (another process?)
            self._next += 1
            name = f"{self.part_prefix}-{self._next:05d}.parquet"
        try:
            _atomic_write(self.fs, _join(self.root, name), data)
        except Exception as e:
            raise OutputError(f"writing {name} to {self.output_url} failed: {e}; rows written "
                              "before are safe and the job can be resumed") from e
        self._next += 1
        self._buffer, self._oldest, self._ok_buffered = [], None, False
        self.parts.append(name)
        self._update_manifest(complete=False)

    def _pinned_by_others(self) -> dict[str, str] | None:
        """Kinds of a part another writer wrote since we opened (shared directories)."""
        for name in _names(self.fs, self.root):
            if _PART_RE.match(name):
                try:
                    with self.fs.open(_join(self.root, name), "rb") as f:
                        kinds = _kinds_of(pq.read_schema(f))
                except (pa.ArrowException, OSError, ValueError):
                    continue
                if kinds:
                    return kinds
        return None

    @staticmethod
    def _infer(rows: list[dict[str, Any]]) -> dict[str, str]:
        kinds = dict(FIXED_COLUMNS)
        order: dict[str, None] = {}
        for r in rows:
            order.update(dict.fromkeys(k for k in r if k not in kinds and k != EXTRA_JSON))
        for name in order:
            kinds[name] = _infer_kind(name, [r.get(name) for r in rows])
        return kinds

    def _update_manifest(self, complete: bool) -> None:
        """Rewrite _manifest.json atomically; its parts list comes from the listing.

        A failure only warns: the manifest is informative, the part files are the truth.
        """
        self.manifest["parts"] = [n for n in _names(self.fs, self.root) if _PART_RE.match(n)]
        self.manifest["complete"] = complete
        self.manifest["updated_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            _atomic_write(self.fs, _join(self.root, MANIFEST), _manifest_bytes(self.manifest))
        except Exception as e:  # noqa: BLE001 - informative only: the listing is the truth
            warnings.warn(f"updating {MANIFEST} in {self.output_url} failed: {e}",
                          RuntimeWarning, stacklevel=3)

    def close(self, stats: dict | None = None) -> None:
        """Flush; with stats, write _stats.json/_stats.parquet and mark the job complete.

        Data-parallel workers close with stats=None; the launcher writes the stats.
        """
        self.flush()
        if stats is not None:
            write_stats(self.output_url, stats)
            self._update_manifest(complete=True)

    def write_stats(self, stats: Mapping[str, Any]) -> None:
        """_stats.json/_stats.parquet without marking the job complete (e.g. interrupted)."""
        write_stats(self.output_url, stats)

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.flush()  # keep what is done, even on an exception or interrupt


# ---------------------------------------------------------------- readers and extra outputs


Columns = list[str] | Callable[[list[str]], list[str]] | None


def _read_part(fs: Any, path: str, columns: Columns = None) -> pa.Table:
    """A part's table; columns: see iter_result_parts."""
    # ParquetFile, not pq.read_table: read_table goes through pyarrow.dataset, whose
    # threads reading a Python file object can abort the interpreter at exit.
    with fs.open(path, "rb") as f:
        pf = pq.ParquetFile(f)
        if columns is not None:
            names = pf.schema_arrow.names
            wanted = set(columns(names) if callable(columns) else columns)
            columns = [c for c in names if c in wanted]
        return pf.read(columns=columns, use_threads=False)


def _part_names(fs: Any, root: str) -> list[str]:
    if not fs.exists(root):
        raise OutputError(f"output not found: {root}")
    return [n for n in _names(fs, root) if _PART_RE.match(n)]


def iter_result_parts(output_url: str, columns: Columns = None) -> Iterator[pa.Table]:
    """Each readable part as a table (damaged ones are skipped with a warning).

    columns: None reads every column; a list reads those of them the part has; a function gets
    the part's column names and returns the ones to read.  Tables keep the part's schema metadata.
    """
    fs, root = _url_fs(output_url)
    for name in _part_names(fs, root):
        try:
            yield _read_part(fs, _join(root, name), columns)
        except FileNotFoundError:
            continue
        except (pa.ArrowException, OSError) as e:
            warnings.warn(f"skipping damaged part {name}: {e}", RuntimeWarning, stacklevel=2)


def read_results(output_url: str) -> pa.Table:
    """All result rows of an output directory as one table (parts in name order)."""
    tables = list(iter_result_parts(output_url))
    if not tables:
        return _schema(dict(FIXED_COLUMNS)).empty_table()
    return pa.concat_tables(tables, promote_options="permissive")


def stored_values(table: pa.Table, name: str) -> list[Any]:
    """A column's Python values as the rows gave them: JSON-kind cells decoded, and values that
    went to extra_json put back (also for a column the part's pinned schema lacks)."""
    n = table.num_rows
    values = table.column(name).to_pylist() if name in table.column_names else [None] * n
    if (_kinds_of(table.schema) or {}).get(name) == "json":
        values = [None if v is None else json.loads(v) for v in values]
    if EXTRA_JSON in table.column_names:
        for i, extra in enumerate(table.column(EXTRA_JSON).to_pylist()):
            if extra is not None and values[i] is None:
                values[i] = json.loads(extra).get(name)
    return values


def write_stats(output_url: str, stats: Mapping[str, Any]) -> None:
    """_stats.json (the dict) and _stats.parquet (one row; nested values as JSON strings)."""
    fs, root = _url_fs(output_url)
    _atomic_write(fs, _join(root, "_stats.json"), to_json_pretty(dict(stats)).encode("utf-8", "replace"))
    arrays, names = [], []
    for k, v in stats.items():
        value, kind = _stat_cell(v)
        arrays.append(_array([value], kind))
        names.append(_scrub(str(k)))
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_arrays(arrays, names=names), sink)
    _atomic_write(fs, _join(root, "_stats.parquet"), sink.getvalue().to_pybytes())


def _stat_cell(v: Any) -> tuple[Any, str]:
    """(value, kind) of one stats value: scalars keep their type, the rest is JSON text."""
    if isinstance(v, bool):
        return v, "bool"
    if _is_int(v):
        return int(v), "int"
    if _is_float(v) and not isinstance(v, numbers.Integral):
        return float(v), "float"
    if isinstance(v, str):
        return v, "string"
    return (None if v is None else to_json(v)), "string"


def read_stats(output_url: str) -> dict | None:
    """The job summary in _stats.json; None when the output has none yet (no run finished or was
    interrupted: jobrunner.summary computes one from the parts).  Raises OutputError when
    output_url holds no jobrunner output."""
    fs, root = _url_fs(output_url)
    try:
        with fs.open(_join(root, "_stats.json"), "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        pass
    names = _names(fs, root)
    if MANIFEST not in names and not any(_PART_RE.match(n) for n in names):
        raise OutputError(f"no jobrunner output at {output_url}")
    return None


def read_manifest(output_url: str) -> dict | None:
    """The output's _manifest.json; None when it has none, OutputError when it is unreadable."""
    fs, root = _url_fs(output_url)
    return _load_manifest(fs, root)


def _openai_record(rows: list[dict[str, Any]], model: str, created: int) -> dict:
    """One OpenAI batch output line for all result rows (samples) of one custom_id."""
    cid = rows[0]["id"]
    digest = hashlib.sha256(cid.encode("utf-8", errors="surrogatepass")).hexdigest()
    errors = [r.get("error") for r in rows if r.get("error")]
    if errors and len(errors) == len(rows):
        return {"id": f"batch_req_{digest[:24]}", "custom_id": cid, "response": None,
                "error": {"code": "row_error", "message": str(errors[0])}}
    ok = [r for r in rows if not r.get("error")]
    choices = [{"index": r["sample_index"] if _is_int(r.get("sample_index")) else i,
                "message": {"role": "assistant", "content": r.get("output")},
                "logprobs": None, "finish_reason": r.get("finish_reason")}
               for i, r in enumerate(ok)]
    prompt = int(ok[0].get("prompt_tokens") or 0)
    completion = sum(int(r.get("completion_tokens") or 0) for r in ok)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion,
             "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": int(ok[0].get("cached_tokens") or 0)}}
    body = {"id": f"chatcmpl-{digest[:24]}", "object": "chat.completion", "created": created,
            "model": model, "choices": choices, "usage": usage}
    return {"id": f"batch_req_{digest[:24]}", "custom_id": cid,
            "response": {"status_code": 200, "request_id": f"req_{digest[:24]}", "body": body},
            "error": None}


def write_openai_batch_output(output_url: str, rows: Iterable[Mapping[str, Any]] | None = None,
                              model: str | None = None, name: str = OPENAI_OUTPUT) -> str:
    """Write results in the OpenAI Batch output format (one JSON line per custom_id).

    rows: result rows; None reads all parts.  Consecutive rows with the same id
    (samples) become one line with several choices; a row whose every sample
    failed gets response=null and error={code, message}.  Returns the file's path.
    """
    fs, root = _url_fs(output_url)
    if model is None:
        m = _load_manifest(fs, root) or {}
        cfg = m.get("config") or {}
        model = str(cfg.get("model") or m.get("model") or "jobrunner")
    created = int(time.time())
    if rows is None:
        rows = (r for t in iter_result_parts(output_url) for r in t.to_pylist())
    path = _join(root, name)
    head, base = path.rsplit("/", 1)
    tmp = f"{head}/_tmp-{base}.{secrets.token_hex(6)}"
    try:
        with fs.open(tmp, "wb") as f:
            group: list[dict[str, Any]] = []
            for r in rows:
                r = _norm_row(r)
                if group and group[0]["id"] != r["id"]:
                    f.write((to_json(_openai_record(group, model, created)) + "\n").encode("utf-8", "replace"))
                    group = []
                group.append(r)
            if group:
                f.write((to_json(_openai_record(group, model, created)) + "\n").encode("utf-8", "replace"))
        fs.mv(tmp, path)
    except BaseException:
        try:
            fs.rm(tmp)
        except Exception:  # noqa: BLE001
            pass
        raise
    return path

