#!/usr/bin/env bash
# scripts/gpu-check.sh — build tally's GPU programs here, check and time them on a GPU machine.
#
#   scripts/gpu-check.sh pack          on the build machine (no GPU needed): configures build-gpu/
#                                      (Release, sm_90, line info for the sanitizer, no oneDNN),
#                                      builds the GPU tests, tally, bench_kernels and bench_train,
#                                      and packs them with their non-CUDA shared libraries and
#                                      Fashion-MNIST into .gpu-bundle/bundle.tar.xz (git-ignored),
#                                      which must travel with the tracked tree in 60 MiB; `run`
#                                      unpacks it on arrival. Over the limit it fails, naming the
#                                      largest parts.
#   scripts/gpu-check.sh run STEP...   on the GPU machine, from the repository root, .gpu-bundle/
#                                      carried along. Steps, each well under 10 minutes:
#        env       nvidia-smi, the CUDA/cuBLAS/cuDNN versions loaded, `tally --version`  (~10 s)
#        tests     the three GPU test binaries (cuDNN's choices logged)                 (~1 min)
#        sanitize  compute-sanitizer: memcheck on every binary (the 1 PiB cudaMalloc test
#                  excluded), racecheck and synccheck on tally's own kernels only        (~3-6 min)
#        train     `make train`'s recipe on the GPU (ResNet-20 on Fashion-MNIST, packed by
#                  `pack`, batch 512 in 32 MiB, 2 epochs), then 40 steps of the MBP demo
#                  with the convolutions through cuDNN's graph API                       (~1 min)
#        resnet50  `tally plan --device cuda` for ResNet-50 224x224 batch 4096 in 8 GiB,
#                  3 steps of it, and 3 steps of native batch m (the plan's micro-batch);
#                  then a few steps of batch 4096 in 8 GiB with --recompute all and of
#                  3x1024x1024 batch 2 in 1 GiB (auto recomputation), exact peaks reported (~4 min)
#        compare   bench/compare_pytorch.py with the PyTorch there: ResNet-20 batch 128 and
#                  ResNet-50 batch 256, TF32 off and on and bf16 (PyTorch: autocast +
#                  channels_last); ResNet-50 also against PyTorch with cudnn.benchmark   (~5 min)
#        profile   `tally train --profile`: GPU time per op of ResNet-50 (batch 256) and
#                  ResNet-20 (batch 128) training steps                                 (~1 min)
#        bench     bench_train on the GPU                                              (~2 min)
#   scripts/gpu-check.sh build-deps    here: download the Debian packages a build on the GPU
#                                      machine needs into .gpu-debs/ (git-ignored).
#   scripts/gpu-check.sh build-there   on the GPU machine, .gpu-debs/ carried: unpack them into a
#                                      prefix, configure and build build-gpu/ with nvcc there, and
#                                      re-pack .gpu-bundle/ from it (for a fix made after `pack`).
#
# Logs: one file per binary or tool in $LOGS (default /tmp/tally-gpu-logs), written as the step
# runs; after every command they are packed into $OUT/logs.tar.gz and the summary so far is
# copied to $OUT/summary.txt (OUT defaults to .gpu-bundle/out), so a call killed at its limit
# still returns what ran. The last lines printed are the summary table; exit status 0 only if
# everything passed.
#
# Environment: JOBS (build parallelism, default: all cores), BUILD_DIR (default build-gpu), ARCH
# (CUDA architectures, default 90), STEP_TIMEOUT (seconds per binary, default 420).
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
bundle=.gpu-bundle
debs=.gpu-debs
tests=(gpu_test gpu_kernels_test gpu_ops_test gpu_bf16_test)
programs=("${tests[@]/#/tests/}" apps/tally bench/bench_kernels bench/bench_train)
# The GPU machine takes 64 MiB of working tree in all: the tracked files travel with the bundle.
# The bundle and the tracked tree together stay under 60 MiB, a margin for untracked notes.
tree_limit=$((64 * 1024 * 1024))
bundle_limit=$((60 * 1024 * 1024))

# ---- packing -------------------------------------------------------------------------------------

# Copies each program into $bundle/bin and every shared library it needs into $bundle/lib, except
# the C runtime and the CUDA libraries, which come from the GPU machine.
bundle_programs() {
  local skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libstdc\+\+|libgcc_s|libcuda\.|libcudart|libcublas|libcudnn|libnccl|libnvrtc|libnvJitLink)'
  mkdir -p "$bundle/bin" "$bundle/lib"
  local prog name path
  for prog in "$@"; do
    cp -f "$prog" "$bundle/bin/"
    while read -r name path; do
      [[ $name =~ $skip ]] && continue
      cp -fL "$path" "$bundle/lib/$name"
    done < <(ldd "$prog" | awk '/=> \//{print $1, $3}')
  done
  write_run_wrapper
}

# $bundle/run: runs a command with the bundle's libraries and the GPU machine's CUDA runtime,
# cuBLAS, cuBLASLt and cuDNN — all four from ONE tree, so that cuDNN finds the cuBLASLt it was built
# with: the nvidia/* packages beside the machine's PyTorch first, else the CUDA toolkit.
# TALLY_CUDA_LIBS (folders, colon-separated) overrides the search. Prints the files it chose.
write_run_wrapper() {
  cat >"$bundle/run" <<'RUN'
#!/usr/bin/env bash
here=$(cd "$(dirname "$0")" && pwd)
libs=(libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcudnn.so.9)
find_all() {  # the folders holding each of ${libs[@]} under the given roots, or failure
  local dirs="" d lib
  for lib in "${libs[@]}"; do
    d=$(find "$@" -name "$lib" -print -quit 2>/dev/null | xargs -r dirname)
    [[ -n $d ]] || return 1
    [[ :$dirs: == *:$d:* ]] || dirs=${dirs:+$dirs:}$d
  done
  echo "$dirs"
}
cuda=${TALLY_CUDA_LIBS:-}
if [[ -z $cuda ]]; then
  site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null)
  [[ -n $site && -d $site/nvidia ]] && cuda=$(find_all "$site/nvidia")
  [[ -n $cuda ]] || cuda=$(find_all /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local /opt /usr/lib 2>/dev/null)
fi
# NCCL (the data-parallel backend; linked by every program of a build that has it): beside the
# others when there, else wherever it is found.
nccl=$(IFS=:; for d in $cuda; do [[ -e $d/libnccl.so.2 ]] && { echo "$d"; break; }; done)
if [[ -z $nccl ]]; then
  nccl=$(find ${site:+$site/nvidia} /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib -name libnccl.so.2 -print -quit \
           2>/dev/null | xargs -r dirname)
  [[ -n $nccl ]] && cuda=${cuda:+$cuda:}$nccl
fi
if [[ -z ${TALLY_RUN_QUIET:-} ]]; then
  if [[ -n $cuda ]]; then
    chosen=""
    for lib in "${libs[@]}"; do
      f=$(IFS=:; for d in $cuda; do [[ -e $d/$lib ]] && { readlink -f "$d/$lib"; break; }; done)
      chosen+=" ${f:-$lib?}"
    done
    echo "run: CUDA libraries:$chosen" >&2
  else
    echo "run: no CUDA runtime/cuBLAS/cuDNN found on this machine (CPU-only use)" >&2
  fi
fi
export LD_LIBRARY_PATH=$here/lib${cuda:+:$cuda}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
exec "$@"
RUN
  chmod +x "$bundle/run"
}

# Sanitizer runs: tool, binary, gtest filter, extra sanitizer options. memcheck everywhere (the
# kernel tests use exact-size buffers, so it sees out-of-bounds accesses; the op tests run inside
# one arena allocation, where it sees API misuse and accesses outside the arena) except the test
# whose 1 PiB cudaMalloc fails on purpose and the whole-ResNet steps (time); racecheck and
# synccheck only on tally's own kernels (--kernel-name), not inside cuBLAS or cuDNN.
write_sanitize_list() {
  cat >"$bundle/sanitize.list" <<'LIST'
memcheck gpu_kernels_test *:-GpuKernels.ConvolutionEveryCudnnAlgorithm*
memcheck gpu_test *:-Gpu.ReservingMoreThanTheDeviceHasIsAClearError
memcheck gpu_ops_test GpuOps.EveryOp*:GpuOps.BasicBlock*:GpuOps.Tensors*:GpuOps.CrossEntropy*:Optimizer.*
racecheck gpu_kernels_test GpuKernels.*:-GpuKernels.ConvolutionEveryCudnnAlgorithm* --kernel-name kns=tally
synccheck gpu_kernels_test GpuKernels.*:-GpuKernels.ConvolutionEveryCudnnAlgorithm* --kernel-name kns=tally
memcheck gpu_bf16_test GpuBf16Kernels.*:GpuBf16Ops.EveryOp*
racecheck gpu_bf16_test GpuBf16Kernels.* --kernel-name kns=tally
synccheck gpu_bf16_test GpuBf16Kernels.* --kernel-name kns=tally
LIST
}

# The bundle's size, measured and explained. What travels is one xz archive: the programs carry
# their CUDA kernels for one architecture and compress about 4x; OpenBLAS (36 MB) about 5x; the
# data set is packed as raw IDX (54 MB), which xz takes to 27 MB against the 30 MB of Debian's
# gzip files. oneDNN (libdnnl, 39 MB) is not built in (configure_build): no GPU step runs a CPU
# convolution but the GPU tests' CPU references, which use the im2col + GEMM route either way.
pack_from() {  # BUILD_DIR ARCH [unpacked]: "unpacked" (build-there) leaves the bundle as it is
  local build=$1 arch=$2 keep=${3:-}
  rm -rf "$bundle"
  local bins=() p
  for p in "${programs[@]}"; do bins+=("$build/$p"); done
  bundle_programs "${bins[@]}"
  # Fashion-MNIST for `make train`'s recipe (the GPU machine has no Debian packages), as raw IDX
  # files (tally reads them plain or gzip-compressed; raw ones compress better in the archive).
  if [[ -d /usr/share/datasets/fashion-mnist ]]; then
    mkdir -p "$bundle/data/fashion-mnist"
    local f
    for f in /usr/share/datasets/fashion-mnist/*-ubyte.gz; do
      gzip -dc "$f" >"$bundle/data/fashion-mnist/$(basename "$f" .gz)"
    done
  fi
  write_sanitize_list
  {
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- . 2>/dev/null || echo ' (+ local changes)')"
    echo "built  $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n), CUDA architectures $arch, $(grep -m1 CMAKE_BUILD_TYPE: "$build/CMakeCache.txt")"
  } >"$bundle/BUILD_INFO"
  local parts unpacked bytes tracked
  parts=$(cd "$bundle" && find . -type f -printf '%s %P\n' | sort -rn | head -8 |
    awk '{ printf "  %6.1f MiB  %s\n", $1 / 1048576, $2 }')
  unpacked=$(du -sb "$bundle" | cut -f1)
  if [[ $keep == unpacked ]]; then  # already where it runs: nothing travels, nothing to compress
    echo "gpu-check: $bundle holds $(awk '{ printf "%.1f MiB", $1 / 1048576 }' <<<"$unpacked"), unpacked, ready to run"
    return
  fi
  echo "gpu-check: compressing $((unpacked / 1024 / 1024)) MiB with xz -9 (a few minutes)"
  tar -C "$bundle" -cf - . | xz -9 -T0 >/tmp/tally-gpu-bundle.tar.xz
  rm -rf "$bundle" && mkdir -p "$bundle" && mv /tmp/tally-gpu-bundle.tar.xz "$bundle/bundle.tar.xz"
  bytes=$(du -sb "$bundle" | cut -f1)
  tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  local mib='{ printf "%.1f MiB", $1 / 1048576 }'
  echo "gpu-check: $bundle/bundle.tar.xz $(awk "$mib" <<<"$bytes") ($bytes bytes; unpacked $(awk "$mib" <<<"$unpacked")) +" \
    "tracked tree $(awk "$mib" <<<"$tracked") = $(awk "$mib" <<<"$((bytes + tracked))") of the" \
    "$((bundle_limit / 1024 / 1024)) MiB that may travel (the hard limit is $((tree_limit / 1024 / 1024)) MiB)"
  echo "gpu-check: the largest parts, unpacked:"
  echo "$parts"
  if ((bytes + tracked > bundle_limit)); then
    echo "gpu-check: the bundle is too large to travel to the GPU machine with the working tree:" \
      "$(awk "$mib" <<<"$((bytes + tracked))") > $((bundle_limit / 1024 / 1024)) MiB; the largest parts are listed above" >&2
    exit 1
  fi
}

configure_build() {  # BUILD_DIR ARCH [cmake args...]
  local build=$1 arch=$2
  shift 2
  # No oneDNN: its 39 MB library would not travel, and no GPU step needs it (see pack_from).
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DTALLY_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" \
    -DTALLY_ONEDNN=OFF -DCMAKE_CUDA_FLAGS="-lineinfo" "$@" >/dev/null
  local targets=() p
  for p in "${programs[@]}"; do targets+=("$(basename "$p")"); done
  cmake --build "$build" -j "${JOBS:-$(nproc)}" --target "${targets[@]}"
}

pack() {
  local build=${BUILD_DIR:-build-gpu} arch=${ARCH:-90}
  configure_build "$build" "$arch"
  pack_from "$build" "$arch"
  echo "gpu-check: on the GPU machine, from the repository root with $bundle carried: scripts/gpu-check.sh run env tests ..."
}

# ---- building on the GPU machine -----------------------------------------------------------------

# The Debian packages (and what they pull in that the GPU machine lacks) for a build there.
build_debs=(libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev googletest libbenchmark-dev
  libbenchmark1debian libopenblas-dev libopenblas0 libopenblas0-pthread libopenblas-pthread-dev libgfortran5
  libgomp1 pkg-config pkgconf pkgconf-bin libpkgconf3)

build_deps() {
  rm -rf "$debs" && mkdir -p "$debs"
  (cd "$debs" && apt-get download "${build_debs[@]}")
  echo "gpu-check: $(du -sh "$debs" | cut -f1) of packages in $debs: carry it, then run scripts/gpu-check.sh build-there"
}

build_there() {
  [[ -d $debs ]] || { echo "gpu-check: no $debs: run 'scripts/gpu-check.sh build-deps' here first and carry it" >&2; exit 2; }
  local prefix=${DEB_PREFIX:-/tmp/tally-debs} build=${BUILD_DIR:-build-gpu} arch=${ARCH:-90} f
  mkdir -p "$prefix"
  for f in "$debs"/*.deb; do dpkg-deb -x "$f" "$prefix" 2>/dev/null || (cd "$prefix" && ar p "$OLDPWD/$f" data.tar.xz | tar xJ); done
  local multi=$prefix/usr/lib/x86_64-linux-gnu
  # Debian's pkg-config files name /usr (prefix=, exec_prefix=, and OpenBLAS's absolute libdir= and
  # includedir=): point every one at the prefix. (The CMake packages find themselves relative to
  # their own location.)
  find "$prefix" -name '*.pc' -print0 | xargs -0 -r sed -i -E "s#^([a-z_]+)=/usr#\1=$prefix/usr#"
  # The OpenBLAS alternatives link (/etc/alternatives) does not unpack: make the plain names.
  [[ -e $multi/libopenblas.so ]] || ln -sf openblas-pthread/libopenblas.so "$multi/libopenblas.so"
  [[ -e $multi/libopenblas.so.0 ]] || ln -sf openblas-pthread/libopenblas.so.0 "$multi/libopenblas.so.0"
  export PKG_CONFIG_PATH=$multi/pkgconfig:$multi/openblas-pthread/pkgconfig:$prefix/usr/share/pkgconfig
  export LIBRARY_PATH=$multi:$multi/openblas-pthread${LIBRARY_PATH:+:$LIBRARY_PATH}
  export LD_LIBRARY_PATH=$multi:$multi/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PATH=$PATH:$prefix/usr/bin  # pkg-config, where the machine has none
  [[ -e $prefix/usr/bin/pkg-config ]] || ln -sf pkgconf "$prefix/usr/bin/pkg-config"
  local cudnn=${CUDNN_ROOT:-$(python3 -c 'import nvidia.cudnn as c; print(list(c.__path__)[0])' 2>/dev/null || echo /usr/local/cuda)}
  local gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  configure_build "$build" "$arch" "${gen[@]}" -DCMAKE_PREFIX_PATH="$prefix/usr" -DCUDNN_ROOT="$cudnn"
  # What was found, and from where: every package should come from the prefix.
  grep -E '^(fmt_DIR|nlohmann_json_DIR|CLI11_DIR|GTest_DIR|benchmark_DIR|CUDNN_LIBRARY|CUDNN_INCLUDE_DIR):' "$build/CMakeCache.txt"
  echo "openblas: $(pkg-config --cflags --libs openblas)"
  pack_from "$build" "$arch" unpacked
}

# ---- running on the GPU machine ------------------------------------------------------------------

logs=${LOGS:-/tmp/tally-gpu-logs}
out=${OUT:-$bundle/out}
summary=""
status=0

note() { echo "$*" | tee -a "$summary"; }
publish() {  # the logs so far, where they come back from
  mkdir -p "$out"
  tar -C "$logs" -czf "$out/logs.tar.gz.tmp" . && mv "$out/logs.tar.gz.tmp" "$out/logs.tar.gz"
  cp "$summary" "$out/summary.txt"
}

unpack_if_needed() {
  if [[ ! -x $bundle/run && -f $bundle/bundle.tar.xz ]]; then
    tar -C "$bundle" -xJf "$bundle/bundle.tar.xz" && rm -f "$bundle/bundle.tar.xz"
  fi
  [[ -x $bundle/run ]] || { echo "gpu-check: no $bundle/run: run 'scripts/gpu-check.sh pack' here first and carry $bundle" >&2; exit 2; }
}

# run_logged NAME LOG CMD...: runs CMD (under the step timeout) into LOG, records its exit status.
run_logged() {
  local name=$1 log=$2 rc=0
  shift 2
  echo "==== $(date -u +%H:%M:%S) $*" >>"$log"
  timeout --kill-after=10 "${STEP_TIMEOUT:-420}" "$@" </dev/null >>"$log" 2>&1 || rc=$?
  echo "==== exit $rc after $SECONDS s of the step" >>"$log"
  last_rc=$rc
  publish
  ((rc == 0)) || status=1
  [[ $rc == 124 || $rc == 137 ]] && note "$(printf '%-44s TIMED OUT' "$name")"
  return 0
}

step_env() {
  local log=$logs/env.log
  {
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    echo
    "$bundle/run" "$bundle/bin/tally" --version 2>&1
    cat "$bundle/BUILD_INFO"
  } >"$log"
  note "$(grep -m1 -o 'GPU: .*' "$log" || echo 'GPU: none detected')"
}

step_tests() {
  local t line
  for t in "${tests[@]}"; do
    local log=$logs/$t.log
    : >"$log"
    TALLY_LOG_CONV=1 run_logged "$t" "$log" "$bundle/run" "$bundle/bin/$t" --gtest_color=no
    line=$(grep -E '^\[ +(PASSED|FAILED|SKIPPED) +\] [0-9]+ tests?' "$log" | tr -s ' \n' ' ' || true)
    if grep -q 'no GPU present' "$log"; then  # a check that skipped for want of a GPU checked nothing
      line="$line(skipped: no GPU present)"
      status=1
    fi
    note "$(printf '%-44s rc=%-3s %s' "$t" "$last_rc" "${line:-no gtest summary}")"
  done
}

step_sanitize() {
  local cs
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1 || true)
  if [[ -z $cs ]]; then
    note "compute-sanitizer: not found, skipped"
    status=1
    return
  fi
  local tool bin filter extra
  while read -r tool bin filter extra; do
    [[ -z $tool || $tool == \#* ]] && continue
    local log=$logs/$tool.log
    run_logged "$tool $bin" "$log" "$bundle/run" "$cs" --tool "$tool" --error-exitcode 97 --print-limit 20 $extra \
      "$bundle/bin/$bin" --gtest_color=no --gtest_filter="$filter"
    local errs
    errs=$(grep -E 'ERROR SUMMARY: [0-9]+|RACECHECK SUMMARY' "$log" | tail -1 || true)
    note "$(printf '%-44s rc=%-3s %s' "$tool $bin" "$last_rc" "${errs:-no sanitizer summary}")"
  done <"$bundle/sanitize.list"
}

step_train() {
  local log=$logs/train.log run=/tmp/tally-gpu-train
  rm -rf "$run"
  if [[ -d $bundle/data/fashion-mnist ]]; then  # the Makefile's train target, on the GPU
    run_logged "tally train (cuda, make train recipe)" "$log" "$bundle/run" "$bundle/bin/tally" train --model resnet20 \
      --data "fashion-mnist:$bundle/data/fashion-mnist" --epochs 2 --batch-size 512 --memory-limit 32MiB --lr 0.4 \
      --warmup-epochs 0.5 --schedule cosine --device cuda --out "$run" --no-progress
  else  # no data set packed: the synthetic MBP demo (batch 256 in 48 MiB)
    run_logged "tally train (cuda, synthetic demo)" "$log" "$bundle/run" "$bundle/bin/tally" train --model resnet20 \
      --data synthetic --epochs 5 --batch-size 256 --memory-limit 48MiB --lr 0.1 --schedule onecycle --device cuda \
      --out "$run" --no-progress
  fi
  note "$(printf '%-44s rc=%-3s %s' "tally train cuda" "$last_rc" "$(grep -E 'test accuracy|peak' "$log" | tail -2 | tr '\n' ' ')")"
  [[ -f $run/summary.json ]] && cp "$run/summary.json" "$logs/train-summary.json"
  [[ -f $run/memory.svg ]] && cp "$run/memory.svg" "$logs/train-memory.svg"
  # The convolutions through cuDNN's graph (backend) API instead of the legacy one: the same MBP
  # demo, its plan exact (the peak line), its loss printed beside the legacy run's.
  local glog=$logs/train-graph-api.log
  rm -rf "$run-graph"
  run_logged "tally train (cuda, graph API)" "$glog" "$bundle/run" env TALLY_CUDNN_CONV_API=graph \
    "$bundle/bin/tally" train --model resnet20 --data synthetic --steps 40 --batch-size 256 --memory-limit 48MiB \
    --device cuda --out "$run-graph" --no-progress --no-eval
  note "$(printf '%-44s rc=%-3s %s' "tally train cuda graph API" "$last_rc" "$(grep -E 'train loss|peak' "$glog" | tail -2 | tr '\n' ' ')")"
  publish
}

step_resnet50() {
  local log=$logs/resnet50.log run=/tmp/tally-gpu-resnet50
  run_logged "tally plan (cuda, resnet50)" "$log" "$bundle/run" "$bundle/bin/tally" plan --model resnet50 \
    --input 3x224x224 --batch-size 4096 --memory-limit 8GiB --device cuda
  note "$(printf '%-44s rc=%-3s %s' "tally plan cuda resnet50" "$last_rc" "$(grep 'plan:' "$log" | tail -1)")"
  rm -rf "$run"
  run_logged "tally train resnet50 4096 in 8GiB" "$log" "$bundle/run" "$bundle/bin/tally" train --model resnet50 \
    --data synthetic:3x224x224 --batch-size 4096 --memory-limit 8GiB --steps 4 --lr 0.1 --schedule constant \
    --no-augment --device cuda --out "$run" --no-progress
  note "$(printf '%-44s rc=%-3s %s' "train resnet50 B=4096 8GiB" "$last_rc" "$(grep -E '^memory:|img/s' "$log" | tail -1)")"
  [[ -f $run/summary.json ]] && cp "$run/summary.json" "$logs/resnet50-mbp-summary.json"
  [[ -f $run/memory.svg ]] && cp "$run/memory.svg" "$logs/resnet50-memory.svg"
  local m
  m=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["micro_batch"])' "$run/summary.json" 2>/dev/null || echo 0)
  if [[ $m -gt 0 ]]; then
    rm -rf "$run-native"
    run_logged "tally train resnet50 native m" "$log" "$bundle/run" "$bundle/bin/tally" train --model resnet50 \
      --data synthetic:3x224x224 --batch-size "$m" --memory-limit 8GiB --steps 24 --lr 0.1 --schedule constant \
      --no-augment --device cuda --out "$run-native" --no-progress
    [[ -f $run-native/summary.json ]] && cp "$run-native/summary.json" "$logs/resnet50-native-summary.json"
    note "$(printf '%-44s rc=%-3s %s' "train resnet50 native B=$m" "$last_rc" \
      "$(python3 -c 'import json,sys; a=json.load(open(sys.argv[1])); b=json.load(open(sys.argv[2])); print(f"mbp {a[\"images_per_second\"]:.1f} img/s, native {b[\"images_per_second\"]:.1f} img/s, overhead {100*(1-a[\"images_per_second\"]/b[\"images_per_second\"]):.1f}%")' "$run/summary.json" "$run-native/summary.json" 2>/dev/null)")"
  fi
  # Recomputation on the device: batch 4096 in 8 GiB with every level recomputed, and 1024x1024
  # samples in 1 GiB, where not even one sample fits without it (auto picks the level).
  local name args
  for name in all 1024; do
    case $name in
      all) args=(--data synthetic:3x224x224 --batch-size 4096 --memory-limit 8GiB --recompute all) ;;
      1024) args=(--data synthetic:3x1024x1024 --batch-size 2 --memory-limit 1GiB --recompute auto) ;;
    esac
    rm -rf "$run-$name"
    run_logged "tally train resnet50 ${args[*]}" "$log" "$bundle/run" "$bundle/bin/tally" train --model resnet50 \
      "${args[@]}" --steps 3 --lr 0.1 --schedule constant --no-augment --no-eval --device cuda --out "$run-$name" \
      --no-progress
    [[ -f $run-$name/summary.json ]] && cp "$run-$name/summary.json" "$logs/resnet50-$name-summary.json"
    note "$(printf '%-44s rc=%-3s %s' "train resnet50 ${args[1]#synthetic:} B=${args[3]} ${args[5]}" "$last_rc" \
      "$(grep -E '^ *recompute:' "$log" | tail -1 | cut -c1-60) $(grep -E '^memory:' "$log" | tail -1)")"
  done
  publish
}

step_compare() {
  local log=$logs/compare.log m b extra
  # The three precisions of the GPU table: float32 (TF32 off on both sides), TF32, and bf16 — tally
  # --precision bf16 against PyTorch's bf16 autocast + channels_last (+ cudnn.benchmark).
  local configs=("resnet20 128" "resnet20 128 --tf32" "resnet20 128 --precision bf16"
                 "resnet50 256" "resnet50 256 --tf32" "resnet50 256 --cudnn-benchmark"
                 "resnet50 256 --tf32 --cudnn-benchmark" "resnet50 256 --precision bf16 --cudnn-benchmark")
  for m in "${configs[@]}"; do
    read -r m b extra <<<"$m"
    # shellcheck disable=SC2086  # $extra is a list of flags
    run_logged "compare_pytorch $m $extra" "$log" "$bundle/run" python3 bench/compare_pytorch.py --model "$m" \
      --batch "$b" --device cuda --tally "$bundle/bin/tally" $extra
    note "$(printf '%-44s rc=%-3s %s' "compare_pytorch $m $b ${extra:-fp32}" "$last_rc" "$(grep -A3 -E '^ +images/s' "$log" | tail -3 | tr -s ' ' | tr '\n' ';')")"
  done
}

step_profile() {
  local log=$logs/profile.log m d b k extra
  # Each precision of the comparison table: float32, TF32 and bf16.
  for m in "resnet50 synthetic:3x224x224 256 1000" "resnet50 synthetic:3x224x224 256 1000 --tf32" \
           "resnet50 synthetic:3x224x224 256 1000 --precision bf16" "resnet20 synthetic 128 10"; do
    read -r m d b k extra <<<"$m"
    # shellcheck disable=SC2086  # $extra is a list of flags
    run_logged "tally train --profile $m $extra" "$log" "$bundle/run" "$bundle/bin/tally" train --model "$m" --data "$d" \
      --num-classes "$k" --batch-size "$b" --steps 12 --lr 0.01 --schedule constant --no-augment --device cuda \
      --no-progress --profile $extra
  done
  note "$(printf '%-44s rc=%-3s' "profiles" "$last_rc")"
}

step_bench() {
  local log=$logs/bench.log
  run_logged "bench_train (cuda)" "$log" "$bundle/run" "$bundle/bin/bench_train" --benchmark_filter='cuda' \
    --benchmark_min_time=1 --benchmark_counters_tabular=true
  note "$(printf '%-44s rc=%-3s' "bench_train cuda" "$last_rc")"
}

run() {
  unpack_if_needed
  mkdir -p "$logs" "$out"
  summary=$logs/summary.txt
  {
    echo "== gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ): $*"
    head -1 "$bundle/BUILD_INFO" 2>/dev/null || true
  } >>"$summary"
  local s
  for s in "$@"; do
    SECONDS=0
    case $s in
      env | tests | sanitize | train | resnet50 | compare | profile | bench) "step_$s" ;;
      *) echo "gpu-check: unknown step '$s': expected env, tests, sanitize, train, resnet50, compare, profile or bench" >&2; exit 2 ;;
    esac
    note "-- step $s: ${SECONDS}s"
    publish
  done
  note "result: $([[ $status == 0 ]] && echo PASS || echo FAIL)"
  return $status
}

case ${1:-} in
  pack) pack ;;
  build-deps) build_deps ;;
  build-there) build_there ;;
  run)
    shift
    (($#)) || set -- env tests sanitize
    run "$@"
    ;;
  *)
    echo "usage: scripts/gpu-check.sh pack | run STEP... | build-deps | build-there   (see the top of this file)" >&2
    exit 2
    ;;
esac
