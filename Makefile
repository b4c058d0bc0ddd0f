# The README's two commands: `make serve` and `make test`. Everything installs into .venv.
#
# torch: a CPU build (torch==2.13.0) is installed first unless torch is already importable in .venv;
# GPU users name their build instead, e.g. `make serve TORCH="torch==2.9.1"` (any pip arguments).

PYTHON ?= python3
VENV   ?= .venv
PORT   ?= 8000
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

ifdef TORCH
TORCH_INSTALL := $(PIP) install $(TORCH)
else
TORCH_INSTALL := $(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
endif

.PHONY: serve test bench install install-dev clean

serve: $(VENV)/.installed
	$(VENV)/bin/streamserve serve --port $(PORT)

test: $(VENV)/.installed-dev
	$(PY) -m ruff check .
	$(PY) -m pytest -q

bench: $(VENV)/.installed-dev
	$(PY) benchmarks/decode.py

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(PY)
	$(TORCH_INSTALL)
	$(PIP) install -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml clients/python/pyproject.toml
	$(PIP) install -e ".[dev]" -e clients/python
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
