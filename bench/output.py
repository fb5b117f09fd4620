"""The JSON lines file: one object per cell as soon as it is measured, then one summary object."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def default_path(prefix: str = "", directory: Path = RESULTS_DIR) -> Path:
    """``<directory>/<prefix><local time>.jsonl``."""
    return directory / f"{prefix}{time.strftime('%Y%m%d-%H%M%S')}.jsonl"


class JsonLines:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(record, default=str) + "\n")


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
