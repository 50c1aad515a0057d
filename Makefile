# Set-up and entry points. `make demo` and `make test` each install what they need into .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 8
# torch is pinned to the one version whose CPU wheel is on local disk here; on a GPU cluster the
# same pin pulls the CUDA build.
TORCH := torch==2.13.0

.PHONY: install test demo lint clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[mpi,test]'
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

demo: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc-per-node $(NPROC) --master-port 29517 -m axon4d.demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
