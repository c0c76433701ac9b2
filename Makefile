# Two entry points for a fresh machine with Python 3.11+: `make serve` and `make test`.
# Everything else (the Valkey engine, test tools) is installed by pip into .venv.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: serve test lint typecheck unit install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(BIN)/flowcast serve

lint: install
	$(BIN)/ruff check lib app tests

typecheck: install
	$(BIN)/mypy lib app

unit: install
	$(BIN)/pytest

test: lint typecheck unit

clean:
	rm -rf $(VENV) .flowcast .pytest_cache .mypy_cache .ruff_cache
