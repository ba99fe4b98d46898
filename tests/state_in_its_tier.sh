#!/usr/bin/env bash
# state_in_its_tier.sh TALLY — the optimizer's state is created in the tier the plan places it in,
# never on the device first (docs/host-tier.md, "How the placement is chosen"):
#   * ResNet-50 (10 classes, 3x64x64, AdamW: parameters 90 MiB + gradients 90 + state 180) trains
#     in a 300 MiB device budget with a 4 GiB host tier, exact in both tiers, and its --save after 2
#     steps is byte-identical to the all-device run's in 2 GiB (a CPU convolution's workspace limit
#     is max(budget / 32, 64 MiB), and a smaller one splits a pass into more chunks of samples,
#     which rounds differently: the reference must have the same limit, so not 4 GiB);
#   * ResNet-18 3x64x64 with SGD and momentum plans and trains in 120 MiB with the optimizer on
#     a 1 GiB host tier — on the reference convolution path, whose workspaces are tally's own
#     (oneDNN's scratchpads differ by processor: 45 MiB here would not leave room).
# The ResNet-50 budget holds on every processor: each convolution's workspace is capped at 64 MiB.
set -u
tally=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
common=(--data synthetic:3x64x64 --num-classes 10 --steps 2 --no-eval --no-progress --seed 3)
r50=(--model resnet50 --optimizer adamw --lr 0.001 --batch-size 16 --micro-batch 4)
"$tally" train "${common[@]}" "${r50[@]}" --memory-limit 2GiB --save "$work/device.safetensors" \
  >"$work/device.log" 2>&1 || { tail -5 "$work/device.log"; fail "the all-device ResNet-50 run failed"; }
"$tally" train "${common[@]}" "${r50[@]}" --memory-limit 300MiB --host-memory-limit 4GiB \
  --save "$work/tiers.safetensors" >"$work/tiers.log" 2>&1 || { tail -5 "$work/tiers.log"; fail "ResNet-50 in 300 MiB with a host tier failed"; }
grep -q "the optimizer state (179.5 MiB) is created where the plan places it" "$work/tiers.log" \
  || fail "the ResNet-50 run did not defer its state: $(grep 'allocated before planning' "$work/tiers.log")"
grep -q "measured step peak .* — exact" "$work/tiers.log" || fail "ResNet-50: the device's peak was not exact"
grep -q "host tier: measured step peak .* — exact" "$work/tiers.log" || fail "ResNet-50: the host tier's peak was not exact"
cmp -s "$work/device.safetensors" "$work/tiers.safetensors" || fail "ResNet-50: --save differs from the all-device run's"
echo "ok: ResNet-50 AdamW in 300 MiB with a 4 GiB host tier: $(grep -o 'placement [a-z]*: .*' "$work/tiers.log" | head -1); --save identical"
TALLY_CPU_CONV=reference "$tally" train "${common[@]}" --model resnet18 --optimizer sgd --batch-size 64 --memory-limit 120MiB \
  --host-memory-limit 1GiB --placement optimizer >"$work/r18.log" 2>&1 \
  || { tail -5 "$work/r18.log"; fail "ResNet-18 SGD in 120 MiB with the optimizer on the host failed"; }
grep -q "host tier: measured step peak .* — exact" "$work/r18.log" || fail "ResNet-18: the host tier's peak was not exact"
echo "ok: ResNet-18 SGD batch 64 in 120 MiB, the optimizer on a 1 GiB host tier"
