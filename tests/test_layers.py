"""The floors hold: import-linter's contracts (pyproject.toml) pass on the tree, and fail on a wrong import."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("benchmarks", "jobrunner", "jobs", "engine", "kernels")
LINT = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")


def _copy_tree(dst: Path) -> Path:
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__", "results"))
    shutil.copy(REPO / "pyproject.toml", dst / "pyproject.toml")
    return dst


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(root), "PATH": str(Path(sys.executable).parent)}
    return subprocess.run([LINT, "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    if LINT is None:
        pytest.fail("lint-imports is not installed: pip install -e '.[test]'")
    return _copy_tree(tmp_path_factory.mktemp("tree"))


def test_the_tree_keeps_every_contract(tree):
    r = _lint(tree)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "0 broken" in r.stdout


@pytest.mark.parametrize("module, source, contract", [
    ("jobs/_bad.py", "import jobrunner.config.job\n", "Layers"),
    ("engine/_bad.py", "from jobs import RowError\n", "Layers"),
    ("kernels/_bad.py", "import jobrunner.engine.schedule.sequence\n", "Layers"),
    ("jobs/_bad.py", "import torch\n", "free of torch"),
    ("engine/_bad_sched.py", "", "free of torch"),
    ("engine/_bad.py", "from jobrunner.kernels.attention.attention import store_kv\n", "public names"),
    ("kernels/_bad.py", "import subprocess\n", "Kernels are functions"),
    # every engine submodule, those the list once missed and subpackages' modules included (a wildcard)
    ("jobs/_bad.py", "from engine import host_memory\n", "use the engine only through"),
    ("jobs/_bad.py", "import jobrunner.engine.lora.adapter\n", "use the engine only through"),
])
def test_a_wrong_import_breaks_its_contract(tree, tmp_path, module, source, contract):
    root = _copy_tree(tmp_path / "t")
    if module == "engine/_bad_sched.py":        # torch reaching the scheduler
        path = root / "engine" / "scheduler.py"
        path.write_text("import torch\n" + path.read_text())
    else:
        (root / module).write_text(source)
    r = _lint(root)
    assert r.returncode != 0, r.stdout[-2000:]
    broken = r.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, r.stdout[-3000:]


def test_no_module_of_kernels_imports_one_that_imports_it_back():
    """The kernels' modules form no circle (shared helpers live in modules that import neither side),
    lazy imports inside functions included."""
    import grimp
    graph = grimp.build_graph("kernels")
    circles = [(a, b) for a in sorted(graph.modules) for b in sorted(graph.find_modules_directly_imported_by(a))
               if a < b and graph.chain_exists(importer=b, imported=a)]
    assert not circles, circles
