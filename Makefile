# The README's two commands: `make local` (install, then run the local heterogeneous job) and
# `make test` (install, then lint, type-check and run the tests). Both work from a fresh clone
# on a machine with Python 3.11+, Node and npm.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20

.PHONY: install install-dev local test lint proto bench clean

# Reinstall only when pyproject.toml or the pins change. containers/constraints.txt is the one set
# of versions: the image installs from it too, and a test fails when the two drift apart.
$(VENV)/.installed: pyproject.toml containers/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --constraint containers/constraints.txt -e '.[dev]'
	touch $@

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed node_modules/.installed

local: install
	$(BIN)/hetero local --spec specs/local-cpu.toml

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: install-dev lint
	$(BIN)/pytest

proto: install
	$(BIN)/python scripts/gen_proto.py

bench: install
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) node_modules cdk.out runs
