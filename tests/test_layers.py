"""The package's layers hold (issue 12, item 8): imports point down (core is the IR and
imports nothing above it; capture turns calls into traces and knows no executors or jit;
transforms and executors know no jit; testing helpers may use anything), and no module
outgrows its line budget."""

import ast
from pathlib import Path

import dtcompile

PACKAGE = Path(dtcompile.__file__).parent
# For each layer, the layers it must not import.
FORBIDDEN = {
    "core": {"capture", "transforms", "executors", "jit", "testing"},
    "capture": {"transforms", "executors", "jit", "testing"},
    "transforms": {"capture", "executors", "jit", "testing"},
    "executors": {"capture", "jit", "testing"},
    "jit": {"testing"},
}


def _imported_layers(path: Path) -> set[str]:
    """The dtcompile layers a module imports (relative or absolute imports)."""
    module_parts = path.relative_to(PACKAGE).with_suffix("").parts
    layers = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(module_parts[: len(module_parts) - node.level])
                target = base + (node.module.split(".") if node.module else [])
                names = [target] if node.module else [base + [alias.name] for alias in node.names]
            elif node.module and node.module.startswith("dtcompile."):
                names = [node.module.split(".")[1:]]
            else:
                continue
            layers.update(name[0] for name in names if name)
        elif isinstance(node, ast.Import):
            layers.update(a.name.split(".")[1] for a in node.names if a.name.startswith("dtcompile."))
    return layers


def test_imports_point_down_the_layers():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        layer = parts[0] if len(parts) > 1 else None
        for imported in _imported_layers(path) & FORBIDDEN.get(layer, set()):
            wrong.append(f"{path.relative_to(PACKAGE)} imports {imported}")
    assert not wrong, wrong


def test_the_layer_check_sees_relative_and_absolute_imports(tmp_path):
    assert _imported_layers(PACKAGE / "jit" / "compiled.py") >= {"capture", "core", "executors", "transforms"}
    assert _imported_layers(PACKAGE / "capture" / "tracer.py") >= {"core"}


LINE_BUDGET = 400


def test_no_module_is_over_the_line_budget():
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > LINE_BUDGET
    }
    assert not long, f"modules over {LINE_BUDGET} lines (split them by what they own): {long}"
