"""The PostgreSQL event log: schema, reads, hash-chain verification."""
