#!/usr/bin/env bash
# bf16_plan_bound.sh TALLY — ResNet-50 224² batch 4096 in 8 GiB with bf16 activations fits a
# micro-batch of at least 1.8x float32's 96 (173) where oneDNN runs bf16 convolutions (AVX-512,
# AMX: 179 measured), and 1.7x (164) where they take the widened float32 route (AVX2, or
# ONEDNN_MAX_CPU_ISA=AVX2: 171 measured). The plan itself is exact on every processor; its size
# depends on oneDNN's scratchpads, so this is a bound, not a fixture (docs/testing.md). Whether
# oneDNN runs bf16 is decided as bf16_test's expect_onednn_bf16() decides it: keep the two in step.
set -uo pipefail
tally=${1:?usage: bf16_plan_bound.sh TALLY}
native=1
for f in avx512f avx512bw avx512vl avx512dq; do grep -qw "$f" /proc/cpuinfo || native=0; done
case ${ONEDNN_MAX_CPU_ISA:-} in AVX2* | SSE*) native=0 ;; esac
grep -q "CPU conv: oneDNN" <<<"$("$tally" --version)" || native=0
bound=164 why="widened route: 1.7x"
((native)) && bound=173 why="oneDNN runs bf16 here: 1.8x"
out=$("$tally" plan --model resnet50 --batch-size 4096 --memory-limit 8GiB --recompute none --precision bf16 --no-layers 2>&1)
rc=$?
echo "$out"
((rc == 0)) || { echo "FAIL: tally plan exited $rc"; exit 1; }
m=$(grep -oE 'plan: batch 4096 = [0-9]+ micro-batches (\([0-9]+ of |of )[0-9]+' <<<"$out" | grep -oE '[0-9]+$')
[[ -n $m ]] || { echo "FAIL: no plan line"; exit 1; }
if ((m < bound)); then
  echo "FAIL: bf16 micro-batch $m < $bound ($why float32's 96)"
  exit 1
fi
echo "ok: bf16 micro-batch $m >= $bound ($why float32's 96)"
