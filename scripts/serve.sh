#!/usr/bin/env bash
# From nothing to a running app: install, then `serve run serve_config.yaml` (the built-in tiny
# model on CPU, or the configured model with one replica per GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH"
exec serve run serve_config.yaml "$@"
