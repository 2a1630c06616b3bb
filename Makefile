# Two commands from a fresh clone: `make demo` (the main job on the default model) and `make test`.
# Each creates or reuses the virtual environment in $(VENV) and installs what the project needs.

VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# The CPU build of torch is pinned where there is no GPU (an unpinned torch pulls a multi-GB CUDA build).
TORCH ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
EXTRAS ?= dev,serve,plot,wandb,deepspeed
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/medusa-generate --max-new-tokens 64 "What is the capital of France?"

test: $(STAMP)
	$(PY) -m pytest -q -ra

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow"

clean-venv:
	rm -rf $(VENV)
