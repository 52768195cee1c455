"""What the CLI job tests share: a JSONL dataset from rows, and `jobrunner submit` with its results."""
from __future__ import annotations

import json

from click.testing import CliRunner

from jobrunner.cli.main import main
from jobrunner.output import read_results


def jsonl(path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def submit(tmp_path, ds, *args, out="out"):
    """(the click result, the output's rows as dicts, or None when the job did not exit 0)."""
    r = CliRunner().invoke(main, ["submit", ds, "-o", str(tmp_path / out), *args])
    rows = read_results(str(tmp_path / out)).to_pylist() if r.exit_code == 0 else None
    return r, rows
