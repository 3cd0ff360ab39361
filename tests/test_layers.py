"""The package's import structure: imports go one way, down these layers, and no module
takes a private name from another package. Read from the source (every import statement,
also those inside functions), so a lazy import cannot hide a cycle."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "pintail"

# Lowest first: a unit imports only from units of lower layers (and from itself).
LAYERS = (
    ("_core", "reference"),
    ("_loss",),
    ("parallel",),
    ("cross_entropy", "softmax", "norm", "rotary", "gated", "log_probs", "distillation"),
    ("linear_cross_entropy",),
    ("nn", "transformers", "hub", "losses"),
    ("__init__",),
    ("bench_heads",),
    ("bench_rl",),
    ("bench", "__main__"),
)


def _module_name(path):
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module):
    """The top-level package or module of pintail a module belongs to ("__init__": pintail itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _exists(module):
    path = ROOT.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path):
    """(imported module, imported name or None) of every import statement in a file."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.startswith("pintail")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("pintail"):
                continue
            for alias in node.names:
                if _exists(f"{source}.{alias.name}"):
                    found.append((f"{source}.{alias.name}", None))
                else:
                    found.append((source, alias.name))
    return module, found


def _graph():
    return dict(_imports(path) for path in sorted(ROOT.rglob("*.py")))


def test_every_unit_has_a_layer():
    placed = {unit for layer in LAYERS for unit in layer}
    units = {_unit(module) for module in _graph()}
    assert units <= placed, f"units without a layer in LAYERS: {sorted(units - placed)}"


def test_imports_go_down_the_layers():
    layer_of = {unit: depth for depth, layer in enumerate(LAYERS) for unit in layer}
    upward = []
    for module, imports in _graph().items():
        for target, _ in imports:
            here, there = _unit(module), _unit(target)
            if here != there and layer_of[there] >= layer_of[here]:
                upward.append(f"{module} imports {target}")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_no_private_name_from_another_unit():
    private = [f"{module} imports {name} from {source}"
               for module, imports in _graph().items() for source, name in imports
               if name and name.startswith("_") and not name.startswith("__") and _unit(source) != _unit(module)]
    assert not private, "private names taken across packages:\n" + "\n".join(private)


def test_no_module_cycle():
    graph = {module: {target for target, _ in imports if target != module} for module, imports in _graph().items()}
    state = {}

    def visit(module, trail):
        if state.get(module) == "done":
            return
        if state.get(module) == "open":
            cycle = trail[trail.index(module):] + [module]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            visit(target, trail + [module])
        state[module] = "done"

    for module in sorted(graph):
        visit(module, [])


def test_the_walk_sees_lazy_imports(tmp_path, monkeypatch):
    """The checks above read imports inside functions too: a lazy upward import is caught."""
    package = tmp_path / "pintail"
    (package / "_loss").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "_loss" / "__init__.py").write_text("")
    (package / "cross_entropy.py").write_text("from ._loss import _helper\n")
    (package / "_loss" / "low.py").write_text("def f():\n    from ..cross_entropy import cross_entropy\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", package)
    with pytest.raises(AssertionError, match="_loss.low imports pintail.cross_entropy"):
        test_imports_go_down_the_layers()
    with pytest.raises(AssertionError, match="imports _helper from pintail._loss"):
        test_no_private_name_from_another_unit()
