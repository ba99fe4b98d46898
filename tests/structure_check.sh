#!/usr/bin/env bash
# The structure of the code, checked: one way to reach a backend (core/dispatch.h and
# core/device.cpp; no `#if TALLY_HAVE_CUDA` outside kernels/, tests/ and bench/), one guard for
# host-side work in dry runs (is_dry_run() read in core/ only), and the MBP step free of backend
# code (mbp/, report/ and apps/ include no kernels/ header), report/ above mbp/ (nothing below it
# includes it), recomputation owned by mbp/ (no forget() in apps/), the ambient arena set in few
# places (mbp/ makes one current only through a DryRun and the entry points of the executors and
# the chooser, mbp/executor*.cpp, mbp/stage_runner.cpp and mbp/chooser.cpp, and reads none; dry runs and virtual arenas
# are made through core/dry_run.h's DryRun above core/), every command-line option registered from
# apps/options.cpp's table, the --data spec read by data/spec.cpp alone (the rest ask its DataSpec),
# a pipeline stage reached through Executor::stage() (no downcast to an executor type in apps/),
# no kernel declared in both backends' headers (kernels/backend.inc declares them once), and
# functions short enough to read (at most 80 lines in apps/, mbp/, report/ and core/autograd.cpp).
# Usage: structure_check.sh SOURCE_DIR
set -uo pipefail
cd "$1" || exit 2
status=0
fail() {
  echo "structure: $1" >&2
  echo "$2" | sed 's/^/  /' >&2
  status=1
}
layers=(core nn optim data distributed mbp report apps examples)
found=$(grep -rnE '^[[:space:]]*#[[:space:]]*(if|ifdef|ifndef|elif).*TALLY_HAVE_CUDA' "${layers[@]}" 2>/dev/null)
[[ -z "$found" ]] || fail "an #if on TALLY_HAVE_CUDA outside kernels/, tests/ and bench/ (use if constexpr (kHaveCudaBackend) in core/dispatch.h or core/device.cpp):" "$found"
found=$(grep -rn 'TALLY_RUN' core kernels "${layers[@]}" 2>/dev/null)
[[ -z "$found" ]] || fail "TALLY_RUN is gone: TALLY_DISPATCH skips kernels in a dry run itself:" "$found"
found=$(grep -rn 'is_dry_run' nn optim data distributed mbp report apps examples 2>/dev/null)
[[ -z "$found" ]] || fail "is_dry_run() above core/: host-side work uses the one guard, skip_side_effects() (core/dry_run.h):" "$found"
found=$(grep -rnE '#include "kernels/' mbp report apps 2>/dev/null)
[[ -z "$found" ]] || fail "mbp/, report/ and apps/ include no kernels/ header (core/ has the device-neutral interfaces):" "$found"
found=$(grep -rnE '#include "report/' core kernels nn optim data distributed mbp 2>/dev/null)
[[ -z "$found" ]] || fail "report/ presents plans and traces from above mbp/ (apps -> report -> mbp): nothing below it includes it:" "$found"
found=$(grep -rn 'forget()' apps 2>/dev/null)
[[ -z "$found" ]] || fail "apps/ never makes the planner forget: its plans are keyed by the model's recomputation state:" "$found"
found=$(grep -rnE 'current_arena|default_arena' mbp 2>/dev/null)
[[ -z "$found" ]] || fail "mbp/ reads no arena scope (a trace label is core/memory.h's mark_trace):" "$found"
found=$(grep -rnE '^[^/]*ArenaScope' mbp 2>/dev/null | grep -vE '^mbp/(([a-z]+_)?executor[a-z_]*|chooser|stage_runner)\.cpp:')
[[ -z "$found" ]] || fail "mbp/ makes an arena current only in the executors' and the chooser's entry points (mbp/executor*.cpp, mbp/stage_runner.cpp, mbp/chooser.cpp) and through a DryRun:" "$found"
found=$(grep -rnE '^[^/]*(DryRunGuard|make_virtual|virtual_clone)' nn optim data distributed mbp report apps examples 2>/dev/null)
[[ -z "$found" ]] || fail "dry runs and virtual arenas above core/ come from one object, DryRun (core/dry_run.h):" "$found"
found=$(grep -rnE '(->|\.)add_(option|flag)' apps 2>/dev/null | grep -v '^apps/options.cpp:' | grep -v '"--version"')
[[ -z "$found" ]] || fail "every option of train, sweep and plan is registered from the one table (apps/options.cpp):" "$found"
found=$(grep -rnE 'rfind\("(synthetic|mnist|fashion-mnist|cifar10|cifar100|folder)|\.data\.(substr|rfind|find|starts_with|compare)\(|is_synthetic\(' \
  apps data examples 2>/dev/null | grep -vE '^data/spec\.(cpp|h):')
[[ -z "$found" ]] || fail "the --data spec is read in one place, data/spec.cpp (parse_data_spec): ask the DataSpec what it names:" "$found"
found=$(grep -rn '"core/ambient.h"' nn optim data distributed mbp report apps examples 2>/dev/null)
[[ -z "$found" ]] || fail "the ambient context is core/'s: above it, use the scopes (ArenaScope, HostArenaScope, DryRun):" "$found"
found=$(grep -rnE 'dynamic_cast<[^>]*(Executor|Runner)|as_stage' apps 2>/dev/null)
[[ -z "$found" ]] || fail "a pipeline stage is a part of the executor, not a kind of it: ask Executor::stage(), never downcast:" "$found"
names_of() { grep -vE '^[[:space:]]*//' "$1" | grep -oE '\b[a-z_][a-z_0-9]*\(' | sort -u; }
found=$(comm -12 <(names_of kernels/cpu/cpu_kernels.h) <(names_of kernels/cuda/cuda_kernels.h))
[[ -z "$found" ]] || fail "a kernel declared in both backends' headers (declare it once, in kernels/backend.inc):" "$found"
# No function of apps/, mbp/, report/ or core/autograd.cpp longer than 80 lines (signature to
# closing brace, lambdas and comments included): functions at column 0, as the code is formatted.
found=$(for f in apps/*.cpp mbp/*.cpp report/*.cpp core/autograd.cpp; do
  awk -v file="$f" '
    state == 0 && /^[A-Za-z_].*\(/ && !/^(namespace|struct|class|enum|using|template|typedef|return)/ { start = NR; state = 1 }
    state == 1 && /;[[:space:]]*$/ && !/\{/ { state = 0 }
    state == 1 && /\{.*\}[[:space:]]*$/ { state = 0; next }  # a one-line function
    state == 1 && /\{[[:space:]]*$/ { state = 2; next }
    state == 2 && /^}/ { if (NR - start + 1 > 80) printf "%s:%d: %d lines\n", file, start, NR - start + 1; state = 0 }
  ' "$f"
done)
[[ -z "$found" ]] || fail "functions longer than 80 lines in apps/, mbp/, report/ or core/autograd.cpp (split them):" "$found"
[[ $status -eq 0 ]] && echo "structure: ok"
exit $status
