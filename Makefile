# Set-up and entry points. `make demo` and `make test` each install what they need into .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 8
# torch is pinned to the one version whose CPU wheel is on local disk here; on a GPU cluster the
# same pin pulls the CUDA build.
TORCH := torch==2.13.0

.PHONY: install lint test check demo demo-mlp gpu-check clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[mpi,test]'
	touch $@

install: $(VENV)/.installed

# The layering (docs/design.md §9), lint and format, and the public API's types, then the suite
# (`make test`: every test, the 25 slowest listed at the end; what CI runs) or its fast tier
# (`make check`: the tests not marked slow, under 5 minutes on a 2-core host; the edit-test loop).
lint: install
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy axon4d

test: lint
	$(PY) -m pytest --durations=25 $(PYTEST_ARGS)

check: lint
	$(PY) -m pytest -m "not slow and not gpu" $(PYTEST_ARGS)

# The main job: a small Llama trained for a couple of minutes on an 8-rank (2,2,2,1) grid on a
# byte-level corpus made offline from Python's docstrings, then the same model in one process.
DEMO_ARGS ?= --grid 2,2,2,1 --model small --data corpus --steps 80 --batch-size 16 --warmup-steps 8
demo: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc-per-node $(NPROC) --master-port 29517 -m axon4d.train \
		$(DEMO_ARGS) --compare-single --overwrite --out-dir build/demo

# The drop-in example: an MLP of axon4d.Linear layers against the same MLP in one process.
demo-mlp: install
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc-per-node $(NPROC) --master-port 29518 -m axon4d.demo

# Everything one GPU can prove (bench/gpu_check.py, its ranks' code in bench/gpu_cases.py): the
# distributed code on CUDA tensors against the dense model, several ranks sharing the GPU through
# gloo, one rank on NCCL, no host sync in the job's step, the GPU test suite; what it cannot run is
# recorded skipped. Runs with the machine's own torch (GPU_PYTHON, which must have CUDA), not .venv's
# CPU build; writes bench/results/gpu_check_<gpu>.json. Without CUDA it says so and fails.
GPU_PYTHON ?= python3
# cases side by side on the one GPU; the timings run alone, last
GPU_CHECK_ARGS ?= --jobs 6
gpu-check:
	PYTHONPATH=. $(GPU_PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
