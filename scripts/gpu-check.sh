#!/usr/bin/env bash
# scripts/gpu-check.sh — build the GPU tests here, run them (and compute-sanitizer) on a GPU machine.
#
#   scripts/gpu-check.sh pack   on the build machine (no GPU needed): configures build-gpu/
#                               (Release, sm_90 only, line info for the sanitizer), builds the GPU
#                               test binaries and packs them with their non-CUDA shared libraries
#                               into .gpu-bundle/ (git-ignored), with the list of sanitizer runs.
#   scripts/gpu-check.sh run    on the GPU machine, from the repository root, with .gpu-bundle/
#                               carried along: runs every GPU test through the bundle's `run`
#                               wrapper (which finds CUDA, cuBLAS and cuDNN there), then
#                               compute-sanitizer on the runs listed in .gpu-bundle/sanitize.list.
#                               Logs go to $OUT when it is set, else to .gpu-bundle/logs; the last
#                               lines printed are a summary table. Exit status 0 only if all passed.
#
# Environment: JOBS (build parallelism, default 2), BUILD_DIR (default build-gpu), ARCH (CUDA
# architectures, default 90), TALLY_GPU_BUNDLER (the bundling script, default below),
# SANITIZE=0 to skip compute-sanitizer in `run`.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
bundle=.gpu-bundle
tests=(gpu_test gpu_kernels_test gpu_ops_test)
# The GPU machine takes 64 MiB of working tree in all: the tracked files travel with the bundle.
tree_limit=$((64 * 1024 * 1024))

pack() {
  local build=${BUILD_DIR:-build-gpu} jobs=${JOBS:-2} arch=${ARCH:-90}
  local bundler=${TALLY_GPU_BUNDLER:-/work/shared/tools/gpu-bundle.sh}
  [[ -x $bundler || -f $bundler ]] || { echo "gpu-check: bundling script not found: $bundler" >&2; exit 2; }
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DTALLY_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" \
    -DTALLY_BUILD_BENCH=OFF >/dev/null
  cmake --build "$build" -j "$jobs" --target "${tests[@]}"
  rm -rf "$bundle"
  local bins=()
  for t in "${tests[@]}"; do bins+=("$build/tests/$t"); done
  bash "$bundler" "$bundle" "${bins[@]}"
  # Sanitizer runs: tool, binary, gtest filter. memcheck everywhere (the kernel tests use exact-size
  # buffers, so it sees out-of-bounds accesses; the op tests run inside one arena allocation, so
  # there it sees API misuse and accesses outside the arena), racecheck and synccheck on the
  # kernels with shared memory and barriers.
  cat >"$bundle/sanitize.list" <<'LIST'
memcheck gpu_kernels_test *
memcheck gpu_test *
memcheck gpu_ops_test GpuOps.EveryOp*:GpuOps.BasicBlock*:GpuOps.Tensors*:GpuOps.CrossEntropy*:Optimizer.*
racecheck gpu_kernels_test GpuKernels.RowBroadcasts*:GpuKernels.BatchNorm*:GpuKernels.GroupNorm*:GpuKernels.CrossEntropy*:GpuKernels.Convolution*
synccheck gpu_kernels_test GpuKernels.RowBroadcasts*:GpuKernels.BatchNorm*:GpuKernels.GroupNorm*
LIST
  {
    echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!.gpu-bundle' 2>/dev/null || echo ' (+ local changes)')"
    echo "built  $(date -u +%Y-%m-%dT%H:%M:%SZ), CUDA architectures $arch, $(grep -m1 CMAKE_BUILD_TYPE: "$build/CMakeCache.txt")"
  } >"$bundle/BUILD_INFO"
  local bytes tracked
  bytes=$(du -sb "$bundle" | cut -f1)
  tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  echo "gpu-check: $bundle holds $((bytes / 1024 / 1024)) MiB ($bytes bytes), the tracked tree" \
    "$((tracked / 1024 / 1024)) MiB ($tracked bytes); together at most $((tree_limit / 1024 / 1024)) MiB may travel"
  if ((bytes + tracked > tree_limit - 1024 * 1024)); then
    echo "gpu-check: the bundle is too large to travel to the GPU machine with the working tree" >&2
    exit 1
  fi
  echo "gpu-check: on the GPU machine, from the repository root with $bundle carried: scripts/gpu-check.sh run"
}

run() {
  [[ -x $bundle/run ]] || { echo "gpu-check: no $bundle/run: run 'scripts/gpu-check.sh pack' here first and carry $bundle" >&2; exit 2; }
  local logs=${OUT:-$bundle/logs}
  mkdir -p "$logs"
  local summary=$logs/summary.txt status=0
  {
    echo "== gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    cat "$bundle/BUILD_INFO" 2>/dev/null || true
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
  } >"$summary"
  local results=()
  for t in "${tests[@]}"; do
    local rc=0
    "$bundle/run" "$bundle/bin/$t" --gtest_color=no </dev/null >"$logs/$t.log" 2>&1 || rc=$?
    local line
    line=$(grep -E '^\[ +(PASSED|FAILED|SKIPPED) +\] [0-9]+ tests?' "$logs/$t.log" | tr -s ' \n' ' ' || true)
    # A GPU check that skipped for want of a GPU checked nothing: that is a failure here.
    if grep -q 'no GPU present' "$logs/$t.log"; then
      line="$line(skipped: no GPU present)"
      rc=${rc/#0/98}
    fi
    results+=("$(printf '%-40s rc=%-3s %s' "$t" "$rc" "${line:-no gtest summary}")")
    ((rc == 0)) || status=1
  done
  if [[ ${SANITIZE:-1} != 0 ]]; then
    local cs
    cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1 || true)
    if [[ -z $cs ]]; then
      results+=("compute-sanitizer: not found, skipped")
      status=1
    else
      while read -r tool bin filter; do
        [[ -z $tool || $tool == \#* ]] && continue
        local rc=0
        {
          echo "==== $tool $bin --gtest_filter=$filter"
          "$bundle/run" "$cs" --tool "$tool" --error-exitcode 97 "$bundle/bin/$bin" --gtest_color=no \
            --gtest_filter="$filter" </dev/null
        } >>"$logs/$tool.log" 2>&1 || rc=$?
        local errs
        errs=$(grep -E 'ERROR SUMMARY: [0-9]+' "$logs/$tool.log" | tail -1 || true)
        results+=("$(printf '%-40s rc=%-3s %s' "$tool $bin" "$rc" "${errs:-no sanitizer summary}")")
        ((rc == 0)) || status=1
      done <"$bundle/sanitize.list"
    fi
  fi
  printf '%s\n' "${results[@]}" >>"$summary"
  echo "result: $([[ $status == 0 ]] && echo PASS || echo FAIL)" >>"$summary"
  cat "$summary"
  return $status
}

case ${1:-} in
  pack) pack ;;
  run) run ;;
  *)
    echo "usage: scripts/gpu-check.sh pack|run   (see the top of this file)" >&2
    exit 2
    ;;
esac
