# Everything runs in a local virtual environment (.venv), created on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel on CI machines; on a CUDA machine the same pin installs the CUDA build.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?= -q

.PHONY: install test bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS) tests

bench: install
	$(BIN)/python benchmarks/fusion.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
