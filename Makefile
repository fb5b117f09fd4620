# lockledger: `make run` serves (embedded PostgreSQL, nothing else needed), `make test` runs the suite.
# Both create the virtual environment .venv on first use.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-dev
PG15_URL ?= postgresql://postgres@127.0.0.1:5432/postgres

.PHONY: install run test lint test-pg15 clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit("lockledger needs Python >= 3.11, found " + sys.version.split()[0]) if sys.version_info < (3, 11) else None'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/lockledger serve --dev

test: $(STAMP)
	$(BIN)/pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The storage tests again, against an external PostgreSQL (CI: the machine's PostgreSQL 15).
test-pg15: $(STAMP)
	LOCKLEDGER_TEST_DATABASE_URL=$(PG15_URL) $(BIN)/pytest -m storage

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
