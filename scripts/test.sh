#!/usr/bin/env bash
# From nothing to a passing test suite: install (CPU or GPU build) and run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# .venv and the side venv with SAELens (tests/test_saelens_dataset.py; it cannot share .venv) side
# by side: pip works on one core, so together they take the longer one's time (~4 min from nothing,
# 2026-12-06; one after the other ~6), and a second or so once built. Both build capserve's
# egg-info in this tree, one at a time (.egg-info.lock).
started=$(date +%s)
bash scripts/install_saelens.sh > .venv-saelens.log 2>&1 &
saelens=$!
bash scripts/install.sh
wait "$saelens" || { cat .venv-saelens.log >&2; echo "test.sh: install_saelens.sh failed" >&2; exit 1; }
echo "test.sh: installs took $(( $(date +%s) - started )) s" >&2
# The soak tests (load and fault runs, a minute or more each) run only when asked: `-m soak` runs
# them alone, `-m ""` everything (CI, .ci/run). pytest keeps the last -m, so one given here replaces
# this default.
# The rest runs on two pytest-xdist workers (CAPSERVE_TEST_WORKERS; 0 runs one process), whole
# modules each, slowest first (tests/conftest.py: SLOW_MODULES). Engine and Serve starts are CPU-bound
# on two cores, so this gains ~20 % (main step 24:45 -> 19:25, 2026-12-06), not 2x; three were slower.
# One OpenMP thread per process, placed by the OS: vLLM's CPU default pins every engine the tests
# start to core 0, where the two workers' engines queue (modules side by side ran 25% slower so,
# 2026-12-06). Replicas then skip their own pinning (replicas/replica.py: an explicit setting wins).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
# With threads unbound, vLLM's CPU worker can run inside the engine-core process (the uniproc executor,
# as on one GPU) rather than a process of its own: vLLM switches to that process only to bind OpenMP
# threads. One spawn fewer per engine: a tiny engine starts in 15 s instead of 23 with half the CPU
# (test_engine_capture.py 86 s -> 54 s, 2026-12-06), and the suite starts some fifty engines.
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}
exec .venv/bin/python -m pytest -n "${CAPSERVE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder -m "not soak" "$@"
