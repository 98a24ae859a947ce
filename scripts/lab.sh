#!/usr/bin/env bash
# `make lab`: the same as `ddtree-lab lab` (ddtree_lab/cli/labserver.py does the work): JupyterLab
# on working copies of labs/*.ipynb in .lab/ (ignored by git, so running and saving the
# notebooks never touches the tracked files; a tracked notebook newer than its copy replaces
# it, the old copy kept as NAME.ipynb.bak), bound to 127.0.0.1 with a fresh random token, on
# the first free port from $DDTREE_LAB_PORT (default 8888). The link printed is the one the
# server binds. Extra arguments go to `ddtree-lab lab` (e.g. --port 9000, --dry-run).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m ddtree_lab.cli lab "$@"
