#!/usr/bin/env bash
# bench/data_parallel.sh — data parallelism on one machine: 2 ranks of 1 thread each (mpirun -np 2)
# against 1 process of 2 threads and 1 process of 1 thread, ResNet-20 on synthetic 3x32x32 images,
# batch 128 (each rank takes 64), interleaved ROUNDS times so the machine's drift hits all alike.
# Prints a Markdown table: images/s (steps after the first) and the collectives' share of a step.
#   bench/data_parallel.sh [BUILD_DIR] [ROUNDS] [STEPS]
set -euo pipefail
build=${1:-build}
rounds=${2:-2}
steps=${3:-12}
tally=$build/apps/tally
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
common=(train --model resnet20 --data synthetic --batch-size 128 --steps "$steps" --no-progress)
field() { sed -n "s/.*\"$2\": \([0-9.e+-]*\).*/\1/p" "$1/summary.json"; }
echo "| round | configuration | images/s | collectives ms/step | share of step |"
echo "|---|---|---|---|---|"
for r in $(seq 1 "$rounds"); do
  for cfg in one_thread two_threads two_ranks; do
    dir=$out/$cfg-$r
    case $cfg in
      one_thread) OMP_NUM_THREADS=1 "$tally" "${common[@]}" --threads 1 --out "$dir" >/dev/null ;;
      two_threads) OMP_NUM_THREADS=2 "$tally" "${common[@]}" --threads 2 --out "$dir" >/dev/null ;;
      two_ranks) OMP_NUM_THREADS=1 mpirun -np 2 "$tally" "${common[@]}" --threads 1 --out "$dir" >/dev/null ;;
    esac
    ips=$(printf "%.1f" "$(field "$dir" images_per_second)")
    comm=$(field "$dir" communication_seconds_per_step)
    share=$(awk -v c="$comm" -v i="$ips" 'BEGIN { if (c > 0) printf "%.1f%%", 100 * c / (128 / i); else print "-" }')
    ms=$(awk -v c="$comm" 'BEGIN { if (c > 0) printf "%.1f", 1000 * c; else print "-" }')
    echo "| $r | $cfg | $ips | $ms | $share |"
  done
done
