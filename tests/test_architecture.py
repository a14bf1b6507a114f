"""The layering docs/ARCHITECTURE.md describes: no module imports a higher layer, and no import cycles."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import mmspec_cli

PACKAGE = Path(mmspec_cli.__file__).resolve().parent

#: Layer of each top-level part of mmspec_cli, lowest first (docs/ARCHITECTURE.md, "Layers").
#: A module may import its own part and any lower layer; parts on one layer don't import each other.
LAYERS = {
    "errors": 0, "choices": 0,
    "models": 1, "images": 2,  # images: the README's alias of models.images
    "decoding": 2, "demo": 2,
    "drafters": 3,
    "api": 4,
    "bench": 5,
    "selectlayer": 6, "training": 6,
    "cli": 7,
    "__main__": 8,  # python -m mmspec_cli
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every mmspec_cli module ``path`` imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mmspec_cli"):
            assert node.level == 0, f"{path}: relative import"
            for alias in node.names:  # ``from mmspec_cli.bench import latency`` imports a module
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists()
                          else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("mmspec_cli"))
    return found


def part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}


def test_no_module_imports_a_higher_layer():
    wrong = []
    for module, used in graph().items():
        if not part(module) or part(module) == "__init__":
            continue
        for other in used:
            if part(other) and part(other) != part(module) and LAYERS[part(other)] >= LAYERS[part(module)]:
                wrong.append(f"{module} imports {other}")
    assert not wrong, "\n".join(sorted(wrong))
    assert set(LAYERS) >= {part(m) for m in graph() if part(m)} - {"__init__"}, "a new part needs a layer"


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        for other in edges.get(module, ()):
            if other not in edges:
                continue
            if state.get(other) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(other):] + [module, other]))
            if other not in state:
                visit(other, stack + [module])
        state[module] = 2

    for module in edges:
        if module not in state:
            visit(module, [])


def test_the_command_line_and_the_facts_import_no_torch():
    code = ("import sys, mmspec_cli.cli.app, mmspec_cli.choices, mmspec_cli.models.profiles, mmspec_cli.bench.peers; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
