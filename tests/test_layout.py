"""The house rules of docs/design.md's layout, read from the code's own module-level imports: no
folder holds more than 20 modules, the random-access layer imports neither the iterator layer nor the
corpora at module level, and no module-level import cycle grows past three modules."""

import pytest
import ast
import pathlib

import portable_loader

ROOT = pathlib.Path(portable_loader.__file__).parent
MAX_MODULES = 20
MAX_CYCLE = 3
#: docs/design.md's layers, lowest first: a module imports its own or lower layers at module level.
LAYERS = [
    ["errors", "indexing", "lifecycle", "digests"],
    ["orders", "io", "tokenize", "collate", "batch_size"],
    ["cache", "record_options"],
    ["plan", "step_plans", "batch_spec", "state"],
    ["engine"],
    ["dataset"],
    ["corpora", "dataset.iter"],
    ["loader", "grain", "precache", "adapters", "sample", "command_line", "__main__", ""],
]


def _name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_level_imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    # Only statements run at import: the body of the module and of its top-level if/try blocks
    # (not `if TYPE_CHECKING:`), never a function's body.
    found, todo = set(), list(ast.parse(path.read_text()).body)
    package = _name(path) if path.name == "__init__.py" else _name(path).rpartition(".")[0]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
        elif isinstance(node, (ast.If, ast.Try)):
            todo.extend(node.body + node.orelse + getattr(node, "finalbody", []))
            todo.extend(s for h in getattr(node, "handlers", []) for s in h.body)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from package import module` runs that module; `from module import name` runs the module.
            subs = {f"{base}.{a.name}" for a in node.names} & modules
            found.update(subs if len(subs) == len(node.names) else subs | {base})
    return found & modules


def _graph() -> dict[str, set[str]]:
    files = {_name(p): p for p in ROOT.rglob("*.py")}
    return {name: _module_level_imports(path, set(files)) - {name} for name, path in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    # Tarjan's strongly connected components; a component of more than one module is a cycle.
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_folder_holds_more_than_twenty_modules():
    for folder in [ROOT, *(p for p in ROOT.rglob("*") if p.is_dir() and (p / "__init__.py").exists())]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= MAX_MODULES, (folder, len(modules))


def _layer(module: str) -> int:
    # The longest listed name that is the module or one of its packages decides ("" is the package itself).
    rest = module.removeprefix("portable_loader").removeprefix(".")
    found = [(len(n), i) for i, names in enumerate(LAYERS) for n in names
             if rest == n or rest.startswith(n + ".") or (n == "" and rest == "")]
    assert found, f"{module} is in no layer of LAYERS: add it (and to docs/design.md)"
    return max(found)[1]


@pytest.mark.slow
def test_every_module_imports_only_its_own_or_lower_layers_at_module_level():
    graph = _graph()
    upward = sorted((m, d) for m, deps in graph.items() for d in deps if _layer(d) > _layer(m))
    assert not upward, upward


@pytest.mark.slow
def test_the_random_access_layer_imports_neither_iterators_nor_corpora():
    graph = _graph()
    layer = [m for m in graph if m.startswith("portable_loader.dataset")
             and not m.startswith(("portable_loader.dataset.iter", "portable_loader.dataset.mix"))]
    assert "portable_loader.dataset.base" in layer and "portable_loader.dataset.transforms" in layer
    for module in layer:
        bad = {m for m in graph[module] if m.startswith(("portable_loader.dataset.iter", "portable_loader.corpora"))}
        assert not bad, (module, bad)


def test_orders_import_no_dataset():
    graph = _graph()
    for module in (m for m in graph if m.startswith("portable_loader.orders")):
        assert not {m for m in graph[module] if m.startswith(("portable_loader.dataset", "portable_loader.corpora"))}


def test_no_module_level_import_cycle_is_larger_than_three_modules():
    assert all(len(c) <= MAX_CYCLE for c in _cycles(_graph())), _cycles(_graph())


def test_the_cycle_finder_sees_a_cycle():
    # The check above must be able to fail: a made-up graph with a four-module loop.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"d"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [{"a", "b", "c", "d"}]
