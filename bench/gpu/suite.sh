#!/usr/bin/env bash
# The GPU suite (not CI): on the GPU host, after ../shared/gpu/install.sh unpacked vLLM 0.26 into
# /tmp/site, run the engine, intervention and architecture tests (CUDA graphs on, the GPU default)
# and write a JUnit report. Two parts, each inside one device call (10 minutes):
#   bash bench/gpu/suite.sh OUTDIR archs   # the architecture matrix beyond Llama/Qwen2/GPT-2, fp16/bf16
#   bash bench/gpu/suite.sh OUTDIR core    # everything else, the three archs' matrix rows included
#   bash bench/gpu/suite.sh OUTDIR capture # the capture path and attention internals alone (Llama), ~10 min
#   bash bench/gpu/suite.sh OUTDIR quick   # the capture and intervention tests, the compiled engine's, and Llama's
#                                          # attention internals; engines without Inductor, ~5 min
# Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-bench/results}; part=${2:-core}; shift 2 || true
mkdir -p "$out"
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
# Engines started after a test touched CUDA in this process must not be forked from it.
export VLLM_WORKER_MULTIPROC_METHOD=spawn
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$part" = archs ]; then
  tests=(tests/test_architectures.py tests/test_engine_precision.py -k "not llama and not qwen2 and not gpt2")
elif [ "$part" = capture ]; then
  tests=(tests/test_arena.py tests/test_arena_growth.py tests/test_outbox.py tests/test_arena_writer.py tests/test_engine_capture.py tests/test_attention.py tests/test_architectures.py
         -k "not test_architectures or (llama and (attention or pattern or per_head))")
elif [ "$part" = quick ]; then
  export CAPSERVE_QUICK_GPU_ENGINES=1
  tests=(tests/test_arena.py tests/test_arena_growth.py tests/test_outbox.py tests/test_arena_writer.py tests/test_engine_capture.py tests/test_engine_interventions.py
         tests/test_engine_compiled.py tests/test_architectures.py -k "not test_architectures or (llama and (attention or pattern or per_head))")
else
  tests=(tests/test_engine_capture.py tests/test_engine_interventions.py tests/test_engine_compiled.py tests/test_schemas.py
         tests/test_arena.py tests/test_arena_growth.py tests/test_outbox.py tests/test_arena_writer.py tests/test_engine_config.py tests/test_architectures.py -k "not test_architectures or llama or qwen2 or gpt2")
fi
python3 -m pytest "${tests[@]}" -q -p no:cacheprovider --junitxml="$out/gpu_suite_$part.xml" "$@" 2>&1 \
  | tee "$out/gpu_suite_$part.log" | grep -v -E "^\(|INFO|WARNING"
