"""The package's shape stays readable: no function over 100 lines, none over 8 parameters (wider calls take a
settings object: ``GpuOptions``, ``LoadSettings``, ``loop.Call``, ...) except click commands, whose parameters are
their options; and every engine the decode loop drives offers the whole engine contract (``runtime.base.Engine``).

Parameters are the named ones, ``self``/``cls`` not counted; ``*args``/``**keywords`` are not counted either: where
a call takes them (``decode``, ``run_sessions``, ``Pipeline.load``) they are the fields of its settings object.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "specdec_edge"
MAX_LINES = 100
MAX_PARAMETERS = 8


def is_click_command(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated ``@click.command``, ``@click.group`` or ``@<group>.command`` (called or not)."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr in ("command", "group"):
            return True
    return False


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Named parameters (positional-only, positional, keyword-only), without a leading ``self``/``cls``."""
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    return len(names) - (1 if names and names[0] in ("self", "cls") else 0)


def problems(source: str, where: str = "<source>") -> list[str]:
    """``where:line name`` and what is wrong, for every function or method in ``source`` (nested ones too) that is
    over ``MAX_LINES`` lines (from its ``def`` to its last line) or over ``MAX_PARAMETERS`` parameters."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_LINES:
            found.append(f"{where}:{node.lineno} {node.name}: {lines} lines (at most {MAX_LINES})")
        count = parameter_count(node)
        if count > MAX_PARAMETERS and not is_click_command(node):
            found.append(f"{where}:{node.lineno} {node.name}: {count} parameters (at most {MAX_PARAMETERS})")
    return found


def test_no_function_is_over_100_lines_or_8_parameters():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50
    found = [p for path in files for p in problems(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not found, "split these functions, or pass a settings object:\n" + "\n".join(found)


def _function(params: list[str], body_lines: int = 1, decorators: tuple[str, ...] = ()) -> str:
    head = "".join(f"{d}\n" for d in decorators)
    return head + f"def f({', '.join(params)}):\n" + "    x = 0\n" * body_lines


def test_the_checker_flags_wide_and_long_functions():
    """Negative controls: the checker finds what it must (else the test above proves nothing)."""
    nine = [f"a{i}" for i in range(9)]
    assert problems(_function(nine)) == ["<source>:1 f: 9 parameters (at most 8)"]
    assert problems(_function(["a0", "*", *nine[1:]])) != []  # keyword-only ones count
    assert problems(_function(["self", *nine[:8]])) == []  # self is not counted
    assert problems(_function([*nine[:8], "*args", "**keywords"])) == []
    method = "class C:\n    @classmethod\n    def f(cls, {}):\n        pass\n"
    assert problems(method.format(", ".join(nine[:8]))) == []
    assert problems(method.format(", ".join(nine))) == ["<source>:3 f: 9 parameters (at most 8)"]
    for click in ("@click.command()", "@main.command('x')", "@click.group"):
        assert problems(_function(nine, decorators=(click, "@click.option('--a0')"))) == []
    assert problems(_function(nine, decorators=("@functools.cache",))) != []
    assert problems(_function([], body_lines=99)) == []  # 100 lines with the def
    assert problems(_function([], body_lines=100)) == ["<source>:1 f: 101 lines (at most 100)"]
    nested = "def outer():\n" + "".join("    " + line + "\n" for line in _function(nine).splitlines())
    assert problems(nested) == ["<source>:2 f: 9 parameters (at most 8)"]


def _members(protocol: type) -> set[str]:
    """The attributes and methods a ``typing.Protocol`` declares, its base protocols' too."""
    names = set()
    for cls in protocol.__mro__:
        if cls.__module__ in ("typing", "builtins"):
            continue
        names |= {n for n in vars(cls) if not n.startswith("_")} | set(cls.__dict__.get("__annotations__", {}))
    return names


def _provides(cls: type, name: str) -> bool:
    return hasattr(cls, name) or any(name in k.__dict__.get("__annotations__", {}) for k in cls.__mro__)


def test_every_engine_offers_the_engine_contract():
    """The backends (``CachedEngine``) offer ``Engine`` and its snapshots (``SnapshotEngine``); the feature tap offers
    ``Engine`` by delegating, and takes no KV snapshots of its own (the prompt cache restores its features apart)."""
    from specdec_edge.runtime.base import CachedEngine, Engine, SnapshotEngine
    from specdec_edge.runtime.ort_engine import OrtEngine
    from specdec_edge.runtime.ort_gpu_engine import OrtGpuEngine
    from specdec_edge.runtime.tensorrt_engine import TensorRTEngine
    from specdec_edge.speculative.features import FeatureTap

    contract, snapshots = _members(Engine), _members(SnapshotEngine)
    assert {"run", "commit", "rollback", "reset", "reusable", "length", "capacity", "held"} <= contract < snapshots
    for backend in (CachedEngine, OrtEngine, OrtGpuEngine, TensorRTEngine):
        assert issubclass(backend, CachedEngine)
        assert [n for n in sorted(snapshots) if not _provides(backend, n)] == [], backend.__name__
    assert [n for n in sorted(contract) if not _provides(FeatureTap, n)] == []
    assert not any(_provides(FeatureTap, n) for n in snapshots - contract)
