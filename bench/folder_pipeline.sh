#!/usr/bin/env bash
# bench/folder_pipeline.sh — a folder of JPEGs as a data set (docs/folders.md), against torchvision:
#   1. the input pipeline alone — read, decode at full scale, random resized crop to 224x224 with
#      PIL's bilinear resize, flip, normalise — tally's bench_folder (data::Loader, N decoding
#      threads) beside torchvision's ImageFolder + DataLoader (N worker processes, the same
#      transforms on PIL), at 1 and 2 workers, interleaved ROUNDS times; images/s of one pass; and
#      tally with JPEG's DCT scaling where the crop allows (not PIL's full-scale pixels), with how
#      often it applied;
#   2. end to end: `tally train` ResNet-18 at 3x112x112 for one epoch over the folder, against the
#      same number of steps from memory (synthetic:3x112x112), 2 threads each.
# The folder: bench/make_jpeg_folder.py DIR (1,000 textured JPEGs of about 500x375, quality 90),
# written first when DIR/train does not exist. Needs Debian's python3-torchvision and python3-pil.
#   bench/folder_pipeline.sh [BUILD_DIR] [DIR] [ROUNDS]
set -euo pipefail
build=${1:-build}
dir=${2:-/tmp/tally-jpegs}
rounds=${3:-2}
python=/usr/bin/python3
here=$(cd "$(dirname "$0")" && pwd)
[[ -d $dir/train ]] || "$python" "$here/make_jpeg_folder.py" "$dir"
rate() { sed -n 's/.*images_per_second=\([0-9.]*\).*/\1/p'; }
echo "| round | workers | tally images/s | torchvision images/s | ratio | tally with DCT scaling: images/s (decoded smaller) |"
echo "|---|---|---|---|---|---|"
for r in $(seq 1 "$rounds"); do
  for w in 1 2; do
    t=$(OMP_NUM_THREADS=2 "$build/bench/bench_folder" "$dir" "$w" | rate)
    v=$("$python" "$here/folder_pipeline.py" "$dir" "$w" | rate)
    dct=$(OMP_NUM_THREADS=2 "$build/bench/bench_folder" "$dir" "$w" 224 64 1000000 dct)
    scaled=$(sed -n 's/.* images=\([0-9]*\) .*dct_scaled=\([0-9]*\).*/\2 of \1/p' <<<"$dct")
    echo "| $r | $w | $t | $v | $(awk -v a="$t" -v b="$v" 'BEGIN { printf "%.2fx", a / b }') | $(rate <<<"$dct") ($scaled) |"
  done
done
echo
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
n=$(find "$dir/train" -name '*.jpg' | wc -l)
steps=$((n / 64))
common=(--model resnet18 --batch-size 64 --threads 2 --no-progress --no-eval --memory-limit 4GiB)
t0=$(date +%s.%N)
OMP_NUM_THREADS=2 "$build/apps/tally" train --data "folder:$dir" --input 3x112x112 --epochs 1 "${common[@]}" \
  --out "$out/folder" > "$out/folder.log"
t1=$(date +%s.%N)
OMP_NUM_THREADS=2 "$build/apps/tally" train --data synthetic:3x112x112 --num-classes 10 --steps "$steps" "${common[@]}" \
  --out "$out/memory" > "$out/memory.log"
t2=$(date +%s.%N)
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
ips() { sed -n 's/.*"images_per_second": \([0-9.]*\).*/\1/p' "$1/summary.json" | awk '{ printf "%.1f", $1 }'; }
echo "| ResNet-18 3x112x112, batch 64, $steps steps | images/s (steps after the first) | seconds, the process's start to its end |"
echo "|---|---|---|"
echo "| folder of JPEGs (decoded while the steps run) | $(ips "$out/folder") | $(elapsed "$t0" "$t1") |"
echo "| synthetic:3x112x112 (drawn in memory) | $(ips "$out/memory") | $(elapsed "$t1" "$t2") |"
