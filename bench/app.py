"""The benchmark's own app: the product's, with the no-op twin of the commands mounted beside them.

``python -m api.cli serve --app-factory bench.app:create_app`` serves it (``bench/server.py``), so the
real endpoints and the framework's ceiling run in the same processes. The product never mounts the twin.
"""

from __future__ import annotations

from fastapi import FastAPI

from api import app
from bench import noop
from service.config import Settings

FACTORY = "bench.app:create_app"


def create_app(settings: Settings | None = None) -> FastAPI:
    return app.create_app(settings, extra_command_routers=[noop.router])
