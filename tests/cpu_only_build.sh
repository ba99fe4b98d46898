#!/usr/bin/env bash
# The smallest build — none of the optional backends: no CUDA, no oneDNN, no MPI — still compiles,
# links and trains, as on a machine without their Debian packages. The CUDA branches of
# core/dispatch.h and core/device.cpp are `if constexpr` and must leave no reference to the CUDA
# kernels behind; the CPU convolutions fall back to im2col + GEMM; the communicator is the local
# one. Built without optimization (CMAKE_BUILD_TYPE None: no -O flags): the check is what gets
# instantiated and linked, which -O0 tests at least as strictly (no dead code is dropped before
# the link), and it compiles in about 70% of a Release build's time. And as a unity build (16 files
# a unit, CMAKE_UNITY_BUILD): the headers are parsed once per unit instead of once per file — 2.4
# CPU-minutes against 4.5 here, what made it the suite's longest test; the programs too, and the
# libraries as the main build's are (CMakeLists.txt, TALLY_UNITY). A unit fails to compile when two files of one library
# define the same name in an anonymous namespace: give each its own. Without precompiled headers
# (CMAKE_DISABLE_PRECOMPILE_HEADERS): each library made its own, 9 x 4.5 s, for units that parse
# their headers once anyway — 161 CPU-seconds against 208, 2:09 against 2:46 here. Usage:
# cpu_only_build.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1
build=$2/cpu-only
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=None -DTALLY_CUDA=OFF -DTALLY_ONEDNN=OFF -DTALLY_MPI=OFF \
  -DTALLY_BUILD_TESTS=OFF -DTALLY_BUILD_BENCH=OFF -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=16 \
  -DCMAKE_DISABLE_PRECOMPILE_HEADERS=ON > "$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
cmake --build "$build" -j 2 --target tally > "$build.build.log" 2>&1 || { tail -50 "$build.build.log"; exit 1; }
version=$("$build/apps/tally" --version)
echo "$version"
[[ "$version" == *"CPU-only build (no CUDA backend)"* && "$version" == *"CPU conv: im2col"* && "$version" != *MPI* ]] \
  || { echo "expected a build without CUDA, oneDNN and MPI, found: $version"; exit 1; }
rm -rf "$build/run"  # a finished run's folder is never written over
"$build/apps/tally" train --data synthetic --steps 2 --batch-size 8 --no-progress --no-eval --memory-limit 64MiB \
  --out "$build/run"  # (no evaluation: the test set at -O0 took four times the 2 steps)
summary=$build/run/summary.json
grep -q '"steps": 2' "$summary" || { echo "no summary of 2 steps in $summary"; exit 1; }
peak=$(grep -m1 '"peak_bytes"' "$summary" | tr -dc 0-9)
predicted=$(grep -m1 '"predicted_peak_bytes"' "$summary" | tr -dc 0-9)
[[ -n "$peak" && "$peak" == "$predicted" ]] || { echo "measured peak $peak != predicted $predicted"; exit 1; }
echo "cpu-only build: ok"
