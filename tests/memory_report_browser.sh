#!/usr/bin/env bash
# tests/memory_report_browser.sh TALLY [MPIEXEC] — the memory report (report/memory_html.h) in a real
# browser: headless Chromium loads the pages from file:// and the test reads the DOM it leaves.
#   plan   `tally plan --report` of ResNet-20, batch 256 in 24 MiB (20 micro-batches, every one
#          traced): the page's peak, computed by its script from the allocations, equals the
#          arena's count and the plan's prediction to the byte; the peak's two breakdowns sum to
#          it; the micro-batches traced are the plan's; "#select=layer2.0.conv1" (what a click
#          does) fills the details with that module's first allocation; no script error, on the
#          page or on the console.
#   run    `tally train --out`'s memory.html of a measured step: the same checks of the peak.
#   stages with MPIEXEC: two pipeline stages under mpirun -np 2; each stage's page (memory.html,
#          memory-stage1.html) with its own exact peak.
# A missing browser is a failure, not a skip: `make test` installs Debian's chromium.
set -u
tally=$1 mpiexec=${2:-}
work=$(mktemp -d "${TMPDIR:-/tmp}/tally-report.XXXXXX")
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
browser=$(command -v chromium || command -v chromium-browser || true)
[[ -n $browser ]] || { echo "FAIL: no chromium on PATH (make test installs Debian's chromium package)"; exit 1; }

# dom FILE.html [FRAGMENT] — the DOM after the page's scripts ran, into FILE.dom; the console into FILE.console.
dom() {
  local page=$1 fragment=${2:-}
  HOME=$work timeout 120 "$browser" --headless --no-sandbox --disable-gpu --no-first-run --enable-logging=stderr --v=0 \
    --virtual-time-budget=5000 --dump-dom "file://$page$fragment" >"$page.dom" 2>"$page.console"
}
value() { grep -o "id=\"$2\"[^>]*>[^<]*" "$1.dom" | head -1 | sed 's/.*>//'; }

check_peak() {  # PAGE WHAT [EXPECTED_PEAK]
  local page=$1 what=$2 expected=${3:-}
  grep -q 'data-ready="yes"' "$page.dom" || fail "$what: the page's script did not finish"
  [[ -z $(value "$page" errors) ]] || fail "$what: script errors on the page: $(value "$page" errors)"
  if grep -E 'CONSOLE.*(Uncaught|Error)' "$page.console" >/dev/null; then
    fail "$what: errors on the console: $(grep -E 'CONSOLE' "$page.console" | head -3)"
  fi
  local peak trace
  peak=$(value "$page" peak-bytes) trace=$(value "$page" trace-peak)
  [[ -n $peak && $peak -gt 0 ]] || fail "$what: no peak on the page"
  [[ $peak == "$trace" ]] || fail "$what: the page's peak $peak differs from the arena's count $trace"
  [[ -z $expected || $peak == "$expected" ]] || fail "$what: the page's peak $peak differs from $expected"
  local sums
  sums=$(grep -o 'data-sum="[0-9]*"' "$page.dom" | sed 's/[^0-9]//g' | sort -u | tr '\n' ' ')
  [[ $sums == "$peak " ]] || fail "$what: the peak's breakdowns sum to $sums, not $peak"
  echo "ok: $what: peak $peak bytes on the page, the arena's count and its breakdowns agree"
}

# The plan's page.
out=$("$tally" plan --model resnet20 --input 3x32x32 --batch-size 256 --memory-limit 24MiB --report "$work/plan.html" 2>&1) \
  || { echo "$out"; fail "tally plan --report failed"; exit 1; }
micro_batches=$(sed -n 's/^plan: batch 256 = \([0-9]*\) micro-batches.*/\1/p' <<<"$out")
dom "$work/plan.html" "#select=layer2.0.conv1"
plan_peak=$(value "$work/plan.html" predicted-peak)
check_peak "$work/plan.html" "plan" "$plan_peak"
traced=$(grep -o 'data-count="[0-9]*"' "$work/plan.html.dom" | sed 's/[^0-9]//g')
[[ -n $micro_batches && $traced == "$micro_batches" ]] \
  || fail "plan: the page traced ${traced:-no} micro-batches, the plan has ${micro_batches:-?}"
grep -q "module    layer2.0.conv1" "$work/plan.html.dom" || fail "plan: #select=layer2.0.conv1 named no allocation of it"
grep -q 'data-selected="[0-9]' "$work/plan.html.dom" || fail "plan: nothing was selected"
grep -q 'kept per sample</dt><dd>' "$work/plan.html.dom" || fail "plan: the per-layer table's columns are not explained"
echo "ok: plan: $micro_batches micro-batches traced; layer2.0.conv1's band named; the table's columns explained"

# A run's page.
run=$work/run
"$tally" train --model resnet20 --data synthetic:3x16x16 --steps 2 --batch-size 64 --memory-limit 24MiB --no-progress \
  --no-eval --out "$run" >"$run.log" 2>&1 || { tail -5 "$run.log"; fail "tally train failed"; exit 1; }
[[ -f $run/memory.html ]] || fail "run: no memory.html in the run folder"
dom "$run/memory.html"
check_peak "$run/memory.html" "run" "$(value "$run/memory.html" predicted-peak)"

# A pipeline's stages, each its own page.
if [[ -n $mpiexec ]]; then
  stages=$work/stages
  "$mpiexec" --oversubscribe -np 2 "$tally" train --pipeline-stages 2 --steps 2 --batch-size 32 --memory-limit 48MiB \
    --no-progress --no-eval --out "$stages" >"$stages.log" 2>&1 || { tail -5 "$stages.log"; fail "the pipeline run failed"; }
  for page in memory.html memory-stage1.html; do
    [[ -f $stages/$page ]] || { fail "stages: no $page"; continue; }
    dom "$stages/$page"
    check_peak "$stages/$page" "stages: $page" "$(value "$stages/$page" predicted-peak)"
  done
fi

((failures == 0)) && echo "memory report: all ok" || exit 1
