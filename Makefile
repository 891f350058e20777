# Two commands do all the set-up: `make demo` and `make test`. Each creates (or refreshes)
# the virtualenv in .venv and installs what it needs before running.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A machine with an NVIDIA driver gets the registry's CUDA build of torch; one without gets
# a pinned CPU build (small, and on our CI machines a local wheel). Override with TORCH_SPEC=...
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
TORCH_SPEC ?= torch
else
TORCH_SPEC ?= torch==2.13.0
endif
PYTEST_ARGS ?=
# The torch spec the venv was built with: a different pinned TORCH_SPEC=torch==X reinstalls (an
# unpinned `torch` keeps whatever torch is installed: pip sees it satisfied).
TORCH_STAMP := $(VENV)/.torch-spec

.PHONY: venv demo test test-all clean FORCE

$(TORCH_STAMP): FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH_SPEC)' | cmp -s - $@ || echo '$(TORCH_SPEC)' > $@

# pip is quiet (-q) and the first install takes about a minute: say so before it starts.
$(VENV)/.installed: pyproject.toml Makefile $(TORCH_STAMP)
	@if test -f $@; then echo "updating $(VENV) (pyproject.toml, the Makefile or TORCH_SPEC changed)"; \
	else echo "installing (first run, about a minute)"; fi
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	@touch $@

venv: $(VENV)/.installed

# DEMO_ARGS: more arguments for the demo's training, e.g. make demo DEMO_ARGS='--set train.steps=60'
DEMO_ARGS ?=

# Each demo starts afresh: an earlier demo's checkpoints (a longer one's higher steps) would be what
# the sample below reads.
demo: venv
	rm -rf runs/demo
	$(VENV)/bin/elixir-ray train jobs/configs/demo.yaml $(DEMO_ARGS)
	$(VENV)/bin/elixir-ray sample runs/demo/checkpoints --prompt "def " --tokens 160

# `make test` (CI) leaves out the tests marked `extended`: further scenarios of what the core
# suite covers (more fault kinds, the benchmark tools' options, property sweeps). `make test-all`
# runs every test.
#
# Both run on TEST_WORKERS pytest-xdist processes (0: one process). The tests that start Ray run one
# at a time on one worker, and every other test file whole on whichever worker is free
# (tests/conftest.py says why).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: venv
	$(PY) -m pytest -m "not extended" $(XDIST) $(PYTEST_ARGS)

test-all: venv
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
