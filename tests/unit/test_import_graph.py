"""The package's imports run one way: no cycle (function-level imports included), and the wings of
docs/DESIGN.md ("Layout") import downwards only: cli above bench and serve, above api, above speculative, above
runtime, above bundle, above the ground floor; export above api and bundle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "specdec_edge"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its file (``a.b`` for ``from a import b``
    when ``a.b`` is a module, else ``a``)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*here.split(".")[: len(here.split(".")) - node.level + 1], *filter(None, [base])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):  # a module's own package
                    edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 30 and "specdec_edge.speculative.methods" in graph
    assert cycles(graph) == []


def test_cycle_detection_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


GROUND = ("errors", "values", "atomic", "user_cache", "progress", "exactness", "tokenizer", "sampling")
# What each wing may import besides its own modules and the ground floor (docs/DESIGN.md, "Layout"):
# cli -> (bench | serve) -> api -> speculative -> runtime -> bundle -> ground; export -> (api) -> bundle.
BELOW = {
    "bundle": set(),
    "runtime": {"bundle"},
    "speculative": {"runtime", "bundle"},
    "api": {"speculative", "runtime", "bundle"},
    "bench": {"api", "speculative", "runtime", "bundle"},
    "serve": {"api", "speculative", "runtime", "bundle"},
    "export": {"api", "speculative", "runtime", "bundle"},
    "cli": {"bench", "serve", "export", "api", "speculative", "runtime", "bundle"},
}


def wing(module: str) -> str:
    """The wing (or "ground") a module of the package belongs to."""
    part = module.split(".")[1]
    return "ground" if part in GROUND else part


def test_the_top_level_holds_only_the_ground_floor_and_the_wings():
    files = {p.stem for p in PACKAGE.glob("*.py")}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert files == {"__init__", *GROUND}
    assert folders == {"data", *BELOW}


def upward_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, import) pairs where a module imports a wing above its own."""
    bad = []
    for module, edges in graph.items():
        if module == "specdec_edge":
            continue  # the package's own lazy ``Pipeline``
        here = wing(module)
        allowed = {"ground"} if here == "ground" else {"ground", here, *BELOW[here]}
        bad += sorted((module, e) for e in edges if e != "specdec_edge" and wing(e) not in allowed)
    return bad


def test_wings_import_downwards_only():
    assert upward_arrows(import_graph()) == []


def test_the_direction_check_finds_an_arrow_upwards():
    graph = {
        "specdec_edge.runtime.base": {"specdec_edge.errors", "specdec_edge.bundle.schema"},
        "specdec_edge.runtime.factory": {"specdec_edge.api.pipeline"},
        "specdec_edge.export.corpus": {"specdec_edge.api.pipeline", "specdec_edge.cli.run"},
        "specdec_edge.sampling": {"specdec_edge.values", "specdec_edge.speculative.loop"},
    }
    assert upward_arrows(graph) == [
        ("specdec_edge.runtime.factory", "specdec_edge.api.pipeline"),
        ("specdec_edge.export.corpus", "specdec_edge.cli.run"),
        ("specdec_edge.sampling", "specdec_edge.speculative.loop"),
    ]


def test_the_server_is_a_client_of_the_pipeline():
    """specdec_edge.serve reaches the engines and the loop only through Pipeline (docs/DESIGN.md); besides it, only
    the errors, text streaming, the tokenizer's message limit and the value checks."""
    graph = import_graph()
    allowed = {"specdec_edge.errors", "specdec_edge.api.streaming", "specdec_edge.api.pipeline",
               "specdec_edge.tokenizer", "specdec_edge.values"}  # fmt: skip
    serve = {name: edges for name, edges in graph.items() if name.startswith("specdec_edge.serve")}
    assert len(serve) >= 4
    for name, edges in serve.items():
        bad = [e for e in edges if not e.startswith("specdec_edge.serve") and e not in allowed]
        assert not bad, f"{name} imports {bad}: the server may use only {sorted(allowed)}"
    for name, edges in graph.items():
        if not name.startswith(("specdec_edge.serve", "specdec_edge.cli")):
            assert not [e for e in edges if e.startswith("specdec_edge.serve")], f"{name} imports the server"
