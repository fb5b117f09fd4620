"""Fault-injection scenarios and their history checker (see docs/reliability.md).

This folder is a package, unlike the rest of tests/, because it has a conftest.py of its own: without the
``__init__.py`` pytest would import that file as the top-level module ``conftest`` and shadow the root
``tests/conftest.py``, which ``tests/storage/test_crash.py`` imports by that name.
"""
