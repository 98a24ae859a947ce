# The two commands of the README: `make lab` opens the lab, `make test` runs the tests.
# Both create and fill .venv first when it is missing or older than the project's set-up files.
VENV := .venv
READY := $(VENV)/.ddtree-lab-ready

.PHONY: lab test test-fast lint setup bench

$(READY): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

setup: $(READY)

lab: $(READY)
	bash scripts/lab.sh

test: $(READY)
	$(VENV)/bin/python -m pytest

# The edit loop: everything but the tests tests/conftest.py marks slow (real model, notebooks, browser,
# kernel compiles, fresh processes, long statistical tests; docs/TESTING.md). `make test` and CI run everything.
test-fast: $(READY)
	$(VENV)/bin/python -m pytest -m "not slow" -q

# ruff and pyright as configured in pyproject.toml (`make test` runs them too, in tests/test_lint.py).
lint: $(READY)
	$(VENV)/bin/ruff check ddtree_lab tests scripts benchmarks
	$(VENV)/bin/pyright --pythonpath $(VENV)/bin/python

bench: $(READY)
	$(VENV)/bin/python benchmarks/tree_build.py
