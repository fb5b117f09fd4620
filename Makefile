# lockledger: `make run` serves (embedded PostgreSQL, nothing else needed), `make test` runs the suite.
# Both create the virtual environment .venv on first use: `make run` installs what serving needs,
# `make test`, `make lint` and `make install` add the dev extra (test, lint and benchmark tools).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev
PG15_URL ?= postgresql://postgres@127.0.0.1:5432/postgres

# The checkout's own data: `make run`'s embedded PostgreSQL keeps its data here (so two checkouts never
# share a server), unless LOCKLEDGER_DATA_DIR names another directory. `make clean` removes it.
LOCAL_DATA := .lockledger
LOCKLEDGER_DATA_DIR ?= $(CURDIR)/$(LOCAL_DATA)/pgdata
# `make run PORT=8001`
LOCKLEDGER_PORT ?= 8000
PORT ?= $(LOCKLEDGER_PORT)

.PHONY: install run test lint test-pg15 clean

# Two distributions: the SDK (lockledger/pyproject.toml) and the server (pyproject.toml), which needs it.
$(RUN_STAMP): pyproject.toml lockledger/pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit("lockledger needs Python >= 3.11, found " + sys.version.split()[0]) if sys.version_info < (3, 11) else None'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ./lockledger -e .
	@touch $@

$(DEV_STAMP): $(RUN_STAMP)
	$(BIN)/python -m pip install --quiet -e ./lockledger -e '.[dev]'
	@touch $@

install: $(DEV_STAMP)

run: $(RUN_STAMP)
	$(BIN)/lockledger serve --dev --port $(PORT) --data-dir '$(LOCKLEDGER_DATA_DIR)'

test: $(DEV_STAMP)
	$(BIN)/pytest

lint: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The storage tests again, against an external PostgreSQL (CI: the machine's PostgreSQL 15).
test-pg15: $(DEV_STAMP)
	LOCKLEDGER_TEST_DATABASE_URL=$(PG15_URL) $(BIN)/pytest -m storage

# The checkout's embedded PostgreSQL is stopped first if nothing uses it any more; while something does
# (a `make run`), nothing is removed. The script needs only the standard library, not .venv.
clean:
	@$(PYTHON) eventstore/embedded.py stop '$(LOCAL_DATA)/pgdata' || { echo "make clean: nothing removed"; exit 1; }
	rm -rf $(VENV) $(LOCAL_DATA) .pytest_cache .mypy_cache .ruff_cache .hypothesis
