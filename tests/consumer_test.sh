#!/usr/bin/env bash
# The installed package, used as a user would: `cmake --install` into a temporary prefix, then
# examples/consumer configured, built and run from a copy outside the source tree (both of its
# programs: README's first example and docs/models.md's).
#   consumer_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1 src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >"$work/install.log"
test -f "$work/prefix/lib/cmake/tally/tallyConfig.cmake" || { echo "no tallyConfig.cmake installed"; exit 1; }
cp -r "$src/examples/consumer" "$work/consumer"
cmake -S "$work/consumer" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release >"$work/configure.log" \
  || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
cd "$work" && "$work/build/consumer"
"$work/build/my_resnet"
"$src/tests/my_cli.sh" "$work/build/my_cli"
