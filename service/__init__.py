"""The application layer: command handlers, the reaper, settings and the database pool."""
