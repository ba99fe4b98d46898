#!/usr/bin/env bash
# tests/run_folder_lock.sh TALLY — a run folder in use is refused by name, whatever comes second:
# a new run into it (it said "holds the metrics.csv of an earlier run" while that run was going)
# and a resume of it ("no checkpoint in it"); a run that ends removes its lock file (it was left).
set -u
tally=$1
dir=$(mktemp -d /tmp/tally-lock-XXXXXX)
trap 'kill $pid 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
"$tally" train --model resnet20 --data synthetic --batch-size 32 --steps 400 --memory-limit 64MiB --no-eval \
  --no-progress --threads 1 --out "$dir/run" >"$dir/first.log" 2>&1 &
pid=$!
for _ in $(seq 100); do [[ -s $dir/run/.lock && -f $dir/run/metrics.csv ]] && break; sleep 0.1; done
[[ -s $dir/run/.lock ]] || fail "the first run took no lock: $(cat "$dir/first.log")"
for second in "--out $dir/run --steps 1" "--resume $dir/run"; do
  # shellcheck disable=SC2086  # $second is a list of flags
  msg=$("$tally" train --model resnet20 --data synthetic $second --no-progress 2>&1) && fail "$second: accepted"
  grep -q "another tally process (pid $pid) is using this run folder" <<<"$msg" || fail "$second: $msg"
  echo "ok: $second: refused while the first run goes"
done
kill -INT $pid  # ends at its next step, writing a checkpoint
wait $pid
[[ -e $dir/run/.lock ]] && fail "the run ended and left $dir/run/.lock"
echo "ok: the lock file is gone with the run"
exit 0
