"""``python -m bench``: run the benchmark (see ``bench.cli``), or say which extra it needs."""

import importlib.util
import sys

# The modules of the bench extra (pyproject.toml), which serving does not install.
BENCH_MODULES = ("aiohttp", "psutil", "redis", "eventsourcing", "psycopg")

missing = [name for name in BENCH_MODULES if importlib.util.find_spec(name) is None]
if missing:
    sys.exit(
        f"python -m bench needs the bench extra ({', '.join(missing)} not installed): "
        "in a checkout, `make install` (the dev extra includes it) or `.venv/bin/pip install -e '.[bench]'`"
    )

from bench.cli import main  # noqa: E402  (after the check, so a missing extra is said, not raised)

raise SystemExit(main())
