#!/usr/bin/env bash
# Starts JupyterLab on labs/, bound to 127.0.0.1 with a fresh random token.
set -euo pipefail
cd "$(dirname "$0")/.."
TOKEN=${DDTREE_LAB_TOKEN:-$(.venv/bin/python -c "import secrets; print(secrets.token_hex(24))")}
PORT=${DDTREE_LAB_PORT:-8888}
extra=()
[[ $(id -u) == 0 ]] && extra+=(--allow-root)
echo "[lab] open http://127.0.0.1:${PORT}/lab/tree/01_live_step.ipynb?token=${TOKEN}"
exec .venv/bin/jupyter lab --no-browser --ip=127.0.0.1 --port="$PORT" \
  --IdentityProvider.token="$TOKEN" --ServerApp.root_dir=labs "${extra[@]}"
