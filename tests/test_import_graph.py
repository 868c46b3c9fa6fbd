"""The package's imports run one way: no cycle (function-level imports included), and the layers of
docs/DESIGN.md ("Import rule") hold: runtime below speculative below pipeline below the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "specdec_edge"


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


ABOVE_SPECULATIVE = ("api", "cli", "bench", "export", "demo")


def test_layers_import_downwards_only():
    graph = import_graph()
    above = {
        "specdec_edge.runtime": ("speculative", *ABOVE_SPECULATIVE),
        "specdec_edge.speculative": ABOVE_SPECULATIVE,
        "specdec_edge.bundle": ("runtime", "speculative", "api", "export"),
    }
    for module, edges in graph.items():
        for layer, forbidden in above.items():
            if module == layer or module.startswith(layer + "."):
                bad = [e for e in edges if e.split(".")[1] in forbidden]
                assert not bad, f"{module} imports {bad}, a layer above it"


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
