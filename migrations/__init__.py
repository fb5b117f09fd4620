"""Alembic environment and versions; `lockledger migrate` runs them."""
