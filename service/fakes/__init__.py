"""In-memory fakes of the ports (``service/ports.py``), for behaviour tests and for running without a
database. They keep the PostgreSQL adapters' contract, which ``tests/service/test_store_contract.py``
checks against both; ``MemoryDatabase`` holds the state they share, as the tables do in PostgreSQL."""
