"""The limits the house keeps, so a later feature cannot regrow them: no module of the four installed
folders over 400 lines, no function over 60 (Triton `@jit` kernels aside: one kernel is one launch);
no two modules of one folder tree with the same name."""
import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDERS = ("jobrunner", "engine", "kernels", "jobs")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules():
    for folder in FOLDERS:
        yield from sorted((REPO / folder).rglob("*.py"))


def _is_triton_kernel(node: ast.AST) -> bool:
    return any("jit" in ast.unparse(d) for d in getattr(node, "decorator_list", ()))


def test_no_module_over_its_limit():
    long = {str(p.relative_to(REPO)): n for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_over_its_limit():
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_two_modules_of_one_folder_tree_share_a_name():
    """Within jobrunner/, engine/, kernels/ and jobs/ each module name means one thing."""
    for folder in FOLDERS:
        seen = defaultdict(list)
        for path in (REPO / folder).rglob("*.py"):
            if path.name != "__init__.py":
                seen[path.stem].append(str(path.relative_to(REPO)))
        repeated = {name: paths for name, paths in seen.items() if len(paths) > 1}
        assert not repeated, repeated
