# The two commands of the README: `make lab` opens the lab, `make test` runs the tests.
# Both create and fill .venv first when it is missing or older than the project's set-up files.
VENV := .venv
READY := $(VENV)/.ddtree-lab-ready

.PHONY: lab test setup bench

$(READY): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

setup: $(READY)

lab: $(READY)
	bash scripts/lab.sh

test: $(READY)
	$(VENV)/bin/python -m pytest

bench: $(READY)
	$(VENV)/bin/python benchmarks/tree_build.py
