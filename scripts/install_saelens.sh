#!/usr/bin/env bash
# Build ./.venv-saelens: a side venv with capserve's core (editable, no engine) and SAELens, for
# `capserve export` (docs/saelens.md) and the tests that train an SAE on a capserve dataset
# (tests/test_saelens_dataset.py) or compare against SAELens's own encode. SAELens 6.54 requires
# transformer-lens<4 and cannot share ./.venv. CPU torch, no torchvision/torchaudio/torchcodec.
# Idempotent: when the venv was built for these pins and this pyproject.toml it returns at once
# (a stamp file, no imports). Usage: scripts/install_saelens.sh
# Environment: PYTHON (the interpreter for the venv), TORCH_CPU_INDEX (PyTorch's CPU wheel index;
# set it empty to use only the indexes pip is configured with), as for scripts/install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-saelens
SAELENS=6.54.0
TORCH=2.13.0
stamp="$venv/capserve-saelens.stamp"
want="sae-lens==$SAELENS torch==$TORCH+cpu pyproject=$(sha256sum pyproject.toml | cut -c1-16)"
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "install_saelens.sh: $venv up to date ($want)"
  exit 0
fi
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
rm -f "$stamp"
py=$venv/bin/python
pip=("$py" -m pip install --quiet --disable-pip-version-check)

# Torch first, pinned to the CPU build (+cpu), from PyTorch's CPU index named as an *extra* index
# only when it answers — the same arrangement, for the same reasons, as scripts/install.sh.
TORCH_CPU_INDEX=${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}
source scripts/torch_index.sh
torch_cpu_index "$py" install_saelens.sh
"${pip[@]}" ${torch_index[@]+"${torch_index[@]}"} "torch==$TORCH+cpu"
# Then capserve's core and SAELens (the `saelens` extra pins it); the torch above already satisfies its dependency tree's torch requirement, so pip
# keeps it (it would otherwise reach for PyPI's CUDA build).
# (held under .egg-info.lock: scripts/test.sh runs this beside install.sh, and both build capserve.egg-info here)
flock .egg-info.lock "${pip[@]}" -e ".[saelens]" "sae-lens==$SAELENS" "torch==$TORCH+cpu"
"$py" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$py" -c "import torch, sys; sys.exit(torch.version.cuda and f'install_saelens.sh: torch {torch.__version__} is a CUDA build; need the CPU build')"
"$py" -c "import sae_lens, datasets, torch, provider.dataset.saelens_export; print('install_saelens.sh: ok: sae-lens', sae_lens.__version__, 'datasets', datasets.__version__, 'torch', torch.__version__)"
echo "$want" > "$stamp"
