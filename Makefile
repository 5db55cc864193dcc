# One-command set-up: `make demo` runs the main job, `make test` the whole test suite.
# Both create .venv on first use (PyTorch pinned to the CPU build torch==2.13.0) and are no-ops after.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tracefp4-installed
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tracefp4 demo

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(VENV)/bin/tracefp4 bench numerics

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
