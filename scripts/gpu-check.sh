#!/usr/bin/env bash
# scripts/gpu-check.sh — build tally's GPU programs here, check and time them on a GPU machine.
#
#   scripts/gpu-check.sh pack          on the build machine (no GPU needed): configures build-gpu/
#                                      (Release, sm_90, line info for the sanitizer, no oneDNN),
#                                      builds the GPU tests (the two-rank ones too: MPI required),
#                                      tally, bench_kernels and bench_train, and packs them with
#                                      their non-CUDA shared libraries, Open MPI's launcher (mpirun,
#                                      its plugins, PMIx; bundle_mpi) and Fashion-MNIST into
#                                      .gpu-bundle/bundle.tar.xz (git-ignored), which must travel
#                                      with the tracked tree in 60 MiB; `run` unpacks it on arrival.
#                                      Over the limit it fails, naming the largest parts.
#   scripts/gpu-check.sh run [STEP...]  on the GPU machine, from the repository root, .gpu-bundle/
#                                      carried along. The whole run stops starting commands after
#                                      RUN_SECONDS (default 540: one call of 9 minutes), each step
#                                      after its cap (step_caps), and each command has its own cap.
#                                      With no steps: all of them, in this order (most important
#                                      first, so a run cut short has done those):
#        env       nvidia-smi, the CUDA/cuBLAS/cuDNN versions loaded, `tally --version`,
#                  the PyTorch there                                                    (~10 s)
#        tests     every gpu test once (cuDNN's choices logged; tuning's in the tuning step); the
#                  convolution tests again through each cuDNN API forced; resume.cuda
#                  (tests/resume_test.sh cuda)                                          (~2 min)
#        mpi       the two-rank gpu tests (ctest labels gpu;mpi) under the bundled mpirun -np 2:
#                  dist_test's CPU collectives first (does mpirun start two ranks?), then
#                  dist_test *Gpu* and pipeline_test *GpuStages.* (two ranks on one GPU); then
#                  tally: NCCL's memory in a world of one, ResNet-50 as 2 stages in 300 MiB (~1 min)
#        tuning    tuning's gpu test (measured, replayed from its file and its record: the same
#                  bits), then ResNet-50 batch 256 tuned and untuned in bf16, float32 and TF32 (~3 min)
#        compare   bench/compare_pytorch.py, ResNet-50 batch 256: float32 and TF32 with tally's
#                  --deterministic on and off, bf16 (PyTorch: autocast + channels_last +
#                  cudnn.benchmark), tally in both memory formats, against one PyTorch run each
#                                                                                       (~3 min)
#        norms     bench_kernels' fused batch norm + residual + ReLU at ResNet-50's norm shapes,
#                  both formats and activation types, against a device copy (of_copy)   (~60 s)
#        deviceless  `tally plan --device-file` with the file env saved against `tally plan` on the
#                  GPU (convolutions through the graph API on both): ResNet-20 TF32, ResNet-50 bf16
#                  at micro-batches of 64, with a host tier (float32), batch 4096 in 8 GiB in
#                  bf16, and 2 pipeline stages in 300 MiB each — the outputs must be the same (~50 s)
#        host      the host tier (docs/host-tier.md): ResNet-50 224x224 AdamW batch 64 in a
#                  400 MiB device budget, 3 steps with the optimizer on the pinned host tier and
#                  with the gradients there too (their --save files must be identical), and
#                  the plan's automatic choice for batch 4096 in 600 MiB                 (~1 min)
#        offload   activations offloaded per segment (docs/activations.md): ResNet-50 1024x1024
#                  AdamW batch 2 in a 500 MiB device budget with a pinned host tier (recompute
#                  auto: the cost model's choice), 3 steps, against the all-device run at
#                  micro-batch 1 in 4 GiB (--save files must be identical); the plan's estimated
#                  step time beside the measured one                                     (~1 min)
#        resnet50  `tally plan --device cuda` for ResNet-50 224x224 batch 4096 in 8 GiB and
#                  a step of it, float32, bf16 (auto: NHWC) and bf16 NCHW; a step with --recompute all; 3 steps of
#                  3x1024x1024 batch 2 in 1 GiB (auto recomputation), exact peaks        (~1.5 min)
#        profile   the same three precisions, both sides: `tally train --profile` (bf16 in both
#                  memory formats) and PyTorch's profiler (compare_pytorch.py --torch-profile),
#                  a few steps each                                                     (~1.5 min)
#        train     `make train`'s recipe on the GPU (ResNet-20 on Fashion-MNIST, packed by
#                  `pack`, batch 512 in 32 MiB, 2 epochs) in float32 and bf16, then 40 steps
#                  of an MBP demo with the convolutions through cuDNN's graph API       (~1 min)
#        graphs    --cuda-graphs off and on in one call: make train's ResNet-20 plan (60 steps, its
#                  weights must be the same bits), ResNet-50 batch 256 as 8 x 32 beside 1 x 256 in
#                  float32 and bf16: images/s, the graphs' counts, the peaks             (~2 min)
#        sanitize  compute-sanitizer runs of scripts/gpu-sanitize.list, in its order, while
#                  the run's time lasts                                                 (the rest)
#        bench     bench_train on the GPU: ResNet-20 and ResNet-50 native and micro-batched,
#                  batch 256 as 8 x 32 beside 1 x 256 (not in the default run)          (~2 min)
#        repeat    the tests of REPEAT_FILTER (default GpuOps.ResNet20*) REPEAT times (default 10)
#                  with fresh seeds, then each seed of REPEAT_SEEDS twice (not in the default run)
#   scripts/gpu-check.sh rehearse [STEP...]  here, after `pack`: the same invocation without a GPU,
#                                      so that a path, a library or a missing file fails here and
#                                      not on the GPU machine; a command that fails only because
#                                      no GPU is present (or, for compare and profile, no PyTorch:
#                                      the GPU machine's is used) counts as passed, any other failure
#                                      fails. Its mpi step runs mpirun in a mount namespace where
#                                      this machine's Open MPI is hidden, as the GPU machine has none
#                                      (without-system-mpi, below), and checks with ldd that every
#                                      library the bundle loads resolves inside it.
#   scripts/gpu-check.sh without-system-mpi CMD...  here, as root: CMD in a mount namespace where
#                                      Debian's Open MPI, PMIx, hwloc plugins and ssh are hidden; the
#                                      proof that the bundled mpirun is relocatable, by hand:
#                                        scripts/gpu-check.sh without-system-mpi \
#                                          /tmp/tally-gpu-rehearsal/run mpirun --oversubscribe -np 2 hostname
#   scripts/gpu-check.sh build-deps    here: download the Debian packages a build on the GPU
#                                      machine needs into .gpu-debs/ (git-ignored).
#   scripts/gpu-check.sh build-there   on the GPU machine, .gpu-debs/ carried: unpack them into a
#                                      prefix, configure and build build-gpu/ with nvcc there, and
#                                      re-pack .gpu-bundle/ from it (for a fix made after `pack`).
#                                      Without MPI there (no Open MPI among the packages): its bundle
#                                      has no two-rank tests and no mpirun, so the mpi step fails.
#
# Logs: one file per binary or tool in $LOGS (default /tmp/tally-gpu-logs), written as the step
# runs; after every command they are packed into $OUT/logs.tar.gz and the summary so far is
# copied to $OUT/summary.txt (OUT defaults to .gpu-bundle/out), so a call killed at its limit
# still returns what ran. The last lines printed are the summary table; exit status 0 only if
# everything passed.
#
# Environment: JOBS (build parallelism, default: all cores), BUILD_DIR (default build-gpu), ARCH
# (CUDA architectures, default 90), RUN_SECONDS (the whole run's deadline, default 540), LOGS, OUT.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
bundle=.gpu-bundle
debs=.gpu-debs
tests=(gpu_test gpu_kernels_test gpu_ops_test gpu_bf16_test)
# The two-rank tests (ctest labels gpu;mpi), started by the bundled mpirun: CMake makes them only
# where it finds MPI, which `pack` requires.
mpi_tests=(dist_test pipeline_test)
# The GPU check's order, most important first: a run cut at its deadline has done these.
all_steps=(env tests mpi tuning compare norms deviceless host offload resnet50 profile train graphs sanitize)
# Each step's cap in seconds (docs/gpu.md, "The order and the caps"): a step stops starting
# commands at its cap as the whole run does at RUN_SECONDS; the sanitizer takes what is left.
declare -A step_caps=([env]=30 [tests]=170 [mpi]=150 [tuning]=240 [compare]=220 [norms]=90 [deviceless]=60 [host]=50
  [offload]=60 [resnet50]=90 [profile]=130 [train]=100 [graphs]=150 [bench]=120 [repeat]=120)
programs=("${tests[@]/#/tests/}" "${mpi_tests[@]/#/tests/}" apps/tally bench/bench_kernels bench/bench_train)
# The libraries every machine has (the C runtime) and those the GPU machine has (CUDA's): never packed.
runtime_libs='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|librt\.|libpthread\.|libstdc\+\+|libgcc_s|libcuda\.|libcudart|libcublas|libcudnn|libnccl|libnvrtc|libnvJitLink)'
# The GPU machine takes 64 MiB of working tree in all: the tracked files travel with the bundle.
# The bundle and the tracked tree together stay under 60 MiB, a margin for untracked notes.
tree_limit=$((64 * 1024 * 1024))
bundle_limit=$((60 * 1024 * 1024))

# ---- packing -------------------------------------------------------------------------------------

# Copies every shared library the given files need into $bundle/lib, except the C runtime and the
# CUDA libraries, which come from the GPU machine (runtime_libs).
bundle_libs() {
  mkdir -p "$bundle/lib"
  local f name path
  for f in "$@"; do
    while read -r name path; do
      [[ $name =~ $runtime_libs ]] && continue
      cp -fL "$path" "$bundle/lib/$name"
    done < <(ldd "$f" | awk '/=> \//{print $1, $3}')
  done
}

# Copies each program into $bundle/bin and the shared libraries it needs into $bundle/lib.
bundle_programs() {
  mkdir -p "$bundle/bin"
  cp -f "$@" "$bundle/bin/"
  bundle_libs "$@"
  write_run_wrapper
}

# Open MPI's launcher for the mpi step, relocatable (the GPU machine has no Open MPI): Debian's
# orterun (as mpirun) and orted, the MCA plugins, PMIx's plugins, both help texts (an error then
# explains itself) and Open MPI's parameter file, under $bundle/mpi; the libraries they need go to
# $bundle/lib beside the programs'. Debian's paths are compiled in (/usr, /etc/openmpi,
# /usr/lib/x86_64-linux-gnu/pmix2): the run wrapper points Open MPI and PMIx here with their
# OPAL_* and PMIX_* variables. Left out: the plugins of networks one node does not use (UCX,
# libfabric, InfiniBand verbs, PSM; Debian's parameter file turns off all but PSM anyway), which
# would bring their 10+ MB of libraries, and OpenSHMEM's frameworks (oshrun's, not mpirun's).
# PMIx's parameter file is left out too: it names Debian's plugin folder.
bundle_mpi() {
  local ompi=/usr/lib/x86_64-linux-gnu/openmpi/lib pmix=/usr/lib/x86_64-linux-gnu/pmix2 mpi=$bundle/mpi
  local unused='_(ucx|ofi|openib|psm|psm2)\.so$|/mca_(atomic|memheap|scoll|spml|sshmem)_' f
  [[ -x /usr/bin/orterun && -d $ompi/openmpi3 && -d $pmix/lib/pmix ]] ||
    { echo "gpu-check: no Open MPI here (Debian: openmpi-bin libopenmpi3 libpmix2) to bundle" >&2; exit 1; }
  mkdir -p "$mpi/bin" "$mpi/lib/openmpi3" "$mpi/lib/pmix" "$mpi/share/openmpi" "$mpi/share/pmix" "$mpi/etc"
  cp -f /usr/bin/orterun "$mpi/bin/mpirun"
  cp -f /usr/bin/orted "$mpi/bin/"
  for f in "$ompi"/openmpi3/*.so; do
    [[ $f =~ $unused ]] || cp -f "$f" "$mpi/lib/openmpi3/"
  done
  cp -f "$pmix"/lib/pmix/*.so "$mpi/lib/pmix/"
  cp -f /usr/share/openmpi/*.txt "$mpi/share/openmpi/"
  cp -f "$pmix"/share/pmix/help-*.txt "$mpi/share/pmix/"
  cp -f /etc/openmpi/openmpi-mca-params.conf /etc/openmpi/openmpi-default-hostfile "$mpi/etc/"
  bundle_libs "$mpi"/bin/* "$mpi"/lib/openmpi3/*.so "$mpi"/lib/pmix/*.so
}

# $bundle/run: runs a command with the bundle's libraries and the GPU machine's CUDA runtime,
# cuBLAS, cuBLASLt and cuDNN — all four from ONE tree, so that cuDNN finds the cuBLASLt it was built
# with: the nvidia/* packages beside the machine's PyTorch first, else the CUDA toolkit.
# TALLY_CUDA_LIBS (folders, colon-separated) overrides the search. Prints the files it chose. Where
# the bundle has Open MPI (bundle_mpi), `run mpirun ...` starts the bundled one, relocated.
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
  # (the package found, not imported: importing torch takes seconds, and this runs before every command)
  site=$(python3 -c 'import importlib.util, os; s = importlib.util.find_spec("torch"); print(os.path.dirname(os.path.dirname(s.origin)) if s else "")' 2>/dev/null)
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
# The bundled Open MPI (pack's bundle_mpi), `run mpirun ...`: Open MPI and PMIx take their folders
# from these variables instead of the Debian paths compiled in. The GPU machine has no ssh: mpirun
# launches on this node alone (plm isolated), where the rsh launcher refuses to start without it.
# Defaults only, for a container: the ranks copy through shared-memory buffers, not with
# process_vm_readv (single copy), which containers often forbid; PMIx keeps its data store per
# process (hash), not in the shared-memory one that fails in some.
if [[ -x $here/mpi/bin/mpirun ]]; then
  mpi=$here/mpi
  export PATH=$mpi/bin:$PATH
  export OPAL_PREFIX=$mpi OPAL_LIBDIR=$here/lib OPAL_PKGLIBDIR=$mpi/lib/openmpi3 OPAL_PKGDATADIR=$mpi/share/openmpi \
    OPAL_SYSCONFDIR=$mpi/etc
  export PMIX_PREFIX=$mpi PMIX_PKGLIBDIR=$mpi/lib/pmix PMIX_PKGDATADIR=$mpi/share/pmix PMIX_SYSCONFDIR=$mpi/etc
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  export OMPI_MCA_plm=${OMPI_MCA_plm:-isolated}
  export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
  export PMIX_MCA_gds=${PMIX_MCA_gds:-hash}
fi
exec "$@"
RUN
  chmod +x "$bundle/run"
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
  for p in "${programs[@]}"; do
    [[ -e $build/$p ]] && bins+=("$build/$p")
  done
  bundle_programs "${bins[@]}"
  # mpirun for the two-rank tests, where the build has them (not build-there's: no MPI there).
  [[ -e $build/tests/${mpi_tests[0]} ]] && bundle_mpi
  # Fashion-MNIST for `make train`'s recipe (the GPU machine has no Debian packages), as raw IDX
  # files (tally reads them plain or gzip-compressed; raw ones compress better in the archive).
  if [[ -d /usr/share/datasets/fashion-mnist ]]; then
    mkdir -p "$bundle/data/fashion-mnist"
    local f
    for f in /usr/share/datasets/fashion-mnist/*-ubyte.gz; do
      gzip -dc "$f" >"$bundle/data/fashion-mnist/$(basename "$f" .gz)"
    done
  fi
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
  # Each program the configuration has: the two-rank tests exist only where CMake found MPI.
  local targets=() p
  for p in "${programs[@]}"; do
    [[ -d $build/$(dirname "$p")/CMakeFiles/$(basename "$p").dir ]] && targets+=("$(basename "$p")")
  done
  cmake --build "$build" -j "${JOBS:-$(nproc)}" --target "${targets[@]}"
}

pack() {
  local build=${BUILD_DIR:-build-gpu} arch=${ARCH:-90}
  # MPI required: the bundle carries the two-rank tests and the mpirun that starts them.
  configure_build "$build" "$arch" -DTALLY_MPI=ON
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
rehearsal=0          # 1: `rehearse`, on a machine without a GPU (see the top of this file)
deadline=0           # seconds since the epoch after which no command starts
step_end=0           # the same for the step under way (its cap, step_caps)
reserve=15           # seconds kept back at the end for packing the logs and the summary

note() { echo "$*" | tee -a "$summary"; }
result() { note "$(printf '%-44s rc=%-3s %s' "$1" "$last_rc" "${2:-}")"; }  # NAME [TEXT]: a summary row
publish() {  # the logs so far, where they come back from
  mkdir -p "$out"
  tar -C "$logs" -czf "$out/logs.tar.gz.tmp" . && mv "$out/logs.tar.gz.tmp" "$out/logs.tar.gz"
  cp "$summary" "$out/summary.txt"
}

unpack_if_needed() {
  if ((rehearsal)); then  # a copy elsewhere: the archive stays as it is, ready to travel
    local copy=${REHEARSAL_DIR:-/tmp/tally-gpu-rehearsal}
    [[ -f $bundle/bundle.tar.xz ]] || { echo "gpu-check: no $bundle/bundle.tar.xz: run 'scripts/gpu-check.sh pack' first" >&2; exit 2; }
    rm -rf "$copy" && mkdir -p "$copy"
    tar -C "$copy" -xJf "$bundle/bundle.tar.xz"
    bundle=$copy
    out=${OUT:-$copy/out}
  fi
  if [[ ! -x $bundle/run && -f $bundle/bundle.tar.xz ]]; then
    tar -C "$bundle" -xJf "$bundle/bundle.tar.xz" && rm -f "$bundle/bundle.tar.xz"
  fi
  [[ -x $bundle/run ]] || { echo "gpu-check: no $bundle/run: run 'scripts/gpu-check.sh pack' here first and carry $bundle" >&2; exit 2; }
  bundle=$(cd "$bundle" && pwd)
}

# run_logged NAME LOG CAP CMD...: runs CMD into LOG for at most CAP seconds, and never past the
# whole run's deadline; records its exit status in last_rc. A command that no longer has time to
# start is not started (last_rc 125, noted). In a rehearsal, a command that failed only because no
# GPU is present counts as passed (last_rc 0, noted as skipped); any other failure still fails, a
# refused command line too.
run_logged() {
  local name=$1 log=$2 cap=$3 rc=0
  shift 3
  local now left
  now=$(date +%s)
  left=$((deadline - now - reserve))
  ((step_end - now < left)) && left=$((step_end - now))
  ((cap < left)) || cap=$left
  if ((cap < 5)); then
    note "$(printf '%-44s NOT RUN: the %s is out of time' "$name" "$( ((step_end < deadline - reserve)) && echo step || echo run)")"
    last_rc=125
    status=1
    return 0
  fi
  local mark
  mark=$(wc -l <"$log" 2>/dev/null || echo 0)
  echo "==== $(date -u +%H:%M:%S) (at most ${cap}s) $*" >>"$log"
  local t0=$SECONDS
  timeout --kill-after=10 "$cap" "$@" </dev/null >>"$log" 2>&1 || rc=$?
  echo "==== exit $rc after $((SECONDS - t0)) s" >>"$log"
  # A command line the program refuses fails on any machine, GPU or not: never counted as passed
  # (bench_kernels says "no GPU present" before it parses its flags).
  local refused="unrecognized command-line flag|is expected to be a|unrecognized arguments|invalid choice|usage:"
  if ((rc != 0 && rehearsal)) && tail -n +"$((mark + 1))" "$log" | grep -qE "no GPU (is )?present|skipped: no GPU|Torch not compiled with CUDA|Found no NVIDIA driver|expected a GPU to describe, found none|No module named 'torch'" &&
    ! tail -n +"$((mark + 1))" "$log" | grep -qE "$refused"; then
    echo "==== rehearsal: failed for want of a GPU only (counted as passed here)" >>"$log"
    rc=0
  fi
  last_rc=$rc
  publish
  ((rc == 0)) || status=1
  [[ $rc == 124 || $rc == 137 ]] && note "$(printf '%-44s TIMED OUT after %ss' "$name" "$cap")"
  return 0
}

step_env() {
  local log=$logs/env.log
  # First of all, what later work needs without the GPU: its description for plans made without it
  # (docs/gpu.md, "Plans without the GPU"), into $out at once; commit it as
  # tests/fixtures/devices/<gpu>.json.
  mkdir -p "$out"
  : >"$log"
  run_logged "tally device --save" "$log" 20 "$bundle/run" "$bundle/bin/tally" device --save "$out/device.json"
  result "tally device --save" "$( [[ -s $out/device.json ]] && echo "saved $out/device.json" || echo 'no device file')"
  {
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    echo
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true
    "$bundle/run" "$bundle/bin/tally" --version 2>&1
    cat "$bundle/BUILD_INFO"
    "${PYTHON:-python3}" -c 'import torch, torchvision; print("torch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN",
torch.backends.cudnn.version(), "torchvision", torchvision.__version__)' 2>&1 || echo "python3 torch: not available"
  } >>"$log"
  note "$(grep -m1 -o 'GPU: .*' "$log" || echo 'GPU: none detected')"
}

# gtest_line LOG: the gtest summary lines of the last run in LOG, on one line.
gtest_line() {
  local s
  s=$(tail -n 400 "$1" | grep -E '^\[ +(PASSED|FAILED|SKIPPED) +\] [0-9]+ tests?' | tr -s ' \n' ' ' || true)
  echo "${s:-no gtest summary}"
}

step_tests() {
  local t
  # Every gpu test once, cuDNN's choices logged; tuning's test (minutes of measuring) runs in the
  # tuning step.
  for t in "${tests[@]}"; do
    local log=$logs/$t.log
    : >"$log"
    TALLY_LOG_CONV=1 run_logged "$t" "$log" 90 "$bundle/run" "$bundle/bin/$t" --gtest_color=no --gtest_filter='-*Tuned*'
    local line
    line=$(gtest_line "$log")
    if grep -q 'no GPU present' "$log"; then  # a check that skipped for want of a GPU checked nothing
      line="$line(skipped: no GPU present)"
      ((rehearsal)) || status=1
    fi
    result "$t" "$line"
  done
  # The convolution tests through each cuDNN API forced (by default row-major float32 goes through
  # the legacy API, bf16 and channels-last through the graph API); the whole steps run each
  # precision's default API above. (gpu_ops_test has no convolution tests of its own: its filtered
  # run was "0 tests", which proves nothing.)
  # (Tuning's test runs once, above: it takes the automatic API itself and measures for minutes.)
  local filter='*Convolution*:-*EveryCudnnAlgorithm*:*Tuned*' api
  for api in graph legacy; do
    for t in gpu_kernels_test gpu_bf16_test; do
      local glog=$logs/$t-$api-api.log
      : >"$glog"
      TALLY_CUDNN_CONV_API=$api run_logged "$t ($api API)" "$glog" 40 "$bundle/run" "$bundle/bin/$t" \
        --gtest_color=no --gtest_filter="$filter"
      result "$t $api API" "$(gtest_line "$glog")"
    done
  done
  # Killed runs resume bit for bit on the GPU (tests/resume_test.sh cuda; exit 77: no GPU).
  local rlog=$logs/resume-cuda.log
  : >"$rlog"
  run_logged "resume.cuda" "$rlog" 60 "$bundle/run" bash tests/resume_test.sh cuda "$bundle/bin/tally"
  result "resume.cuda" \
    "$(grep -c '^ok:' "$rlog") ok, $(grep -c '^FAIL' "$rlog") failed$(grep -q 'skipped: no GPU' "$rlog" && echo ' (skipped: no GPU)')"
}

# Debian's Open MPI hidden as the GPU machine lacks it, in a mount namespace of the command's own
# (unshare -m, root): empty tmpfs mounts over its folders (plugins, PMIx, help texts, configuration,
# hwloc's plugins) and /dev/null over its programs, ssh, and the real files of the libraries the
# bundle carries for it; then the command. What the bundled mpirun still took from the system fails.
hide_system_mpi='set -e
for d in /usr/lib/x86_64-linux-gnu/openmpi /usr/lib/x86_64-linux-gnu/pmix2 /usr/lib/x86_64-linux-gnu/hwloc \
  /usr/share/openmpi /etc/openmpi; do
  if [[ -d $d ]]; then mount -t tmpfs none "$d"; fi
done
for f in /usr/bin/orterun /usr/bin/orted /usr/bin/ssh /usr/bin/rsh /usr/lib/x86_64-linux-gnu/{libmpi.so.40,libopen-pal.so.40,\
libopen-rte.so.40,libpmix.so.2,libhwloc.so.15,libevent_core-2.1.so.7,libevent_pthreads-2.1.so.7,libmunge.so.2}; do
  if [[ -e $f ]]; then mount --bind /dev/null "$(readlink -f "$f")"; fi
done
exec "$@"'

# Every library the bundle's programs, plugins and libraries load resolves inside it, but the C
# runtime's and CUDA's (runtime_libs): ldd with the run wrapper's library path. A rehearsal's check
# (this machine's libraries stand where the GPU machine has none; there, its own would hide a gap).
check_bundle_libs() {
  local f name path outside="" n=0
  for f in "$bundle"/bin/* "$bundle"/mpi/bin/* "$bundle"/mpi/lib/*/*.so "$bundle"/lib/*; do
    [[ -f $f ]] || continue
    n=$((n + 1))
    while read -r name path; do
      [[ $name =~ $runtime_libs || $path == "$bundle/lib/"* || " $outside " == *" $name "* ]] || outside+=" $name"
    done < <(LD_LIBRARY_PATH=$bundle/lib ldd "$f" 2>/dev/null | awk '$2 == "=>" { print $1, $3 }')
  done
  last_rc=0
  [[ -z $outside ]] || { last_rc=1; status=1; }
  result "bundle: libraries of its $n files (ldd)" \
    "$( [[ -n $outside ]] && echo "from outside it:$outside" || echo 'all inside it (or the C runtime, CUDA)')"
}

# A summary row for a test under mpirun -np 2: both ranks must report (gtest's "N tests ... ran."),
# or mpirun did not start them. A skipped test exits 0, so a failure is never the missing GPU's,
# not even in a rehearsal; a skip counts as passed only there, as in the tests step.
mpi_result() {  # NAME LOG
  local ranks line
  ranks=$(grep -cE '^\[==========\] [0-9]+ tests? from .* ran\.' "$2" || true)
  # The ranks' gtest summaries, each different line once (two ranks that agree print the same).
  line="$ranks of 2 ranks ran: $(grep -E '^\[ +(PASSED|FAILED|SKIPPED) +\] [0-9]+ tests?' "$2" | awk '!seen[$0]++' |
    tr -s ' \n' ' ' || true)"
  if grep -q '^==== rehearsal: failed for want of a GPU only' "$2" || ((ranks != 2 && last_rc == 0)); then
    last_rc=1
    status=1
  fi
  if grep -q 'no GPU present' "$2"; then
    line="$line(skipped: no GPU present)"
    ((rehearsal)) || status=1
  fi
  result "$1" "$line"
}

# Two ranks on one GPU (ctest labels gpu;mpi) under the bundled mpirun: first dist_test's CPU
# collectives, which need no GPU, so that an mpirun that cannot start two ranks is told apart from a
# failing test; then the two gpu tests. A rehearsal checks the bundle's libraries first and runs
# mpirun with Debian's Open MPI hidden (hide_system_mpi).
step_mpi() {
  if [[ ! -x $bundle/mpi/bin/mpirun || ! -x $bundle/bin/${mpi_tests[0]} ]]; then
    note "mpi: no mpirun or no two-rank tests in $bundle (a build without MPI: build-there?)"
    status=1
    return
  fi
  local hide=() name bin filter cap
  if ((rehearsal)); then
    check_bundle_libs
    if ((EUID == 0)) && unshare -m true 2>/dev/null; then
      hide=("$here/scripts/gpu-check.sh" without-system-mpi)
    else
      note "mpi: Debian's Open MPI not hidden (needs root and unshare -m): mpirun may take from it"
    fi
  fi
  for name in launch gpu-dist gpu-pipeline; do
    case $name in
      launch) bin=dist_test filter=Dist.CollectivesSumAndBroadcastOverTheRanks cap=20 ;;
      gpu-dist) bin=dist_test filter='*Gpu*' cap=40 ;;
      gpu-pipeline) bin=pipeline_test filter='*GpuStages.*' cap=40 ;;
    esac
    local log=$logs/mpi-$name.log
    : >"$log"
    # One OpenMP thread a rank, as ctest runs them (MPI_ENV in tests/CMakeLists.txt): mpirun binds
    # each of two ranks to one core.
    OMP_NUM_THREADS=1 run_logged "mpirun -np 2 $bin $filter" "$log" "$cap" "${hide[@]}" "$bundle/run" mpirun \
      --oversubscribe -np 2 "$bundle/bin/$bin" --gtest_color=no --gtest_filter="$filter"
    mpi_result "mpirun -np 2 $bin $([[ $name == launch ]] && echo 'collectives (CPU)' || echo "$filter")" "$log"
  done
  # tally itself: NCCL's memory measured by a world of one, and ResNet-50 as two pipeline stages
  # sharing the GPU in 300 MiB each (one process needs 322.5 MiB: tests/CMakeLists.txt, pipeline.gpu_*).
  local run=/tmp/tally-gpu-mpi
  log=$logs/mpi-nccl-world-of-one.log
  : >"$log"
  run_logged "mpirun -np 1 tally train --collectives nccl" "$log" 40 "${hide[@]}" "$bundle/run" mpirun -np 1 \
    "$bundle/bin/tally" train --model resnet20 --data synthetic --steps 2 --batch-size 64 --memory-limit 256MiB \
    --device cuda --collectives nccl --no-eval --no-progress
  result "nccl world of one: its memory" "$(grep -E '^(collectives|communication library)' "$log" | tr '\n' ' ' | cut -c1-150)"
  log=$logs/mpi-stages-resnet50.log
  : >"$log"
  rm -rf "$run-stages"
  run_logged "mpirun -np 2 tally train --pipeline-stages 2" "$log" 60 "${hide[@]}" "$bundle/run" mpirun \
    --oversubscribe -np 2 "$bundle/bin/tally" train --pipeline-stages 2 --model resnet50 --data synthetic:3x224x224 \
    --batch-size 8 --memory-limit 300MiB --steps 3 --device cuda --no-eval --no-progress --out "$run-stages"
  result "resnet50 as 2 stages on one GPU, 300 MiB each" "$(grep -E '^(stage [01] |memory:)' "$log" | tail -3 |
    tr -s ' \n' ' ' | cut -c1-150)"
}

# CUDA graphs (--cuda-graphs; docs/gpu.md "CUDA graphs") off and on in one call: make train's
# ResNet-20 plan (batch 512 in 32 MiB, float32, 60 steps of synthetic data; the saved weights must be
# the same bits), and ResNet-50 224x224 batch 256 as 8 micro-batches of 32 beside 1 of 256, float32
# and bf16 — images/s from each run's summary, the graphs' line, the peaks.
step_graphs() {
  local run=/tmp/tally-gpu-graphs g p m log
  for g in off on; do
    log=$logs/graphs-resnet20-$g.log
    : >"$log"
    rm -rf "$run-r20-$g"
    run_logged "tally train resnet20 32MiB, graphs $g" "$log" 60 "$bundle/run" "$bundle/bin/tally" train \
      --model resnet20 --data synthetic:3x32x32 --steps 60 --batch-size 512 --memory-limit 32MiB --device cuda \
      --cuda-graphs "$g" --out "$run-r20-$g" --save "$run-r20-$g/weights.safetensors" --no-progress --no-eval
    result "resnet20 32MiB, graphs $g" "$(summary_rate "$run-r20-$g") $(grep -E '^cuda graphs' "$log" | cut -c1-70)"
    [[ -f $run-r20-$g/summary.json ]] && cp "$run-r20-$g/summary.json" "$logs/graphs-resnet20-$g-summary.json"
  done
  if [[ -f $run-r20-on/weights.safetensors ]] && cmp -s "$run-r20-off/weights.safetensors" "$run-r20-on/weights.safetensors"; then
    note "graphs: resnet20's weights the same bits with graphs on and off"
  elif ((!rehearsal)); then
    note "graphs: resnet20's weights DIFFER with graphs on and off (or a run failed)"
    status=1
  fi
  for p in fp32 bf16; do
    for m in 32 256; do
      for g in off on; do
        [[ $m == 256 && $g == on ]] && continue  # one micro-batch a step: nothing to replay
        log=$logs/graphs-resnet50-$p-$m-$g.log
        : >"$log"
        rm -rf "$run-r50"
        run_logged "tally train resnet50 256 as $m, $p, graphs $g" "$log" 60 "$bundle/run" "$bundle/bin/tally" train \
          --model resnet50 --data synthetic:3x224x224 --batch-size 256 --micro-batch "$m" --steps 8 --precision "$p" \
          --memory-limit 40GiB --device cuda --cuda-graphs "$g" --out "$run-r50" --no-progress --no-eval \
          --tuning-seconds 10
        result "resnet50 256 as $m, $p, graphs $g" "$(summary_rate "$run-r50") $(grep -E '^cuda graphs' "$log" | cut -c1-60)"
        [[ -f $run-r50/summary.json ]] && cp "$run-r50/summary.json" "$logs/graphs-resnet50-$p-$m-$g-summary.json"
      done
    done
  done
}

# images/s and the peaks' agreement of a run folder's summary.json.
summary_rate() {
  [[ -f $1/summary.json ]] || return 0
  # (no f-string with quotes inside: Python before 3.12 refuses them)
  python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print("%.1f img/s, peak %d predicted %d" % (s["images_per_second"], s["peak_bytes"], s["predicted_peak_bytes"]))' "$1/summary.json" 2>/dev/null || true
}

# The memory lines of a tally run (predicted and measured peaks), for the summary.
peak_line() { grep -E 'peak|test accuracy' "$1" | tail -2 | tr -s ' ' | tr '\n' ' ' | cut -c1-160; }

step_train() {
  local run=/tmp/tally-gpu-train p
  # make train's recipe (the Makefile's train target) on the GPU, float32 then bf16.
  for p in fp32 bf16; do
    local log=$logs/train-$p.log
    : >"$log"
    rm -rf "$run-$p"
    local data=(--data synthetic --epochs 1)  # no data set packed: the synthetic data, one epoch
    [[ -d $bundle/data/fashion-mnist ]] && data=(--data "fashion-mnist:$bundle/data/fashion-mnist" --epochs 2)
    run_logged "tally train (make train recipe, $p)" "$log" 120 "$bundle/run" "$bundle/bin/tally" train --model resnet20 \
      "${data[@]}" --batch-size 512 --memory-limit 32MiB --lr 0.4 --warmup-epochs 0.5 --schedule cosine \
      --precision "$p" --device cuda --out "$run-$p" --no-progress --tuning-seconds 10
    result "tally train cuda $p" "$(peak_line "$log")"
    [[ -f $run-$p/summary.json ]] && cp "$run-$p/summary.json" "$logs/train-$p-summary.json"
    [[ -f $run-$p/memory.svg ]] && cp "$run-$p/memory.svg" "$logs/train-$p-memory.svg"
  done
  # The convolutions through cuDNN's graph (backend) API: an MBP demo, its plan exact.
  local glog=$logs/train-graph-api.log
  : >"$glog"
  rm -rf "$run-graph"
  run_logged "tally train (cuda, graph API)" "$glog" 60 "$bundle/run" env TALLY_CUDNN_CONV_API=graph \
    "$bundle/bin/tally" train --model resnet20 --data synthetic --steps 40 --batch-size 256 --memory-limit 48MiB \
    --device cuda --out "$run-graph" --no-progress --no-eval --tuning-seconds 10
  result "tally train cuda graph API" "$(peak_line "$glog")"
}

step_resnet50() {
  local log=$logs/resnet50.log run=/tmp/tally-gpu-resnet50 name args
  : >"$log"
  # The plan and a step of batch 4096 in 8 GiB, float32 and bf16 (one step is enough for the exact
  # peak, and a bf16 step took 35 s at 2026-11-26's speed); a step with every level recomputed;
  # 3x1024x1024 batch 2 in 1 GiB, where not one sample fits without recomputation.
  # (bf16's `auto` is channels-last on CUDA since 2026-11-28: bf16-nchw keeps the other format.)
  for name in fp32 bf16 bf16-nchw all 1024; do
    case $name in
      fp32) args=(--data synthetic:3x224x224 --batch-size 4096 --memory-limit 8GiB --steps 1) ;;
      bf16) args=(--data synthetic:3x224x224 --batch-size 4096 --memory-limit 8GiB --steps 1 --precision bf16) ;;
      bf16-nchw) args=(--data synthetic:3x224x224 --batch-size 4096 --memory-limit 8GiB --steps 1 --precision bf16
        --memory-format contiguous) ;;
      all) args=(--data synthetic:3x224x224 --batch-size 4096 --memory-limit 8GiB --steps 1 --recompute all) ;;
      1024) args=(--data synthetic:3x1024x1024 --batch-size 2 --memory-limit 1GiB --steps 3 --recompute auto) ;;
    esac
    if [[ $name == fp32 || $name == bf16* ]]; then
      local prec=()
      [[ $name == bf16 ]] && prec=(--precision bf16)
      [[ $name == bf16-nchw ]] && prec=(--precision bf16 --memory-format contiguous)
      run_logged "tally plan resnet50 $name" "$log" 60 "$bundle/run" "$bundle/bin/tally" plan --model resnet50 \
        --input 3x224x224 --batch-size 4096 --memory-limit 8GiB --device cuda "${prec[@]}"
      result "tally plan cuda resnet50 $name" "$(grep 'plan:' "$log" | tail -1)"
    fi
    rm -rf "$run-$name"
    run_logged "tally train resnet50 $name" "$log" 90 "$bundle/run" "$bundle/bin/tally" train --model resnet50 \
      "${args[@]}" --lr 0.1 --schedule constant --no-augment --no-eval --device cuda --out "$run-$name" --no-progress \
      --tuning-seconds 15
    [[ -f $run-$name/summary.json ]] && cp "$run-$name/summary.json" "$logs/resnet50-$name-summary.json"
    result "train resnet50 $name ${args[1]#synthetic:} B=${args[3]}" \
      "$(grep -E '^ *recompute:' "$log" | tail -1 | cut -c1-50) $(grep -E '^memory:' "$log" | tail -1 | cut -c1-110)"
    result "train resnet50 $name speed" "$(summary_rate "$run-$name")"
  done
}

# same_saves WHAT A B: a result line saying whether two runs' --save files are identical.
same_saves() {
  if [[ ! -f $2 || ! -f $3 ]]; then
    result "$1: --save files" "missing (a run failed)"
  elif cmp -s "$2" "$3"; then
    result "$1: --save files" "identical"
  else
    result "$1: --save files" "DIFFER"
  fi
}

# The host tier on the GPU: both host placements at micro-batches of 2 (identical --save files: the
# same CPU update from the same sums), and the plan's choice for a batch of 4096.
step_host() {
  local log=$logs/host.log run=/tmp/tally-gpu-host p
  : >"$log"
  for p in optimizer gradients; do
    rm -rf "$run-$p" "$run-$p.safetensors"
    run_logged "tally train resnet50 host $p" "$log" 90 "$bundle/run" "$bundle/bin/tally" train --model resnet50 \
      --data synthetic:3x224x224 --batch-size 64 --micro-batch 2 --optimizer adamw --lr 0.001 --steps 3 \
      --memory-limit 400MiB --host-memory-limit 2GiB --placement "$p" --no-augment --no-eval --no-progress \
      --device cuda --out "$run-$p" --save "$run-$p.safetensors"
    [[ -f $run-$p/summary.json ]] && cp "$run-$p/summary.json" "$logs/host-$p-summary.json"
    result "train resnet50 host $p B=64 in 400MiB" "$(grep -E '^(memory|host tier):' "$log" | tail -2 | tr '\n' ' ' | cut -c1-120)"
  done
  same_saves "host placements" "$run-optimizer.safetensors" "$run-gradients.safetensors"
  run_logged "tally plan resnet50 host auto" "$log" 60 "$bundle/run" "$bundle/bin/tally" plan --model resnet50 \
    --input 3x224x224 --batch-size 4096 --optimizer adamw --recompute none --memory-limit 600MiB \
    --host-memory-limit 2GiB --device cuda --no-layers
  result "tally plan cuda resnet50 host auto" "$(grep -E '^ *placement ' "$log" | tail -1 | cut -c1-110)"
}

# Activations offloaded to the pinned host tier, chosen by the cost model: bit-identical to the
# all-device run at the same micro-batch, both peaks exact; the estimate beside the measured step.
step_offload() {
  local log=$logs/offload.log run=/tmp/tally-gpu-offload name args
  : >"$log"
  for name in offload device; do
    case $name in
      offload) args=(--memory-limit 500MiB --host-memory-limit 8GiB --recompute auto) ;;
      device) args=(--memory-limit 4GiB --micro-batch 1 --recompute none) ;;
    esac
    rm -rf "$run-$name" "$run-$name.safetensors"
    run_logged "tally train resnet50 1024 $name" "$log" 120 "$bundle/run" "$bundle/bin/tally" train --model resnet50       --data synthetic:3x1024x1024 --batch-size 2 --optimizer adamw --lr 0.001 --steps 3 "${args[@]}" --no-augment       --no-eval --no-progress --device cuda --out "$run-$name" --save "$run-$name.safetensors"
    [[ -f $run-$name/summary.json ]] && cp "$run-$name/summary.json" "$logs/offload-$name-summary.json"
    result "train resnet50 1024 B=2 $name" "$(grep -E '^(memory|host tier):' "$log" | tail -2 | tr '\n' ' ' | cut -c1-120)"
  done
  result "offload: estimated step" "$(grep -oE 'estimated step [0-9.]+ s[^;]*' "$log" | head -1 | cut -c1-100)"
  result "offload: measured images/s" "$(grep -o '"images_per_second": [0-9.e+-]*' "$logs/offload-offload-summary.json" 2>/dev/null)"
  same_saves "offload" "$run-offload.safetensors" "$run-device.safetensors"
}

# The three-precision table (bench/RESULTS.md): ResNet-50 batch 256, tally in both memory formats
# (row-major and channels-last activations) with its default cuDNN convolution API for each, against
# one PyTorch run — float32 (TF32 off on both sides) and TF32 (on for both), tally also with
# --deterministic off (PyTorch's defaults allow nondeterministic algorithms), and bf16 (tally
# --precision bf16 against PyTorch autocast + channels_last + cudnn.benchmark).
step_compare() {
  local log=$logs/compare.log row extra
  : >"$log"
  # The engines the tuning step measured are replayed; what it did not see is measured for 10 s at most.
  local formats="--tally-memory-format contiguous,channels_last --tally-tuning-seconds 10"
  for row in "fp32 --tally-deterministic on,off" "tf32 --tf32 --tally-deterministic on,off" \
    "bf16 --precision bf16 --cudnn-benchmark"; do
    read -r row extra <<<"$row"
    # shellcheck disable=SC2086  # $extra is a list of flags
    run_logged "compare_pytorch resnet50 256 $row" "$log" 100 "$bundle/run" "${PYTHON:-python3}" bench/compare_pytorch.py \
      --model resnet50 --batch 256 --steps 8 --warmup 2 --device cuda --tally "$bundle/bin/tally" $formats $extra
    # This command's table only (the text after the log's last command header), not a warning's
    # "tally: ..." line nor the previous precision's rows when this one printed none.
    result "compare resnet50 256 $row" \
      "$(awk '/^==== [0-9][0-9]:/ { buf = "" } { buf = buf $0 "\n" } END { printf "%s", buf }' "$log" |
        grep -E '^(tally-|pytorch |ratio)' | tr -s ' ' | cut -d' ' -f1-3 | tr '\n' ';')"
  done
}

# Where the time goes, both sides, the same three precisions: `tally train --profile` (GPU time
# per op, steps 2 onward) and PyTorch's profiler (bench/compare_pytorch.py --torch-profile).
step_profile() {
  local log=$logs/profile.log row extra run=/tmp/tally-gpu-profile
  : >"$log"
  # `auto` formats: float32 row-major, TF32 and bf16 channels-last (since 2026-11-28); bf16 row-major too.
  for row in "fp32" "tf32 --tf32" "bf16 --precision bf16" "bf16-nchw --precision bf16 --memory-format contiguous"; do
    read -r row extra <<<"$row"
    rm -rf "$run-$row"
    # shellcheck disable=SC2086  # $extra is a list of flags
    run_logged "tally train --profile resnet50 $row" "$log" 40 "$bundle/run" "$bundle/bin/tally" train \
      --model resnet50 --data synthetic:3x224x224 --num-classes 1000 --batch-size 256 --steps 4 --lr 0.01 \
      --schedule constant --no-augment --no-eval --device cuda --no-progress --profile --out "$run-$row" \
      --tuning-seconds 10 $extra
    [[ -f $run-$row/profile.txt ]] && cp "$run-$row/profile.txt" "$logs/profile-tally-$row.txt"
    # The step's wall time split into the ops' and the GPU's idle time (the memory-bound issue's goal:
    # idle <= 2 ms a step).
    result "tally $row: $(grep -h '^per step:' "$run-$row/profile.txt" 2>/dev/null | cut -c11- || echo 'no profile')"
    [[ $row == bf16-nchw ]] && continue  # PyTorch's bf16: above
    local bench=""
    [[ $row == bf16 ]] && bench=--cudnn-benchmark
    # shellcheck disable=SC2086
    run_logged "torch profile resnet50 $row" "$log" 30 "$bundle/run" "${PYTHON:-python3}" bench/compare_pytorch.py \
      --model resnet50 --batch 256 --steps 2 --warmup 2 --device cuda --torch-profile "$logs/profile-torch-$row.txt" \
      $extra $bench
    result "profiles resnet50 $row (tally, torch)"
  done
}

step_sanitize() {
  local cs list_only=0
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1 || true)
  if [[ -z $cs ]]; then
    if ((!rehearsal)); then
      note "compute-sanitizer: not found, skipped"
      status=1
      return
    fi
    list_only=1
    note "compute-sanitizer: not found (rehearsal: the runs below are listed, not run)"
  fi
  local tool bin filter extra errs
  while read -r tool bin filter extra; do
    [[ -z $tool || $tool == \#* ]] && continue
    if ((list_only)); then
      [[ -x $bundle/bin/$bin ]] || { note "sanitize: no $bundle/bin/$bin"; status=1; }
      continue
    fi
    local log=$logs/sanitize-$tool-$bin.log
    run_logged "$tool $bin" "$log" 120 "$bundle/run" "$cs" --tool "$tool" --error-exitcode 97 --print-limit 20 $extra \
      "$bundle/bin/$bin" --gtest_color=no --gtest_filter="$filter"
    ((last_rc == 125)) && continue  # not run: out of time (noted)
    errs=$(grep -E 'ERROR SUMMARY: [0-9]+|RACECHECK SUMMARY' "$log" | tail -1 || true)
    result "$tool $bin" "${errs:-no sanitizer summary}"
  done <scripts/gpu-sanitize.list
}

# Tests whose outcome depends on their fresh random inputs, many times: REPEAT_FILTER (default the
# whole-ResNet-20 step tests) REPEAT times (default 10) with fresh seeds, then each seed in
# REPEAT_SEEDS (default none) twice, to tell a failure that follows the data from one that does not.
step_repeat() {
  local log=$logs/repeat.log filter=${REPEAT_FILTER:-GpuOps.ResNet20*} seed
  : >"$log"
  run_logged "gpu_ops_test x${REPEAT:-10}" "$log" 120 "$bundle/run" "$bundle/bin/gpu_ops_test" --gtest_color=no \
    --gtest_filter="$filter" --gtest_repeat="${REPEAT:-10}"
  result "repeat $filter x${REPEAT:-10}" "$(grep -c '^\[       OK \]' "$log") passed, $(grep -c '^\[  FAILED  \] .*ms)$' "$log") failed"
  for seed in ${REPEAT_SEEDS:-}; do
    TALLY_TEST_SEED=$seed run_logged "gpu_ops_test seed $seed" "$log" 60 "$bundle/run" "$bundle/bin/gpu_ops_test" \
      --gtest_color=no --gtest_filter="$filter" --gtest_repeat=2
    result "repeat $filter seed $seed x2" "rc $last_rc"
  done
}

# Plans without the GPU against the GPU's own (docs/gpu.md, "Plans without the GPU"): each case
# planned on the device with the convolutions through the graph API, as a plan without it takes
# them, and from the device file this run saved (env), then the two outputs compared — all but the
# line saying the plan was made without the GPU and the timing line. The cases are
# tests/plan_golden.sh's h200_* ones (the host tier's is row-major float32) and ResNet-50 batch 4096
# in 8 GiB in bf16 (channels-last).
step_deviceless() {
  local log=$logs/deviceless.log file=$out/device.json name args same=0 cases=0
  : >"$log"
  if [[ ! -s $file ]]; then
    run_logged "tally device --save" "$log" 20 "$bundle/run" "$bundle/bin/tally" device --save "$file"
  fi
  # A rehearsal has no GPU to describe: the committed H200 file stands in (its plans run, none compared).
  ((rehearsal)) && [[ ! -s $file ]] && file=tests/fixtures/devices/h200.json
  for name in resnet20-tf32 resnet50-bf16-m64 resnet50-host-tier resnet50-bf16-4096 resnet50-stages; do
    case $name in
      resnet20-tf32) args=(--model resnet20 --input 3x32x32 --batch-size 512 --memory-limit 48MiB --tf32) ;;
      resnet50-bf16-m64) args=(--model resnet50 --input 3x224x224 --batch-size 256 --micro-batch 64 --memory-limit 8GiB
        --precision bf16) ;;
      resnet50-host-tier) args=(--model resnet50 --input 3x224x224 --batch-size 4096 --optimizer adamw --recompute none
        --memory-limit 600MiB --host-memory-limit 2GiB --copy-bandwidth 25 --compute-rate 200000 --no-layers) ;;
      resnet50-bf16-4096) args=(--model resnet50 --input 3x224x224 --batch-size 4096 --memory-limit 8GiB --precision bf16) ;;
      # Two pipeline stages in 300 MiB each, with their messages' host staging (docs/distributed.md).
      resnet50-stages) args=(--model resnet50 --input 3x224x224 --batch-size 8 --memory-limit 300MiB --pipeline-stages 2
        --no-layers) ;;
    esac
    local gpu=$logs/deviceless-$name-gpu.txt from=$logs/deviceless-$name-file.txt
    : >"$gpu"
    : >"$from"
    run_logged "tally plan $name (on the GPU)" "$gpu" 40 env TALLY_CUDNN_CONV_API=graph "$bundle/run" \
      "$bundle/bin/tally" plan --device cuda "${args[@]}"
    run_logged "tally plan $name (from the file)" "$from" 40 "$bundle/run" "$bundle/bin/tally" plan --device cuda \
      "${args[@]}" --device-file "$file"
    local drop='^====|^run: |^planned without the GPU|dry runs in .* s; nothing was computed$'
    if ((rehearsal)) && ! grep -qE '^ *plan: ' "$gpu"; then
      echo "$name: no GPU here, nothing to compare" >>"$log"
    elif diff <(grep -Ev "$drop" "$gpu") <(grep -Ev "$drop" "$from") >>"$log" 2>&1 && grep -qE '^ *plan: ' "$gpu"; then
      same=$((same + 1))
      echo "$name: the same plan" >>"$log"
    else
      echo "$name: the plans differ (above)" >>"$log"
      status=1
    fi
    cases=$((cases + 1))
  done
  result "deviceless plans" "$same of $cases equal to the GPU's"
}

# Convolution engines chosen by measurement (docs/gpu.md, "Tuning"): ResNet-50 batch 256 in one
# micro-batch, as the compare step runs it, tuned into the check's cache folder (so the later steps
# replay the file and measure only what is new), then the same run without tuning: the tuning line
# (passes, seconds, the time saved a run by cuDNN's own measure) and both runs' images/s. bf16 and
# TF32 go through the graph API by default; float32 is tuned through it (TALLY_CUDNN_CONV_API=graph)
# and compared with its default, the legacy API.
step_tuning() {
  local log=$logs/tuning.log run=/tmp/tally-gpu-tuning row extra tuning api
  : >"$log"
  # The tuning test: ResNet-20 in bf16 measured, replayed from its file and from its record, the
  # same bits and exact peaks (it prints the first run's tuning line: how long measuring took).
  local tlog=$logs/gpu_bf16_test-tuned.log
  : >"$tlog"
  run_logged "gpu_bf16_test *Tuned*" "$tlog" 60 "$bundle/run" "$bundle/bin/gpu_bf16_test" --gtest_color=no \
    --gtest_filter='*Tuned*'
  result "gpu_bf16_test *Tuned*" "$(gtest_line "$tlog") $(grep -E "^first run's tuning:" "$tlog" | cut -c13-130)"
  # float32 before TF32: its untuned run is the legacy API's baseline, the comparison tuning's most asked.
  for row in "bf16 --precision bf16" "fp32" "tf32 --tf32"; do
    read -r row extra <<<"$row"
    for tuning in tuned none; do
      api=auto
      [[ $row == fp32 && $tuning == tuned ]] && api=graph
      local flags=(--tuning-seconds 20)
      [[ $tuning == none ]] && flags=(--tuning-file none)
      rm -rf "$run-$row-$tuning"
      # shellcheck disable=SC2086  # $extra is a list of flags
      TALLY_CUDNN_CONV_API=$api run_logged "tally train resnet50 256 $row $tuning" "$log" 60 "$bundle/run" \
        "$bundle/bin/tally" train --model resnet50 --data synthetic:3x224x224 --num-classes 1000 --batch-size 256 \
        --steps 6 --lr 0.01 --schedule constant --no-augment --no-eval --device cuda --no-progress \
        --out "$run-$row-$tuning" "${flags[@]}" $extra
      # (tally train prints img/s only in its progress line, which --no-progress leaves out: summary.json's)
      result "resnet50 256 $row $tuning ($api API)" \
        "$( [[ $tuning == tuned ]] && grep -E '^tuning:' "$log" | tail -1 | cut -c9-140) $(summary_rate "$run-$row-$tuning")"
      [[ -f $run-$row-$tuning/summary.json ]] && cp "$run-$row-$tuning/summary.json" "$logs/tuning-$row-$tuning-summary.json"
    done
  done
  if [[ -f ${XDG_CACHE_HOME:-}/tally/conv-tuning.json ]]; then cp "$XDG_CACHE_HOME/tally/conv-tuning.json" "$logs/"; fi
}

# The norm kernels' bandwidth against a device-to-device copy of the same run (bench_kernels'
# counter of_copy; the memory-bound issue's goal is >= 0.7).
step_norms() {
  local log=$logs/norms.log
  : >"$log"
  run_logged "bench_kernels norms (cuda)" "$log" 90 "$bundle/run" "$bundle/bin/bench_kernels" \
    --benchmark_filter='device_copy/cuda|batch_norm_relu_(fwd|bwd)/cuda' --benchmark_min_time=0.1 \
    --benchmark_counters_tabular=true
  # A row: name, time, unit, CPU time, unit, iterations, bytes/s, of_copy (the last column).
  result "norms: of_copy, worst and best" \
    "$(grep -E '^batch_norm_relu_' "$log" | awk '{ print $1, $NF }' | sort -k2 -g | sed -n '1p;$p' | tr '\n' ';')"
}

step_bench() {
  local log=$logs/bench.log
  run_logged "bench_train (cuda)" "$log" 120 "$bundle/run" "$bundle/bin/bench_train" --benchmark_filter='cuda' \
    --benchmark_min_time=1 --benchmark_counters_tabular=true
  result "bench_train cuda"
}

run() {
  unpack_if_needed
  mkdir -p "$logs" "$out"
  summary=$logs/summary.txt
  deadline=$(($(date +%s) + ${RUN_SECONDS:-540}))
  # Every tally of the check tunes into one file of its own, which comes back with the logs.
  export XDG_CACHE_HOME=$logs/cache
  {
    echo "== gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ): $*$( ((rehearsal)) && echo ' (rehearsal, no GPU)')"
    head -1 "$bundle/BUILD_INFO" 2>/dev/null || true
    echo "whole run: at most ${RUN_SECONDS:-540}s"
  } >>"$summary"
  local s
  for s in "$@"; do
    case $s in
      env | tests | mpi | tuning | sanitize | train | graphs | resnet50 | norms | deviceless | host | offload | compare | profile | bench | repeat) ;;
      *) echo "gpu-check: unknown step '$s': expected env, tests, mpi, tuning, train, graphs, resnet50, norms, deviceless, host, offload, compare, profile, sanitize, bench or repeat" >&2; exit 2 ;;
    esac
  done
  local t0
  for s in "$@"; do
    t0=$SECONDS
    step_end=$(($(date +%s) + ${step_caps[$s]:-${RUN_SECONDS:-540}}))
    "step_$s" || { note "gpu-check: step $s ended early (exit $?)"; status=1; }
    note "-- step $s: $((SECONDS - t0))s"
    publish
  done
  note "result: $([[ $status == 0 ]] && echo PASS || echo FAIL) after ${SECONDS}s"
  return $status
}

case ${1:-} in
  pack) pack ;;
  build-deps) build_deps ;;
  build-there) build_there ;;
  run)
    shift
    (($#)) || set -- "${all_steps[@]}"
    run "$@"
    ;;
  rehearse)
    shift
    (($#)) || set -- "${all_steps[@]}"
    rehearsal=1
    run "$@"
    ;;
  without-system-mpi)
    shift
    exec unshare -m bash -c "$hide_system_mpi" without-system-mpi "$@"
    ;;
  *)
    echo "usage: scripts/gpu-check.sh pack | run [STEP...] | rehearse [STEP...] | without-system-mpi CMD... | build-deps | build-there   (see the top of this file)" >&2
    exit 2
    ;;
esac
