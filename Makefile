# Two entry points for a fresh machine with Python 3.11+: `make serve` and `make test`.
# Everything else (the Valkey engine, test tools) is installed by pip into .venv.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: serve test lint typecheck unit install browser clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# The browser tests drive Debian's Chromium (Playwright's own browser download does not
# work offline). As root (as in CI) it is installed when missing; otherwise those tests
# skip and say why.
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
		else \
			echo "note: /usr/bin/chromium is missing and not root: the browser tests will skip"; \
		fi; \
	fi

serve: install
	$(BIN)/flowcast serve

lint: install
	$(BIN)/ruff check lib app tests stress bench

typecheck: install
	$(BIN)/mypy lib app

unit: install browser
	$(BIN)/pytest

test: lint typecheck unit

clean:
	rm -rf $(VENV) .flowcast .pytest_cache .mypy_cache .ruff_cache
