# The README commands. Both create .venv when missing and install the project.
# torch: a torch already importable in .venv (e.g. a CUDA build installed first, see the README's
# "On a GPU machine") is kept; otherwise the local CPU wheel (torch==2.13.0): never a multi-GB
# CUDA download, and never a CPU torch over a CUDA one.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.erpo-installed

.PHONY: install test demo eval bench clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
		$(PY) -c "import torch; print('keeping the installed torch', torch.__version__)"; \
	else \
		$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0; \
	fi
	$(PY) -m pip install -q --disable-pip-version-check -e ".[train,dev,trl]"
	touch $(STAMP)

install: $(STAMP)

# Kernels run in Triton's CPU interpreter here (tests/conftest.py sets TRITON_INTERPRET=1
# when no GPU is present).
test: $(STAMP)
	$(PY) -m pytest -q tests

# configs/demo.yaml: the embedded default with two updates per rollout batch;
# overwrite=true: a rerun of the demo replaces runs/demo (erpo train alone refuses to)
demo: $(STAMP)
	$(VENV)/bin/erpo train configs/demo.yaml overwrite=true

# The accuracy-over-temperatures evaluation of the demo run (runs/demo, after make demo).
eval: $(STAMP)
	$(VENV)/bin/erpo eval

bench: $(STAMP)
	$(PY) -m bench kernels --device cpu --quick

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
