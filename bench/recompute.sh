#!/usr/bin/env bash
# bench/recompute.sh — what recomputation buys and costs on the CPU, by level of the ladder
# (nn/resnet.h): none, blocks, blocks + layer1, all.
#   1. memory, planned (nothing computed): ResNet-50 3x224x224 in an 8 GiB budget — the bytes of
#      category activation live at a one-sample step's peak, and the micro-batch at batch 4096;
#      plus the FLOPs each level re-runs per step;
#   2. step time, measured: `tally train --no-eval` with 2 threads, ResNet-20 3x32x32 batch 128 and
#      ResNet-50 3x224x224 batch 16 on synthetic data, images/s of the steps after the first,
#      the levels interleaved ROUNDS times so the machine's drift hits all alike.
# Prints Markdown tables.
#   bench/recompute.sh [BUILD_DIR] [ROUNDS] [STEPS] (ResNet-50 runs STEPS/2 + 1 steps)
set -euo pipefail
build=${1:-build}
rounds=${2:-2}
steps=${3:-6}
tally=$build/apps/tally
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
levels=(none blocks blocks+layer1 all)

echo "ResNet-50 3x224x224, memory limit 8 GiB (tally plan):"
echo
echo "| level | activation at a one-sample peak | one-sample peak | micro-batch at batch 4096 | re-run per step at that micro-batch |"
echo "|---|---|---|---|---|"
for level in "${levels[@]}"; do
  one=$("$tally" plan --model resnet50 --batch-size 1 --memory-limit 8GiB --recompute "$level" --no-layers)
  big=$("$tally" plan --model resnet50 --batch-size 4096 --memory-limit 8GiB --recompute "$level" --no-layers)
  act=$(sed -n 's/.*live at the peak:.*activation \([0-9.]* [KMG]iB\).*/\1/p' <<<"$one")
  peak=$(sed -n 's/.*predicted peak \([0-9.]* [KMG]iB\) of.*/\1/p' <<<"$one")
  m=$(sed -n 's/^plan: batch 4096 = [0-9]* micro-batches (\?[0-9]* \?o\?f\? \?\([0-9]*\).*/\1/p' <<<"$big")
  cost=$(sed -n 's/.*re-runs \([0-9.]* [GTP]FLOP\) of forward per step: +\([0-9]*%\).*/\1 (+\2 of the step)/p' <<<"$big")
  echo "| $level | $act | $peak | $m | ${cost:--} |"
done

field() { sed -n "s/.*\"$2\": \"\{0,1\}\([0-9a-z.e+-]*\).*/\1/p" "$1/summary.json"; }
echo
echo "Step time, 2 threads, images/s of the steps after the first:"
echo
echo "| round | model, batch | $(printf '%s | ' "${levels[@]}")"
echo "|---|---|$(printf -- '---|%.0s' "${levels[@]}")"
for r in $(seq 1 "$rounds"); do
  for model in resnet20 resnet50; do
    if [[ $model == resnet20 ]]; then args=(--data synthetic --batch-size 128 --steps "$steps"); label="ResNet-20, 128";
    else args=(--data synthetic:3x224x224 --batch-size 16 --steps $((steps / 2 + 1))); label="ResNet-50, 16"; fi
    row="| $r | $label |"
    base=""
    for level in "${levels[@]}"; do
      dir=$out/$model-$level-$r
      OMP_NUM_THREADS=2 "$tally" train --model "$model" "${args[@]}" --threads 2 --recompute "$level" --no-eval \
        --no-progress --out "$dir" >/dev/null
      ips=$(field "$dir" images_per_second)
      [[ -z $base ]] && base=$ips
      row+=$(awk -v i="$ips" -v b="$base" 'BEGIN { if (i == b) printf " %.1f |", i; else printf " %.1f (%+.0f%%) |", i, 100 * (b / i - 1) }')
    done
    echo "$row"
  done
done
echo
echo "(+N%: step time over none's in the same round.)"
