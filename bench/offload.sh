#!/usr/bin/env bash
# bench/offload.sh — keep, recompute or offload per segment (docs/activations.md): the plan's
# estimated step time for its choice against the measured one, on this machine's device.
# ResNet-50 3x224x224, SGD, batch 256, the state kept on the device (--placement device) and a host
# tier of 8 GiB for what segments offload, at three device budgets: one where every segment is kept,
# one where one sample only fits with some segments recomputed, one where it needs more of them
# recomputed or offloaded. Each budget is one `tally train --steps STEPS` (its rates measured at its
# start); measured = the mean step time after the first (summary.json's images/s). Prints Markdown.
#   bench/offload.sh [BUILD_DIR] [STEPS] [BUDGETS...]
set -euo pipefail
build=${1:-build}
steps=${2:-2}
shift 2 || true
budgets=("$@")
[[ ${#budgets[@]} -gt 0 ]] || budgets=(400MiB 360MiB 340MiB)
tally=$build/apps/tally
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
field() { sed -n "s/.*\"$2\": \"\{0,1\}\([0-9a-z.e+-]*\).*/\1/p" "$1/summary.json"; }

echo "| budget | micro-batch | segments (the plan's choice) | cost model | estimated step | keeping everything (est.) | measured step | peak device / host (predicted = measured) |"
echo "|---|---|---|---|---|---|---|---|"
for budget in "${budgets[@]}"; do
  dir=$out/$budget
  OMP_NUM_THREADS=2 "$tally" train --model resnet50 --data synthetic:3x224x224 --batch-size 256 --steps "$steps" \
    --optimizer sgd --memory-limit "$budget" --host-memory-limit 8GiB --placement device --threads 2 --no-eval \
    --no-progress --out "$dir" >"$dir.log" 2>&1 || { echo "| $budget | failed: $(tail -1 "$dir.log") |"; continue; }
  m=$(sed -n 's/^plan: batch 256 = [0-9]* micro-batches of \([0-9]*\).*/\1/p; s/^plan: batch 256 = 1 micro-batch.*/256/p' "$dir.log" | head -1)
  choice=$(sed -n 's/.*recompute: \(per segment ([^)]*)\|none\).*/\1/p' "$dir.log" | head -1)
  rates=$(grep -o 'copies [0-9.]* GB/s, compute [0-9.]* GFLOP/s' "$dir.log" | head -1)
  est=$(sed -n 's/.*estimated step \([0-9.]*\) s: .*keeping everything \([0-9.]*\) s.*/\1 s|\2 s/p' "$dir.log" | head -1)
  # A choice that keeps everything states one estimate: its own, which is keeping everything's.
  [[ -n $est ]] || est=$(sed -n 's/.*recompute: .*estimated step \([0-9.]*\) s at .*/\1 s|\1 s/p' "$dir.log" | head -1)
  ips=$(field "$dir" images_per_second)
  measured=$(awk -v ips="$ips" 'BEGIN { printf "%.1f s", 256 / ips }')
  peaks=$(sed -n 's/^memory: measured step peak \([0-9.]* [KMG]iB\).*— exact.*/\1/p' "$dir.log" | head -1)
  host=$(sed -n 's/^host tier: measured step peak \([0-9.]* [KMG]iB\).*— exact.*/\1/p' "$dir.log" | head -1)
  echo "| $budget | $m | ${choice:-none} | ${rates:-?} | ${est%%|*} | ${est##*|} | $measured | ${peaks:-?} / ${host:-0} |"
done
