"""The packages import one way (DESIGN: api → service → projections → eventstore, domain beneath all),
the SDK and the server never import each other, and no product code imports the benchmark.

Read from the source with ``ast`` (no import runs), so a violation fails here before anything executes:
a module-level import and one inside a function count alike.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = {
    "domain",
    "eventstore",
    "projections",
    "service",
    "api",
    "migrations",
    "lockledger",
    "lockledger_breaker",
    "bench",
}
# What each package may import of the project (itself always).
ALLOWED: dict[str, set[str]] = {
    "domain": set(),
    "lockledger_breaker": set(),
    "lockledger": {"lockledger_breaker"},
    "eventstore": {"domain"},
    # The schema's history covers every layer's tables (alembic reads their SQLAlchemy metadata).
    "migrations": {"service", "projections", "eventstore", "domain"},
    "projections": {"eventstore", "domain"},
    "service": {"projections", "eventstore", "domain", "lockledger_breaker"},
    "api": {"service", "projections", "eventstore", "migrations", "domain", "lockledger_breaker"},
}
# The SDK's distribution depends on these alone (lockledger/pyproject.toml).
SDK_THIRD_PARTY = {"httpx", "stamina"}
# Its `cli` extra brings these, for the command line's modules alone (the simulator's command is the
# server distribution's, which has them anyway).
SDK_CLI = Path("lockledger/cli.py")
SIMULATOR_CLI = Path("lockledger/simulate/cli.py")
SDK_CLI_THIRD_PARTY = {"typer", "rich"}


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """Every absolute module an import statement names (``from x import y`` names ``x``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_one_way(package: str) -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in modules(package)
        for line, name in imports(path)
        if (top := name.split(".")[0]) in PROJECT and top != package and top not in ALLOWED[package]
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", ["lockledger", "lockledger_breaker"])
def test_the_sdk_needs_only_httpx_and_stamina(package: str) -> None:
    import sys

    def allowed(path: Path) -> set[str]:
        cli = path.relative_to(ROOT) in (SDK_CLI, SIMULATOR_CLI)
        return SDK_THIRD_PARTY | (SDK_CLI_THIRD_PARTY if cli else set())

    outside = {
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in modules(package)
        for line, name in imports(path)
        if (top := name.split(".")[0]) not in PROJECT
        and top not in allowed(path)
        and top not in sys.stdlib_module_names
        and top != "__future__"
    }
    assert not outside, "\n".join(sorted(outside))


def test_the_cli_extra_brings_what_the_command_line_imports() -> None:
    """typer and rich are in the SDK's ``cli`` extra, not its dependencies, and the command line is the
    SDK's console script."""
    import tomllib

    project = tomllib.loads((ROOT / "lockledger" / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    names = {requirement.split(">")[0].split("=")[0].split("<")[0].strip() for requirement in
             project["optional-dependencies"]["cli"]}  # fmt: skip
    assert names == SDK_CLI_THIRD_PARTY
    assert not any(dep.startswith(tuple(SDK_CLI_THIRD_PARTY)) for dep in project["dependencies"])
    assert project["scripts"] == {"lockledger": "lockledger.cli:main"}
    used = {name.split(".")[0] for _, name in imports(ROOT / SDK_CLI)}
    assert used >= SDK_CLI_THIRD_PARTY


def test_the_checks_see_real_imports() -> None:
    """A guard against a silent pass: the walker finds what these packages are known to import."""
    found = {name for path in modules("service") for _, name in imports(path)}
    assert "domain.decider" in found
    assert "lockledger_breaker" in found
    assert any(name.startswith("httpx") for path in modules("lockledger") for _, name in imports(path))
