#!/usr/bin/env bash
# expect_fail.sh REGEX COMMAND... — passes when COMMAND exits non-zero and its output matches REGEX.
regex=$1; shift
out=$("$@" 2>&1); rc=$?
if [[ $rc -eq 0 ]]; then echo "expected a non-zero exit from: $*"; echo "$out"; exit 1; fi
if ! grep -Eq -- "$regex" <<<"$out"; then echo "output of '$*' does not match /$regex/:"; echo "$out"; exit 1; fi
echo "ok: exit $rc, message matches /$regex/"
