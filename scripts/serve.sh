#!/usr/bin/env bash
# From nothing to a running app: install, then `serve run serve_config.yaml` (the built-in tiny
# model on CPU, or the configured model with one replica per GPU).
#
# serve run shuts the app down gracefully on SIGINT only (replicas drain, engines stop and remove
# their shared memory); a SIGTERM (kill, docker stop, systemd) would end it at once, and the
# engines would die with the cluster, leaving /dev/shm/capserve-* behind. So serve run runs as a
# child that gets a SIGINT for either signal.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="$PWD/.venv/bin:$PATH"
set -m  # job control: without it a background job ignores SIGINT, and Python would too
# A shell that was itself started in the background (nohup ... &, a CI runner) hands SIGINT down as
# ignored, and a script cannot trap or reset a signal ignored on entry: serve run gets it back here.
env --default-signal=INT serve run serve_config.yaml "$@" &
serve_pid=$!
trap 'kill -INT "$serve_pid" 2>/dev/null || true' INT TERM
while :; do
  status=0
  wait "$serve_pid" || status=$?
  kill -0 "$serve_pid" 2>/dev/null || exit "$status"  # a trapped signal ends `wait` early: wait again
done
