# Two commands do it all on a fresh machine:
#   make demo   sets itself up, then runs the demo (on the CPU when there is no GPU)
#   make test   sets itself up, then runs ruff, mypy, pytest and the docs build
# TORCH picks the torch to install when the venv has none; any installed torch >= 2.11
# is kept (the project never replaces it).
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-oldest lint typecheck pytest docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,docs]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Every step runs; one line per step with its result and time, then the exit status.
TEST_STEPS := lint typecheck pytest docs
test: $(STAMP)
	@summary=""; failed=0; \
	for step in $(TEST_STEPS); do \
	  start=$$(date +%s); \
	  if $(MAKE) --no-print-directory $$step; then result=passed; else result=FAILED; failed=1; fi; \
	  summary="$$summary$$(printf '  %-10s %-7s %4s s' $$step $$result $$(( $$(date +%s) - start )))\n"; \
	done; \
	printf '\nmake test:\n%b' "$$summary"; \
	exit $$failed

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks examples scripts docs/conf.py docs/_ext
	$(PY) -m ruff format --check src tests benchmarks examples scripts docs/conf.py docs/_ext

typecheck: $(STAMP)
	$(PY) -m mypy

pytest: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

docs: $(STAMP)
	$(PY) -m sphinx -n -W --keep-going -q -b html docs docs/_build/html

# The suite on the lowest versions pyproject.toml declares (tests/test_packaging.py keeps
# these pins equal to its floors). torch is the one exception: its floor (2.11) has no
# CPU wheel on these machines; the local torch==2.13.0 CPU wheel is used, and the GPU
# check runs the whole suite on torch 2.11, the floor.
OLDEST_VENV ?= .venv-oldest
OLDEST := pytest==8.3.3 ipython==9.0.0 line_profiler==5.1.0 nvidia-ml-py==12.535.77 \
	pytest-xdist==3.8.0
test-oldest:
	rm -rf $(OLDEST_VENV)
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install -q "$(TORCH)" $(OLDEST)
	$(OLDEST_VENV)/bin/python -m pip install -q -e ".[test]" $(OLDEST)
	$(OLDEST_VENV)/bin/python -m pip list 2>/dev/null | grep -iE '^(torch|pytest|ipython|line.profiler|nvidia-ml-py|pytest-xdist) '
	$(OLDEST_VENV)/bin/python -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(OLDEST_VENV) docs/_build .mypy_cache .ruff_cache .pytest_cache
