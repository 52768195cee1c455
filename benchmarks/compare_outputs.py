"""Diff two jobrunner output directories (or two parents of several), every column but timings.

    python benchmarks/compare_outputs.py /tmp/house_before /tmp/house_after

Rows are matched by (id, sample_index); timing columns (queue_s, prefill_s, decode_s) and the
manifest's and _stats.json's clocks are left out. Exit 1 on any difference."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

TIMING = {"queue_s", "prefill_s", "decode_s"}


def _rows(out: Path) -> list[dict]:
    rows = []
    for part in sorted(out.glob("part*.parquet")):
        rows += pq.read_table(part).to_pylist()
    for r in rows:
        for k in TIMING:
            r.pop(k, None)
    return sorted(rows, key=lambda r: (str(r["id"]), r.get("sample_index") or 0))


def _openai_lines(out: Path) -> list:
    lines = []
    for f in sorted(out.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            d = json.loads(line)
            d.pop("id", None)           # a random batch request id
            if isinstance(d.get("response"), dict):
                d["response"].pop("request_id", None)
                body = d["response"].get("body") or {}
                for k in ("id", "created"):
                    body.pop(k, None)
            lines.append(d)
    return sorted(lines, key=lambda d: json.dumps(d, sort_keys=True))


def _config(out: Path) -> dict:
    m = json.loads((out / "_manifest.json").read_text()) if (out / "_manifest.json").exists() else {}
    return {k: m.get(k) for k in ("config", "sampling", "dataset_format", "model_source")}


def compare(a: Path, b: Path) -> list[str]:
    diffs = []
    ra, rb = _rows(a), _rows(b)
    if len(ra) != len(rb):
        diffs.append(f"{a.name}: {len(ra)} rows vs {len(rb)}")
    for x, y in zip(ra, rb):
        if x != y:
            keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
            diffs.append(f"{a.name} row {x.get('id')}: {', '.join(f'{k}: {x.get(k)!r} != {y.get(k)!r}' for k in keys)}")
    if _openai_lines(a) != _openai_lines(b):
        diffs.append(f"{a.name}: OpenAI output lines differ")
    if _config(a) != _config(b):
        diffs.append(f"{a.name}: manifest config differs: {_config(a)} vs {_config(b)}")
    return diffs


def main(a: str, b: str) -> int:
    a_dir, b_dir = Path(a), Path(b)
    pairs = [(a_dir, b_dir)] if list(a_dir.glob("part*.parquet")) else \
        [(d, b_dir / d.name) for d in sorted(a_dir.iterdir()) if d.is_dir()]
    diffs = []
    for x, y in pairs:
        if not y.is_dir():
            diffs.append(f"{y} missing")
            continue
        found = compare(x, y)
        print(f"{x.name}: {'same' if not found else f'{len(found)} differences'} ({len(_rows(x))} rows)")
        diffs += found
    for d in diffs:
        print(d)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
