# Two entry points for a fresh machine with only Python 3.11: `make check`, `make test`.
# Both create .venv and install the project with every backend on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: check test

# torch first, pinned to a version whose CPU wheel the CI machines' pip finds: an unpinned
# torch would pull a multi-GB CUDA build. The extras' ranges then install nothing more for it.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[all,dev]"
	touch $(STAMP)

check: $(STAMP)
	$(BIN)/fusedkv check

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q tests
