"""The installed layout assembled from the checkout, for tools that find a package's modules by walking
its folder (import-linter, grimp): jobrunner/ with engine/, kernels/ and jobs/ copied under it, as
setup.py maps them, and benchmarks/ beside it.

    python tests/floors.py        # lint-imports over that tree (.ci/run); exit 1 when a contract breaks
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAPPED = {"engine": "jobrunner/engine", "kernels": "jobrunner/kernels", "jobs": "jobrunner/jobs"}
IGNORE = shutil.ignore_patterns("__pycache__", "results", "*.pyc")


def assemble(dst: Path, repo: Path = REPO) -> Path:
    """dst/jobrunner (the product with its mapped folders) and dst/benchmarks; returns dst."""
    shutil.copytree(repo / "jobrunner", dst / "jobrunner", ignore=IGNORE)
    for folder, target in MAPPED.items():
        shutil.copytree(repo / folder, dst / target, ignore=IGNORE)
        (dst / target / "__init__.py").touch()      # kernels/ has none (kernels/ops.py says why); grimp wants one
    shutil.copytree(repo / "benchmarks", dst / "benchmarks", ignore=IGNORE)
    shutil.copy(repo / "pyproject.toml", dst / "pyproject.toml")
    return dst


def lint(root: Path) -> subprocess.CompletedProcess:
    """lint-imports over an assembled tree, with nothing but that tree on the path."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        raise SystemExit("lint-imports is not installed: pip install -e '.[test]'")
    env = {"PYTHONPATH": str(root), "PATH": str(Path(sys.executable).parent)}
    return subprocess.run([exe, "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


_EDGES = """
import json, grimp
g = grimp.build_graph("jobrunner")
print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))
"""


def import_graph(root: Path) -> dict[str, list[str]]:
    """Each module of the assembled tree's jobrunner -> the modules it imports (lazy imports included), read by
    grimp in a fresh interpreter, so that no jobrunner imported already (the checkout's) stands in for the tree's."""
    env = {"PYTHONPATH": str(root), "PATH": str(Path(sys.executable).parent)}
    out = subprocess.run([sys.executable, "-c", _EDGES], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        result = lint(assemble(Path(tmp)))
    print(result.stdout[-6000:], result.stderr[-3000:], sep="")
    sys.exit(result.returncode)
