# Two commands on a fresh machine with Python 3.10+ and pip: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# pyproject.toml asks for torch>=2.11 (a machine's own CUDA or Neuron build stays); the venv pins what CI tests.
TORCH ?= 2.13.0

.PHONY: train test test-fast lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==$(TORCH) -e ".[test,fp8]"
	touch $@

RUN := runs/tiny-$(shell date +%Y%m%d-%H%M%S)

# Train, then show what the model writes after "def " (greedy sampling would repeat itself; this samples).
train: $(VENV)/.installed
	$(VENV)/bin/hlat train --config configs/tiny.toml --train.run_dir $(RUN) $(ARGS)
	@echo "--- a sample from $(RUN):"
	@$(VENV)/bin/hlat generate $(RUN) --prompt "def " --max-new-tokens 48 --temperature 0.7

# Two pytest workers: the tests that wait (restarts, rendezvous, timeouts) overlap those that compute. A test file
# stays on one worker (its module fixtures are made once); `TEST_WORKERS=0` runs them in this process. One thread
# per process (the runs they start inherit it): two workers with a thread per core each, plus their ranks, spun
# waiting for each other's cores (a quarter of the suite's time on 2 cores).
TEST_WORKERS ?= 2
TEST_THREADS ?= 1
PYTEST := OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# Style first (ruff's lint and format, configured in pyproject.toml): seconds, and a failure names the file and line.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PYTEST) $(ARGS)

# The daily tier: every test but the few long end-to-end ones marked slow (CI runs `make test`).
test-fast: lint
	$(PYTEST) -m "not slow" $(ARGS)

clean:
	rm -rf $(VENV) runs build *.egg-info .pytest_cache
