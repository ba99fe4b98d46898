#!/usr/bin/env bash
# tests/needed_libraries.sh TALLY — the libraries the executable is linked against. cuBLAS must not
# be one of them: it is opened on first use (kernels/cuda/cublas_library.h), because loading it
# makes 210 MB resident in every process, one that only plans or prints its help included.
set -euo pipefail
needed=$(readelf -d "$1" | awk '/\(NEEDED\)/ { gsub(/[][]/, "", $5); print $5 }')
# The list was read: the C++ runtime and the CUDA runtime are always there.
grep -q '^libstdc++' <<<"$needed" || { echo "readelf listed no libstdc++ for $1: $needed"; exit 1; }
grep -q '^libcudart' <<<"$needed" || { echo "readelf listed no libcudart for $1: $needed"; exit 1; }
if grep -q '^libcublas' <<<"$needed"; then
  echo "$1 is linked against cuBLAS: $(grep '^libcublas' <<<"$needed" | tr '\n' ' ')"
  exit 1
fi
echo "needed libraries: ok ($(wc -l <<<"$needed") libraries, no cuBLAS)"
