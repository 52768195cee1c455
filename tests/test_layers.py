"""The house holds: import-linter's contracts (pyproject.toml) pass on the installed layout and fail on a
wrong import; no folder imports one that imports it back, nor one above it; no module of the kernels
imports one that imports it back; the product's layer names every module of jobrunner/; every file a
kernel compiles at run time (C sources, headers) and every data file is in the installed package."""
import re
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floors import REPO, assemble, import_graph, lint  # noqa: E402


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return assemble(tmp_path_factory.mktemp("tree"))


@pytest.fixture(scope="module")
def graph(tree) -> dict[str, list[str]]:
    pytest.importorskip("grimp")
    return import_graph(tree)


def test_the_tree_keeps_every_contract(tree):
    r = lint(tree)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "0 broken" in r.stdout


@pytest.mark.parametrize("module, source, contract", [
    ("jobrunner/jobs/_bad.py", "import jobrunner.config.job\n", "Layers"),
    ("jobrunner/engine/_bad.py", "from jobrunner.jobs import RowError\n", "Layers"),
    ("jobrunner/kernels/_bad.py", "import jobrunner.engine.schedule.sequence\n", "Layers"),
    ("jobrunner/output/_bad.py", "import benchmarks.peers\n", "Benchmarks stay above"),
    ("jobrunner/jobs/_bad.py", "import torch\n", "stay free"),
    ("scheduler", "", "stay free"),
    ("jobrunner/engine/_bad.py", "from jobrunner.kernels.attention.attention import store_kv\n", "public names"),
    ("jobrunner/kernels/_bad.py", "import subprocess\n", "Kernels are functions"),
    # every engine submodule, subpackages' modules included (a wildcard)
    ("jobrunner/jobs/_bad.py", "from jobrunner.engine.run import host_memory\n", "use the engine only through"),
    ("jobrunner/pipeline/_bad.py", "import jobrunner.engine.lora.adapter\n", "use the engine only through"),
])
def test_a_wrong_import_breaks_its_contract(tmp_path, module, source, contract):
    root = assemble(tmp_path / "t")
    if module == "scheduler":        # torch reaching the scheduler
        path = root / "jobrunner" / "engine" / "schedule" / "scheduler.py"
        path.write_text("import torch\n" + path.read_text())
    else:
        (root / module).write_text(source)
    r = lint(root)
    assert r.returncode != 0, r.stdout[-2000:]
    broken = r.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, r.stdout[-3000:]


def test_every_kernel_source_is_package_data():
    """A non-editable install (a wheel) holds only the package data pyproject names: a C source or header left
    out builds no kernel there (each falls back to its slow path with a warning)."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for path in [*REPO.glob("kernels/*/*.c"), *REPO.glob("kernels/*/*.h"), *REPO.glob("jobrunner/*/*.txt")]:
        package = ("jobrunner.kernels." if path.parts[-3] == "kernels" else "jobrunner.") + path.parent.name
        assert any(path.match(pattern) for pattern in data.get(package, [])), f"{path} is not in {package}'s data"


def test_the_product_layer_names_every_module_of_jobrunner():
    """A new module or folder of jobrunner/ must take its place in the floors, or no contract sees it."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in config if c["type"] == "layers")
    product = set(re.split(r"\s*[:|]\s*", layers["layers"][0]))
    on_disk = {p.stem for p in (REPO / "jobrunner").glob("*.py") if p.stem != "__init__"}
    on_disk |= {p.parent.name for p in (REPO / "jobrunner").glob("*/__init__.py")}
    assert product == on_disk
    public = next(c for c in config if c["name"].startswith("The product and jobs use the engine"))
    assert set(public["source_modules"]) == {f"jobrunner.{m}" for m in on_disk} | {"jobrunner.jobs"}


def _folder(packages: set[str], module: str) -> str:
    """A module's folder: a package stands for its own folder, a module for the one it sits in."""
    return module if module in packages else module.rpartition(".")[0]


def _folder_edges(graph: dict[str, list[str]]) -> dict[str, dict[str, tuple[str, str]]]:
    packages = {m.rpartition(".")[0] for m in graph}
    edges: dict[str, dict[str, tuple[str, str]]] = defaultdict(dict)
    for a, imported in graph.items():
        for b in imported:
            fa, fb = _folder(packages, a), _folder(packages, b)
            if fa != fb and b.startswith("jobrunner"):
                edges[fa].setdefault(fb, (a, b))
    return edges


def test_no_folder_imports_one_above_it(graph):
    """Subfolders hold what their parent's modules build on, never the reverse: a parent folder's
    modules may import its subfolders, a subfolder imports no module of a folder above it."""
    up = [example for fa, out in _folder_edges(graph).items() for fb, example in out.items()
          if fa.startswith(fb + ".")]
    assert not up, up


def test_no_folder_imports_one_that_imports_it_back(graph):
    """The folders form no circle, lazy imports inside functions included."""
    edges = _folder_edges(graph)
    state: dict[str, int] = {}
    circle: list[str] = []

    def visit(node: str, path: list[str]) -> bool:
        state[node] = 1
        for nxt in edges.get(node, {}):
            if state.get(nxt) == 1:
                circle.extend(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
                return True
            if nxt not in state and visit(nxt, path + [nxt]):
                return True
        state[node] = 2
        return False

    for start in sorted(edges):
        if start not in state and visit(start, [start]):
            break
    assert not circle, " -> ".join(circle)


def test_no_module_of_kernels_imports_one_that_imports_it_back(graph):
    """The kernels' modules form no circle (shared helpers live in modules that import neither side),
    lazy imports inside functions included."""
    kernels = {m: {b for b in graph[m] if b.startswith("jobrunner.kernels")}
               for m in graph if m.startswith("jobrunner.kernels")}

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            m = todo.pop()
            if m == b:
                return True
            if m not in seen:
                seen.add(m)
                todo.extend(kernels.get(m, ()))
        return False

    circles = [(a, b) for a in sorted(kernels) for b in sorted(kernels[a]) if a < b and reaches(b, a)]
    assert not circles, circles
