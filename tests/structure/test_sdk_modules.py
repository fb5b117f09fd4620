"""The SDK's own modules: no import cycle among them, sagas built on the client's public surface alone,
and the blocking client generated from the asyncio one, never edited apart from it.

Read with ``ast`` like test_layering.py: an import inside a function or under ``TYPE_CHECKING`` counts.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SDK = ROOT / "lockledger"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sdk_modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(SDK.rglob("*.py"))}


def _imported(path: Path, known: set[str]) -> set[str]:
    """The SDK modules ``path`` imports (``from lockledger import wire`` names ``lockledger.wire``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name in known and name != "lockledger"}  # the package: its __init__


def _graph() -> dict[str, set[str]]:
    modules = _sdk_modules()
    return {name: _imported(path, set(modules)) - {name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        for target in sorted(graph[name]):
            found = visit(target, [*path, name])
            if found:
                return found
        done.add(name)
        return None

    for name in sorted(graph):
        found = visit(name, [])
        if found:
            return found
    return None


def test_the_sdk_modules_import_each_other_without_a_cycle() -> None:
    graph = _graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    """A guard against a silent pass, on a graph with a known cycle."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("layer", ["lockledger.lease", "lockledger.saga", "lockledger.saga_heartbeat"])
def test_leases_and_sagas_do_not_import_the_client(layer: str) -> None:
    """They are layers over the client's public surface (a Protocol each), not its dependants."""
    clients = {"lockledger.client", "lockledger._async.client", "lockledger._sync.client"}
    assert not _graph()[layer] & clients


def test_sagas_use_no_private_attribute_of_another_object() -> None:
    """``saga.py`` reads nothing private of the client (or of any object but itself)."""
    tree = ast.parse((SDK / "saga.py").read_text(encoding="utf-8"))
    private = [
        f"line {node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls", "super"})
        and not (isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "super")
    ]
    assert not private, "\n".join(private)


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_sync", ROOT / "scripts" / "generate_sync.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_blocking_client_is_generated_from_the_asyncio_one() -> None:
    """Regenerated now, ``lockledger/_sync`` comes out byte for byte as committed: an edit of the asyncio
    client without ``python scripts/generate_sync.py`` (or an edit of the generated file) fails here."""
    assert _generator().stale() == []
