#!/usr/bin/env bash
# `tally device`: on a machine with a GPU it describes it and saves a device file that reads back
# (its fields named); without one it is a clear error and writes nothing; a device that is not a
# GPU, or a file it cannot write, is refused with a message naming it. Usage: device_command.sh TALLY
set -uo pipefail
tally=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

out=$("$tally" device --device cpu 2>&1) && fail "--device cpu accepted: $out"
grep -q "expected a GPU (cuda or cuda:N), found cpu" <<<"$out" || fail "--device cpu: $out"

version=$("$tally" --version)  # whole first: grep -q quitting early would end tally with SIGPIPE (pipefail)
if ! grep -qE "GPU: none detected|no CUDA backend" <<<"$version"; then
  out=$("$tally" device --save "$dir/gpu.json" 2>&1) || fail "tally device on a GPU machine: $out"
  grep -q "compute capability" <<<"$out" || fail "no description printed: $out"
  for field in '"format": "tally device file"' '"compute_capability"' '"cudnn_version"' '"cudnn_properties"'; do
    grep -q "$field" "$dir/gpu.json" || fail "the saved file lacks $field"
  done
  out=$("$tally" device --save "$dir/missing/gpu.json" 2>&1) && fail "a file in a missing folder was written"
  grep -q "cannot write" <<<"$out" || fail "unwritable file: $out"
else
  out=$("$tally" device --save "$dir/gpu.json" 2>&1) && fail "tally device without a GPU succeeded: $out"
  grep -qE "expected a GPU to describe, found none|has no CUDA backend" <<<"$out" || fail "without a GPU: $out"
  [[ ! -e "$dir/gpu.json" ]] || fail "a device file was written without a GPU"
fi
echo "device command: ok"
