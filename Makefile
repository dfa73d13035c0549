# cni-agent — developer entry points. `make run` and `make test` are all a
# newcomer needs; both install what is missing first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# pytest workers for `make test` (each test file stays in one; tests that use
# something the whole machine shares take turns: `machine_wide` in
# tests/conftest.py): the tests mostly wait on processes; on a 2-core machine
# 8 keep both cores busy to the end (pytest's wall time: 4 workers 4:50,
# 6 4:22, 8 4:02, when 2 cores give 3:50 of the CPU it needs).
TEST_JOBS ?= 8

.PHONY: all setup system venv shim test test-systemd test-crio lint unit-py313 run run-system deb rpm srpm rpm-lint test-rpm rpm-spec-check bench bench-smoke soak clean

all: setup

setup: system venv

# System packages, and the test tools cached in /var/cache/cni-agent-tests:
# promtool and the Prometheus server (the monitoring tests), containerd 2.x for
# tests/cri (all extracted from Debian packages).
system:
	@tools/setup-system

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q -e '.[test]'
	@touch $@

# The CNI plugin runtimes exec: C on libsystemd's sd-bus (see shim/cni-agent-shim.c).
SHIM := build/cni-agent-shim
shim: $(SHIM)

$(SHIM): shim/cni-agent-shim.c shim/Makefile | system
	@mkdir -p build
	$(MAKE) -s -C shim OUT=$(CURDIR)/$(SHIM) EXTRA_CFLAGS=-Werror

lint: setup
	$(VENV)/bin/ruff check . tools/test-systemd tools/test-rpm packaging/rpm/pyproject-standin
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --strict tools/test-systemd
	$(VENV)/bin/mypy --strict tools/test-rpm
	$(VENV)/bin/lint-imports --no-logo --no-cache

# The package byte-compiled first: the tests start some 1,500 Python processes
# that import it (agents, the CLI), and where PYTHONDONTWRITEBYTECODE is set no
# import writes a .pyc, so each would compile the whole package again (~0.15 s
# of CPU each).
#
# The test modules too, as pytest rewrites them (their asserts): each worker
# imports every test module, and pytest reads the rewritten code from
# __pycache__ even where it may not write it; without it each of the workers
# rewrote them all (collection: 5.4 s of CPU per worker, 1.7 s with them).
test: setup $(SHIM) lint unit-py313
	@$(PY) -m compileall -q -j 0 agent/cni_agent tests bench
	@env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest --collect-only -q -p no:cacheprovider >/dev/null || true
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS)

# The unit tests again on a Fedora-like Python (3.13: pyinotify needs
# pyasyncore there), when pyenv or the system has one. CI machines do.
PY313 := $(firstword $(wildcard $(HOME)/.pyenv/versions/3.13*/bin/python3.13) $(shell command -v python3.13))
VENV313 := .venv313
unit-py313: setup
ifneq ($(PY313),)
	@test -x $(VENV313)/bin/python || $(PY313) -m venv $(VENV313)
	@test -f $(VENV313)/.stamp -a $(VENV313)/.stamp -nt pyproject.toml || \
		{ $(VENV313)/bin/pip install -q -e '.[test]' && touch $(VENV313)/.stamp; }
	$(VENV313)/bin/python -m pytest -q -p no:cacheprovider tests/unit
else
	@echo "unit-py313: no Python 3.13 found; skipped"
endif

# The DEB under a real systemd: a cached debootstrap root (in
# /var/cache/cni-agent-tests) booted with systemd-nspawn, once with dbus-daemon
# and once with dbus-broker; the report is out/systemd-status.txt.
test-systemd: deb
	tools/test-systemd

# tests/cri against CRI-O instead of containerd: CRI-O is in no Debian suite, so
# tools/build-crio builds it (cached) from a source tree of github.com/cri-o/cri-o
# with Go >= 1.26.4 (GO=PATH, default Debian unstable's, extracted into the test
# tools cache). Not part of `make test`: CI machines reach no source repository.
CRIO_SRC ?=
GO ?=
test-crio: setup $(SHIM)
	@test -n "$(CRIO_SRC)" || { echo "usage: make test-crio CRIO_SRC=DIR [GO=PATH]" >&2; exit 2; }
	@dir=$$(tools/build-crio "$(CRIO_SRC)" $(GO)) && \
		echo "CRI-O: $$dir/crio ($$($$dir/crio --version 2>/dev/null | head -n 1))" && \
		CNI_AGENT_CRI_RUNTIME=crio CNI_AGENT_CRIO_DIR=$$dir $(PY) -m pytest -v tests/cri $(PYTEST_ARGS)

# Benchmarks: one table and out/bench.json (BENCH_ARGS="--only NAME" for one).
BENCH_ARGS ?=
bench: setup $(SHIM)
	$(PY) -m bench $(BENCH_ARGS)

bench-smoke: setup $(SHIM)
	$(PY) -m bench --smoke $(BENCH_ARGS)

# The long load and crash runs (10,000 operations, 100 kill -9s); a summary table.
soak: setup
	$(PY) -m tests.soak

# Packages: the .deb is built from the tree; the RPM spec is checked with rpmspec.
deb: system
	tools/build-deb

rpm-spec-check: system
	tools/check-rpm-spec

# The RPMs (source and binary) from `git archive HEAD` into out/, with Fedora's
# macros or, on Debian, packaging/rpm/macros.fedora-standin; then rpmlint on them.
rpm: system
	tools/build-rpm rpm

srpm: system
	tools/build-rpm srpm

rpm-lint: system
	tools/rpm-lint

# The RPM under a real systemd (the test-systemd root, with rpm): install,
# READY, bus policy and polkit, an upgrade with a live sandbox, removal; the
# report is out/rpm-status.txt. Like test-systemd, beside CI, not in it.
test-rpm: rpm
	tools/test-rpm

# The agent on a private bus with the built-in default network; Ctrl-C cleans up.
# Only what running needs: no test toolchain (podman, debootstrap, rpm,
# debhelper, promtool, prometheus, containerd), no test libraries in the venv.
RUN_STAMP := $(VENV)/.run-stamp
run: $(RUN_STAMP)
	@$(PY) tools/dev-run

run-system:
	@tools/setup-system --run

$(RUN_STAMP): pyproject.toml | run-system
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@test -f $(STAMP) -a $(STAMP) -nt pyproject.toml || $(PY) -m pip install -q -e .
	@touch $@

clean:
	rm -rf $(VENV) $(VENV313) build dist out agent/*.egg-info .mypy_cache .ruff_cache .pytest_cache
