"""The HTTP API (FastAPI): commands, queries, health, and problem+json errors."""
