# lockledger: `make run` serves (embedded PostgreSQL, nothing else needed), `make test` runs the suite.
# Both create the virtual environment .venv on first use: `make run` installs what serving needs,
# `make test`, `make lint` and `make install` add the dev extra (test, lint and benchmark tools).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev
HA_STAMP  := $(VENV)/.installed-ha
PG15_URL ?= postgresql://postgres@127.0.0.1:5432/postgres

# The checkout's own data: `make run`'s embedded PostgreSQL keeps its data here (so two checkouts never
# share a server), unless LOCKLEDGER_DATA_DIR names another directory. `make clean` removes it.
LOCAL_DATA := .lockledger
LOCKLEDGER_DATA_DIR ?= $(CURDIR)/$(LOCAL_DATA)/pgdata
# `make run PORT=8001`
LOCKLEDGER_PORT ?= 8000
PORT ?= $(LOCKLEDGER_PORT)

# `make ha`: a local PostgreSQL HA cluster (3 Patroni nodes, etcd) in the checkout's .lockledger/cluster
HA_DIR ?= $(CURDIR)/$(LOCAL_DATA)/cluster

.PHONY: install run test test-slow test-fast lint test-pg15 ha ha-down clean

# The server's distribution (pyproject.toml) carries the SDK's packages too; the SDK's own (lockledger/) is
# what an agent installs. The checkout is also put on sys.path (a .pth file): setuptools' editable import
# hook is asked only after the path, so a folder named lockledger where a script runs (a clone's parent)
# would otherwise be imported instead, as an empty namespace package.
CHECKOUT_ON_PATH = $(BIN)/python -c 'import pathlib, sys, sysconfig; pathlib.Path(sysconfig.get_paths()["purelib"], "lockledger-checkout.pth").write_text(sys.argv[1] + "\n")' '$(CURDIR)'

$(RUN_STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit("lockledger needs Python >= 3.11, found " + sys.version.split()[0]) if sys.version_info < (3, 11) else None'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	$(CHECKOUT_ON_PATH)
	@touch $@

$(DEV_STAMP): $(RUN_STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@

$(HA_STAMP): $(RUN_STAMP)
	$(BIN)/python -m pip install --quiet -e '.[ha]'
	@touch $@

install: $(DEV_STAMP)

run: $(RUN_STAMP)
	$(BIN)/lockledger serve --dev --port $(PORT) --data-dir '$(LOCKLEDGER_DATA_DIR)'

# The suite: behaviour on the in-memory fakes, storage on PostgreSQL, end to end on a real server and a
# real browser. The tests that kill processes, freeze or fail over the database, build wheels or run
# load take longer than the rest together: `make test-slow` runs them (CI runs both).
test: $(DEV_STAMP)
	$(BIN)/pytest -m "not slow"

test-slow: $(DEV_STAMP)
	$(BIN)/pytest -m slow

# The tests that need no PostgreSQL and no server: the domain, the use cases on fakes, the SDK, the HTTP
# layer's pieces, on every core. Seconds, for the edit-test loop; `make test` is the whole suite. The
# folders whose every test needs PostgreSQL are not even collected (their imports take seconds).
test-fast: $(DEV_STAMP)
	$(BIN)/pytest -n auto -m "not storage and not postgres and not slow" \
		--ignore=tests/storage --ignore=tests/ui --ignore=tests/cluster/test_local_cluster.py

lint: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The storage tests again, against an external PostgreSQL (CI: the machine's PostgreSQL 15).
test-pg15: $(DEV_STAMP)
	LOCKLEDGER_TEST_DATABASE_URL=$(PG15_URL) $(BIN)/pytest -m storage

# Starts the cluster (again, with its data, if it exists) and prints its URL; `make ha-down` stops it.
# Needs etcd: Debian's etcd-server package.
ha: $(HA_STAMP)
	$(BIN)/lockledger cluster up --dir '$(HA_DIR)'

ha-down: $(HA_STAMP)
	$(BIN)/lockledger cluster down --dir '$(HA_DIR)'

# The checkout's embedded PostgreSQL is stopped first if nothing uses it any more; while something does
# (a `make run`), nothing is removed. The script needs only the standard library, not .venv.
clean:
	@$(PYTHON) eventstore/embedded.py stop '$(LOCAL_DATA)/pgdata' || { echo "make clean: nothing removed"; exit 1; }
	@if [ -f '$(HA_DIR)/cluster.json' ] && [ -x $(BIN)/lockledger ]; then $(BIN)/lockledger cluster down --dir '$(HA_DIR)'; fi
	rm -rf $(VENV) $(LOCAL_DATA) .pytest_cache .mypy_cache .ruff_cache .hypothesis build dist *.egg-info lockledger/*.egg-info
