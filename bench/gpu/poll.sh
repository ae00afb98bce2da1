#!/usr/bin/env bash
# One device call's wait on session.sh: until /tmp/results/progress holds PATTERN at least COUNT
# times (default 1), or about 285 s, then the results so far packed into $OUT/r.tgz.
#   bash bench/gpu/poll.sh "start dataset"        bash bench/gpu/poll.sh "rc=" 2
# A machine that went back between calls comes back bare: then this says so at once, rather than
# spending the call's device time waiting on a file that will never come.
pattern=$1 count=${2:-1} progress=/tmp/results/progress
test -f "$progress" || { echo "no $progress: a fresh machine, the session's results are gone"; exit 3; }
for _ in $(seq 95); do
  [ "$(grep -c -- "$pattern" "$progress")" -ge "$count" ] && break
  sleep 3
done
cat "$progress"
tar czf "$OUT/r.tgz" -C /tmp results
