"""Where the numbers come from: machine, software versions, database settings and the git commit."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import psutil

PACKAGES = ("lockledger", "fastapi", "uvicorn", "asyncpg", "aiohttp", "httptools", "uvloop", "eventsourcing")
PACKAGES_MORE = ("psycopg", "redis", "psutil")


def git_commit(cwd: Path | None = None) -> str | None:
    where = cwd or Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, check=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            check=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}{'-dirty' if dirty else ''}"


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in (*PACKAGES, *PACKAGES_MORE):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions


def environment() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "cpu_count_physical": psutil.cpu_count(logical=False),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "git_commit": git_commit(),
        "packages": package_versions(),
    }
