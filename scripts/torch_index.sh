# Sourced by scripts/install.sh and scripts/install_saelens.sh. `torch_cpu_index PYTHON NAME` sets
# the array `torch_index` to (--extra-index-url "$TORCH_CPU_INDEX") when that index answers, else ():
# - --extra-index-url adds to pip's configured sources (pip.conf's index-url, extra-index-url,
#   find-links, PIP_* variables) instead of replacing them as --index-url would, so a machine
#   whose wheels come from local indexes or a mirror (this project's CI) still finds them;
# - an unreachable index is left out rather than named, because pip retries every index it is
#   given (5 times, up to its default-timeout each when packets are dropped) for each package.
torch_cpu_index() {
  torch_index=()
  [ -n "$TORCH_CPU_INDEX" ] || return 0
  if "$1" - "$TORCH_CPU_INDEX" "$2" <<'PY'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10).close()
except Exception as e:
    print(f"{sys.argv[2]}: {sys.argv[1]} unreachable ({e}); torch from pip's configured sources",
          file=sys.stderr)
    sys.exit(1)
PY
  then torch_index=(--extra-index-url "$TORCH_CPU_INDEX"); fi
}
