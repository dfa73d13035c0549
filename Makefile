# cni-agent — developer entry points. `make run` and `make test` are all a
# newcomer needs; both install what is missing first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: all setup system venv test lint unit-py313 run deb rpm-spec-check bench bench-smoke soak clean

all: setup

setup: system venv

system:
	@tools/setup-system

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip >/dev/null
	@$(PY) -m pip install -q -e '.[test]'
	@touch $@

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: setup lint
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build dist out agent/*.egg-info .mypy_cache .ruff_cache .pytest_cache
