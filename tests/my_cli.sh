#!/usr/bin/env bash
# my_cli.sh PROGRAM — the whole `tally` command line for a model of one's own (apps/command_line.h,
# nn::register_model; examples/consumer/my_cli.cpp registers "small_resnet"): --model lists it and
# takes it; a run killed after a step resumes bit for bit (its --save file and last checkpoint the
# uninterrupted run's); `plan --report` writes the memory report with its exact plan; `sweep` runs
# two batch sizes; a name nobody registered is an error listing the registered ones.
# tests/consumer_test.sh runs it against the installed package too.
set -uo pipefail
cli=$(realpath "$1")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cd "$dir" || exit 1
fail() { echo "FAIL: $*"; exit 1; }
ARGS=(--model small_resnet --data synthetic:3x16x16 --steps 6 --batch-size 128 --micro-batch 64 --memory-limit 256MiB
      --checkpoint-every 3 --threads 2 --no-progress --warmup-epochs 0)

out=$("$cli" train --help 2>&1)
grep -q "small_resnet" <<<"$out" || fail "--model's help does not list small_resnet"
"$cli" train "${ARGS[@]}" --out ref --save ref.safetensors >ref.log 2>&1 || { cat ref.log; fail "the run failed"; }
grep -q "model small_resnet" ref.log || fail "the run's log does not name its model: $(head -3 ref.log)"
grep -qE "measured step peak .* — exact" ref.log || fail "the run's peak is not the predicted one: $(grep memory: ref.log)"
{ (TALLY_TEST_SIGKILL=after-step:4 exec "$cli" train "${ARGS[@]}" --out run --save run.safetensors) >run.log 2>&1; } 2>/dev/null
[[ $? -eq 137 ]] || fail "expected the run to be killed after step 4 (exit 137)"
"$cli" train --resume run >>run.log 2>&1 || { tail -5 run.log; fail "--resume failed"; }
cmp -s run.safetensors ref.safetensors || fail "the resumed run's --save file differs from the uninterrupted run's"
cmp -s run/checkpoint-6/state.safetensors ref/checkpoint-6/state.safetensors || fail "the last checkpoints differ"
"$cli" plan --model small_resnet --input 3x32x32 --batch-size 512 --memory-limit 16MiB --report plan.html >plan.log 2>&1 \
  || { cat plan.log; fail "plan failed"; }
grep -q "^plan: batch 512 = " plan.log && [[ -s plan.html ]] || fail "plan: no plan or no report: $(cat plan.log)"
grep -q "blocks + layer1" plan.html || grep -q "recompute" plan.log || fail "plan: no recomputation line"
"$cli" sweep --model small_resnet --data synthetic:3x16x16 --steps 2 --batch-sizes 64,128 --memory-limit 256MiB --threads 2 \
  --no-progress --no-eval --out sweep >sweep.log 2>&1 || { tail -5 sweep.log; fail "sweep failed"; }
[[ $(wc -l <sweep/sweep.csv) -eq 3 ]] || fail "sweep.csv: expected a header and 2 rows, found $(cat sweep/sweep.csv)"
out=$("$cli" train --model no_such_model --steps 1 2>&1) && fail "an unregistered model was accepted"
grep -q "small_resnet" <<<"$out" || fail "the error does not list the registered names: $out"
echo "my_cli: ok (a registered model: train, resume bit for bit, plan --report, sweep)"
