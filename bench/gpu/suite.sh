#!/usr/bin/env bash
# The GPU suite (not CI): on the GPU host, after ../shared/gpu/install.sh unpacked vLLM 0.26 into
# /tmp/site, run the engine and intervention tests (CUDA graphs on, the GPU default) and write a
# JUnit report. Usage: bash bench/gpu/suite.sh [OUTDIR] [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-bench/results}; shift || true
mkdir -p "$out"
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
# Engines started after a test touched CUDA in this process must not be forked from it.
export VLLM_WORKER_MULTIPROC_METHOD=spawn
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pytest tests/test_engine_capture.py tests/test_engine_interventions.py tests/test_engine_compiled.py tests/test_schemas.py tests/test_arena.py \
  -q -p no:cacheprovider --junitxml="$out/gpu_suite.xml" "$@" 2>&1 | tee "$out/gpu_suite.log" | grep -v -E "^\(|INFO|WARNING"
