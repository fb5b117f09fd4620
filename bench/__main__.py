"""``python -m bench``: run the benchmark (see ``bench.cli``)."""

from bench.cli import main

raise SystemExit(main())
