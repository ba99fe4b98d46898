#!/usr/bin/env bash
# plan_golden.sh TALLY FIXTURE_DIR [--update] — `tally plan` output for fixed configurations against
# the text kept in FIXTURE_DIR (one NAME.txt per case: exit status, stdout, stderr).
#
# The planner's decisions (micro-batch size, recomputation level, predicted peak, what is live at
# the peak, the per-layer table) are the contract MBP rests on, so a change of code that is meant
# to keep behaviour must keep these bytes. Only the timing line ("N dry runs in X s") is dropped.
# A change that is meant to alter a plan regenerates the files with --update and says why in its
# commit.
#
# The plans are made on the reference convolution path (TALLY_CPU_CONV=reference: im2col + GEMM,
# whose workspaces are tally's own) with an explicit --memory-format contiguous, so the bytes are
# the same on every x86-64 processor. oneDNN sizes its scratchpads by processor and thread count
# (an AMX Xeon's ResNet-50 bf16 layer1.0.conv1 peaked at 137.1 MiB where another processor's at
# 138.6): its plans are checked by invariants instead — predicted == measured on real steps, and
# stated bounds (docs/testing.md, "Plans on every processor").
set -uo pipefail
export TALLY_CPU_CONV=reference
tally=${1:?usage: plan_golden.sh TALLY FIXTURE_DIR [--update]}
dir=${2:?usage: plan_golden.sh TALLY FIXTURE_DIR [--update]}
update=${3:-}

r50=(--model resnet50 --input 3x224x224 --batch-size 4096 --memory-limit 8GiB --memory-format contiguous)
cases=(
  "resnet50_224_b4096_8GiB_none|${r50[*]} --recompute none"
  "resnet50_224_b4096_8GiB_blocks|${r50[*]} --recompute blocks"
  "resnet50_224_b4096_8GiB_all|${r50[*]} --recompute all"
  "resnet20_28_b512_32MiB|--model resnet20 --input 1x28x28 --batch-size 512 --memory-limit 32MiB --memory-format contiguous"
  "resnet50_1024_b2_1GiB_auto|--model resnet50 --input 3x1024x1024 --batch-size 2 --memory-limit 1GiB --memory-format contiguous"
  "resnet18_group_adamw_blocks_layer1|--model resnet18 --norm group --optimizer adamw --input 3x64x64 --batch-size 300 --memory-limit 200MiB --recompute blocks+layer1 --memory-format contiguous"
  "resnet9_fixed_micro_batch_too_large|--model resnet9 --norm none --input 3x32x32 --batch-size 1000 --memory-limit 128MiB --micro-batch 77 --no-layers --momentum 0 --memory-format contiguous"
  "resnet50_224_b4096_8GiB_none_bf16|${r50[*]} --recompute none --precision bf16"
  "resnet56_group_12MiB_none|--model resnet56 --norm group --input 3x32x32 --batch-size 64 --memory-limit 12MiB --recompute none --no-layers --memory-format contiguous"
  # Plans of a GPU that is not here, from the device file an H200 saved (docs/gpu.md, "Plans without
  # the GPU"): run from the devices folder, so the file's name in the output is the same everywhere.
  # The GPU check compares the same commands' output on the GPU itself.
  "h200_resnet20_32_b512_48MiB_tf32|--device cuda --device-file h200.json --model resnet20 --input 3x32x32 --batch-size 512 --memory-limit 48MiB --tf32"
  "h200_resnet50_224_b256_m64_8GiB_bf16|--device cuda --device-file h200.json --model resnet50 --input 3x224x224 --batch-size 256 --micro-batch 64 --memory-limit 8GiB --precision bf16"
  "h200_resnet50_224_b4096_600MiB_host_tier|--device cuda --device-file h200.json --model resnet50 --input 3x224x224 --batch-size 4096 --optimizer adamw --recompute none --memory-limit 600MiB --host-memory-limit 2GiB --copy-bandwidth 25 --compute-rate 200000 --no-layers"
)
devices=$(cd "$dir/../devices" && pwd)
cuda=yes
[[ $("$tally" --version) == *"no CUDA backend"* ]] && cuda=no

failed=0
for c in "${cases[@]}"; do
  name=${c%%|*}
  read -r -a args <<<"${c#*|}"
  if [[ " ${args[*]} " == *" --device-file "* ]]; then
    (cd "$devices" && "$tally" plan "${args[@]}") >/tmp/plan_golden.$$.out 2>/tmp/plan_golden.$$.err
    rc=$?
    if [[ $cuda == no ]]; then  # a build without the CUDA backend refuses, saying so
      if [[ $rc -ne 0 ]] && grep -q "no CUDA backend" /tmp/plan_golden.$$.err; then
        echo "ok $name (refused: this build has no CUDA backend)"
      else
        echo "FAILED $name: a build without CUDA did not refuse --device-file clearly:"; cat /tmp/plan_golden.$$.err
        failed=1
      fi
      continue
    fi
  else
    "$tally" plan "${args[@]}" >/tmp/plan_golden.$$.out 2>/tmp/plan_golden.$$.err
    rc=$?
  fi
  out=$(echo "exit status $rc"; echo "-- stdout"; grep -v ' dry runs in .* s; nothing was computed$' /tmp/plan_golden.$$.out
        echo "-- stderr"; cat /tmp/plan_golden.$$.err)
  file=$dir/$name.txt
  if [[ $update == --update ]]; then
    printf '%s\n' "$out" >"$file"
    echo "wrote $file"
  elif ! diff -u "$file" <(printf '%s\n' "$out") >/tmp/plan_golden.$$.diff; then
    echo "FAILED $name: tally plan ${args[*]} differs from $file:"
    cat /tmp/plan_golden.$$.diff
    failed=1
  else
    echo "ok $name"
  fi
done
rm -f /tmp/plan_golden.$$.diff /tmp/plan_golden.$$.out /tmp/plan_golden.$$.err
exit $failed
