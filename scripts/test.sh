#!/usr/bin/env bash
# From nothing to a passing test suite: install (CPU or GPU build) and run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# The side venv with SAELens (tests/test_saelens_dataset.py; it cannot share .venv): about 2 min
# from nothing, a stamp check (well under a second) once built.
started=$(date +%s)
bash scripts/install_saelens.sh
echo "test.sh: install_saelens.sh took $(( $(date +%s) - started )) s" >&2
# The soak tests (load and fault runs, minutes each: `-m soak`) run only when asked; CI runs them as
# a step of their own (.ci/run). Any -m given here replaces this default.
# The rest runs on two pytest-xdist workers (CAPSERVE_TEST_WORKERS; 0 runs one process), whole
# modules each, slowest first (tests/conftest.py: SLOW_MODULES). Engine and Serve starts are CPU-bound
# on two cores, so this gains ~20 % (main step 24:45 -> 19:25, 2026-12-06), not 2x; three were slower.
# One OpenMP thread per process, placed by the OS: vLLM's CPU default pins every engine the tests
# start to core 0, where the two workers' engines queue (modules side by side ran 25% slower so,
# 2026-12-06). Replicas then skip their own pinning (replicas/replica.py: an explicit setting wins).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
for arg in "$@"; do [ "$arg" = "-m" ] && exec .venv/bin/python -m pytest "$@"; done
exec .venv/bin/python -m pytest -n "${CAPSERVE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder -m "not soak" "$@"
