"""Fault-injection scenarios and their history checker (see docs/reliability.md).

This folder is a package, unlike the rest of tests/, because its modules import one another
(``tests.faults.history``, ``tests.faults.load``) and it has a conftest.py of its own.
"""
