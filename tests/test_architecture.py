"""The layering docs/ARCHITECTURE.md describes: no module imports a higher layer, and no import cycles;
and the parts of that document that name code still name it: the layer table (every part's layer,
every module) and "How to add a drafter" (every method a drafter implements)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import mmspec_cli

PACKAGE = Path(mmspec_cli.__file__).resolve().parent
DOC = PACKAGE.parent / "docs" / "ARCHITECTURE.md"

#: Layer of each top-level part of mmspec_cli, lowest first (docs/ARCHITECTURE.md, "Layers").
#: A module may import its own part and any lower layer; parts on one layer don't import each other.
LAYERS = {
    "errors": 0, "choices": 0,
    "models": 1, "images": 2,  # images: the README's alias of models.images
    "decoding": 2, "demo": 2,
    "drafters": 3, "inputs": 3,
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


# --------------------------------------------------------------------------- docs/ARCHITECTURE.md


def section(title: str) -> str:
    """The text of the ``## title`` section of docs/ARCHITECTURE.md."""
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def layer_table() -> dict[str, tuple[int, str]]:
    """{part: (layer, what its row says)} from the "Layers" table; a part is a folder (``models/`` -> models) or
    a top-level module (``api.py`` -> api), as in ``LAYERS``."""
    rows = {}
    for line in section("Layers").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            for name in re.findall(r"`([^`]+)`", cells[1]):
                rows[name.removesuffix("/").removesuffix(".py")] = (int(cells[0]), cells[2])
    return rows


def test_the_layer_table_gives_every_part_the_layer_the_import_check_uses():
    assert {part: layer for part, (layer, _) in layer_table().items()} == LAYERS


def test_the_layer_table_names_every_module_in_its_parts_row():
    table = layer_table()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if path.name == "__init__.py" or len(relative.parts) == 1:  # a top-level module is a part of its own
            continue
        inside = "/".join(relative.parts[1:])  # e.g. `plain.py` in the drafters/ row, `training/build.py` in demo/'s
        if f"`{inside}`" not in table[relative.parts[0]][1]:
            missing.append(f"`{inside}` in the {relative.parts[0]}/ row")
    assert not missing, "docs/ARCHITECTURE.md's layer table should name " + ", ".join(missing)


def hooks(cls) -> set[str]:
    """Methods ``cls`` leaves to its subclasses: bodies that are only a docstring, ``pass`` or ``raise NotImplementedError``."""
    source = ast.parse(Path(sys.modules[cls.__module__].__file__).read_text())
    [node] = [n for n in source.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
    found = set()
    for method in node.body:
        if isinstance(method, ast.FunctionDef):
            body = [s for s in method.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if all(isinstance(s, ast.Pass) or (isinstance(s, ast.Raise) and "NotImplementedError" in ast.unparse(s))
                   for s in body):
                found.add(method.name)
    return found


def defined_names() -> set[str]:
    """Every function, class, method, attribute and module-level name mmspec_cli defines."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_the_drafter_contract_has_six_members():
    """What the engine asks of a drafter: a name, its declared traits, and four verbs of the block."""
    from mmspec_cli.decoding.drafter import Drafter

    members = {name for name in vars(Drafter) if not name.startswith("_")} | set(Drafter.__annotations__)
    assert members == {"name", "traits", "begin_turn", "propose", "roll_back", "observe"}


def test_how_to_add_a_drafter_names_every_method_a_drafter_implements_and_nothing_that_is_gone():
    from mmspec_cli.decoding.drafter import Drafter
    from mmspec_cli.drafters.tree_drafting import TreeStep

    text = section("How to add a drafter")
    named = set(re.findall(r"`(\w+)(?:\(\))?`", text))
    needed = (set(Drafter.__abstractmethods__) | hooks(Drafter) | set(TreeStep.__dataclass_fields__)
              | {"TreeDrafts", "DraftStep", "draft_chain", "DrafterTraits", "TurnStart", "Kept", "DraftShape"})
    assert {"begin_turn", "propose", "roll_back", "observe", "root", "level", "keep", "done"} <= needed
    assert needed <= named, f"'How to add a drafter' should name {sorted(needed - named)}"
    gone = named - defined_names()
    assert not gone, f"'How to add a drafter' names {sorted(gone)}, which mmspec_cli no longer defines"
