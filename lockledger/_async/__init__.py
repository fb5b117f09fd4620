"""One of the client's two packages: ``_async`` is the source, ``_sync`` is generated from it by
``scripts/generate_sync.py``."""
