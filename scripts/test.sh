#!/usr/bin/env bash
# From nothing to a passing test suite: install (CPU or GPU build) and run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest "$@"
