#!/usr/bin/env bash
# Opens the lab: JupyterLab on a working copy of labs/*.ipynb in .lab/ (ignored by git), so
# running and saving the notebooks never touches the tracked files. A tracked notebook newer
# than its working copy replaces it (the old copy is kept as NAME.ipynb.bak).
# Bound to 127.0.0.1 with a fresh random token.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .lab
for nb in labs/*.ipynb; do
  copy=".lab/$(basename "$nb")"
  if [[ -e "$copy" && "$nb" -nt "$copy" ]]; then cp -p "$copy" "$copy.bak"; fi
  if [[ ! -e "$copy" || "$nb" -nt "$copy" ]]; then cp -p "$nb" "$copy"; touch "$copy"; fi
done
TOKEN=${DDTREE_LAB_TOKEN:-$(.venv/bin/python -c "import secrets; print(secrets.token_hex(24))")}
PORT=${DDTREE_LAB_PORT:-8888}
extra=()
[[ $(id -u) == 0 ]] && extra+=(--allow-root)
echo "[lab] working copies in .lab/ (git ignores them; labs/ stays as committed)"
echo "[lab] open http://127.0.0.1:${PORT}/lab/tree/01_live_step.ipynb?token=${TOKEN}"
exec .venv/bin/jupyter lab --no-browser --ip=127.0.0.1 --port="$PORT" \
  --IdentityProvider.token="$TOKEN" --ServerApp.root_dir=.lab "${extra[@]}"
