# Two commands from a fresh clone: `make demo` (the main job on the default model) and `make test`.
# Each creates or reuses the virtual environment in $(VENV) and installs what the project needs.

VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# torch is pinned where there is no GPU (an unpinned torch pulls a multi-GB CUDA build): this project's CPU
# machines take the pin as a local CPU wheel; elsewhere see the README (TORCH=torch==2.13.0+cpu and PyTorch's index).
TORCH ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
EXTRAS ?= dev,serve,plot,wandb,deepspeed
STAMP := $(VENV)/.installed

# The main job: distil -> train -> calibrate -> benchmark on Spec-Bench questions the heads never saw.
# Each stage's output is a file target, so a second `make demo` reuses what the first produced.
DEMO ?= runs/demo
DEMO_RECIPE ?= recipes/smollm2-135m.yaml
QUESTIONS ?= data/specbench.jsonl
DEMO_LIMIT ?= 26
DEMO_TOKENS ?= 64
DEMO_METHODS ?= hf,hf-lookup,ar,medusa,medusa-lookup,lookup
# The demo keeps within DEMO_MINUTES of its start, installing included: the benchmark starts no new
# question once that time, less 90 s for the last one, is spent (medusa-bench --time-budget, questions
# taken round robin across categories), but runs at least DEMO_MIN_BENCH s, calibration included.
DEMO_MINUTES ?= 45
DEMO_MIN_BENCH ?= 480
DEMO_STARTED := $(shell date +%s)
ifneq ($(filter demo $(DEMO)/%,$(or $(MAKECMDGOALS),install)),)
ifeq ($(shell [ "$(DEMO_MINUTES)" -ge 1 ] 2>/dev/null && [ "$(DEMO_MIN_BENCH)" -ge 1 ] 2>/dev/null && echo ok),)
$(error DEMO_MINUTES and DEMO_MIN_BENCH must be whole numbers >= 1 (minutes, seconds), got $(DEMO_MINUTES) and $(DEMO_MIN_BENCH))
endif
endif

.PHONY: install demo test test-fast clean-venv FORCE
# a stage that fails leaves no target behind: a benchmark stopped by an error after some questions wrote
# report.json (report.md keeps what it measured), and the next `make demo` showed it as the finished one
.DELETE_ON_ERROR:

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

demo: $(DEMO)/report.json
	@cat $(DEMO)/report.md
	@echo "heads: $(DEMO)/heads   report: $(DEMO)/report.json, report.md, report.png"

# The recipe's path, rewritten only when it changes: another DEMO_RECIPE trains again (a clone's recipes are
# older than heads trained since, and the old heads and report were shown as the new recipe's; train_heads.py
# refuses a finished run of other settings, naming the folders to remove).
$(DEMO)/recipe.txt: FORCE
	@mkdir -p $(DEMO)
	@echo '$(DEMO_RECIPE)' | cmp -s - $@ || echo '$(DEMO_RECIPE)' > $@

# A stamp: train_heads.py skips the stages whose outputs exist, so an edit it reads nothing of (a comment)
# runs it once, not at every `make demo`; the heads' config.json changes only where it trains again.
$(DEMO)/.trained: $(DEMO_RECIPE) $(DEMO)/recipe.txt | $(STAMP)
	$(PY) train_heads.py --config $(DEMO_RECIPE) output_dir=$(DEMO)
	touch $@

$(DEMO)/heads/config.json: $(DEMO)/.trained
	@test -f $@ || $(PY) train_heads.py --config $(DEMO_RECIPE) output_dir=$(DEMO)

# The benchmark's settings, rewritten only when they change: another DEMO_LIMIT, DEMO_TOKENS, DEMO_METHODS
# or QUESTIONS benchmarks again (the trained heads are kept).
BENCH_SETTINGS := questions=$(QUESTIONS) limit=$(DEMO_LIMIT) tokens=$(DEMO_TOKENS) methods=$(DEMO_METHODS)

$(DEMO)/bench-settings.txt: FORCE
	@mkdir -p $(DEMO)
	@echo '$(BENCH_SETTINGS)' | cmp -s - $@ || echo '$(BENCH_SETTINGS)' > $@

FORCE:

$(DEMO)/report.json: $(DEMO)/heads/config.json $(DEMO)/bench-settings.txt
	budget=$$(( $(DEMO_STARTED) + $(DEMO_MINUTES) * 60 - 90 - $$(date +%s) )); \
	if [ $$budget -lt $(DEMO_MIN_BENCH) ]; then budget=$(DEMO_MIN_BENCH); fi; \
	$(VENV)/bin/medusa-bench --heads $(DEMO)/heads --calibrate --questions $(QUESTIONS) \
		--limit $(DEMO_LIMIT) --max-new-tokens $(DEMO_TOKENS) --methods $(DEMO_METHODS) --output $(DEMO) \
		--time-budget $$budget

# Tests run in TEST_WORKERS processes (pytest-xdist; 0: in this one): most wait on subprocesses or run tiny models
# on one thread, and on a 2-core machine a fresh clone's suite took 594 s in two where it took 923 in one.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) -m "not slow"

clean-venv:
	rm -rf $(VENV)
