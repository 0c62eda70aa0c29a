# Two commands on a fresh machine with Python 3.10+ and pip: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: train test clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

RUN := runs/tiny-$(shell date +%Y%m%d-%H%M%S)

# Train, then show what the model writes after "def " (greedy sampling would repeat itself; this samples).
train: $(VENV)/.installed
	$(VENV)/bin/hlat train --config configs/tiny.toml --train.run_dir $(RUN) $(ARGS)
	@echo "--- a sample from $(RUN):"
	@$(VENV)/bin/hlat generate $(RUN) --prompt "def " --max-new-tokens 48 --temperature 0.7

test: $(VENV)/.installed
	$(PY) -m pytest $(ARGS)

clean:
	rm -rf $(VENV) runs build *.egg-info .pytest_cache
