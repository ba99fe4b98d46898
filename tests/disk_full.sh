#!/usr/bin/env bash
# A disk that fills up while tally writes a run's files or a report: the error names the file and
# the system's reason ("No space left on device"), and no temporary is left behind (core/files.h:
# write_file). The full disk is injected through the test hook TALLY_TEST_WRITE_FAIL (tests run as
# root, where a read-only folder or a tiny file system would prove nothing portable).
# Usage: disk_full.sh TALLY
set -uo pipefail
tally=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

out=$(TALLY_TEST_WRITE_FAIL=memory_trace.json:ENOSPC "$tally" train --model resnet20 --data synthetic --steps 3 \
      --batch-size 16 --memory-limit 64MiB --no-eval --no-progress --out "$dir/run" 2>&1) && fail "the run succeeded: $out"
grep -q "cannot write '$dir/run/memory_trace.json': No space left on device" <<<"$out" || fail "run folder: $out"
leftover=$(find "$dir/run" -name '*.tmp*')
[[ -z "$leftover" ]] || fail "temporaries left behind: $leftover"

out=$(TALLY_TEST_WRITE_FAIL=rep.html:EIO "$tally" plan --model resnet20 --input 3x32x32 --batch-size 64 \
      --memory-limit 64MiB --no-layers --report "$dir/rep.html" 2>&1) && fail "the report was written: $out"
grep -q "cannot write '$dir/rep.html': Input/output error" <<<"$out" || fail "report: $out"
leftover=$(find "$dir" -maxdepth 1 -name 'rep.html*')
[[ -z "$leftover" ]] || fail "a report or its temporary was left: $leftover"
echo "disk full: ok"
