#!/usr/bin/env bash
# doc_outputs.sh TALLY SOURCE_DIR — every command output shown in README.md and docs/*.md is what
# `tally` prints now: each shown command is run and its output compared, so the docs cannot go
# stale silently (as rustdoc and doctest do for examples).
#
# The fenced blocks (``` or ~~~, indented or not) of those files are sorted into:
# - checked: the block's first line begins with "$ ". Each "$ " line is a command (a line ending
#   in "\" continues on the next), the lines after it up to the next "$ " line its expected
#   output: its stdout, then its stderr (where tally's errors go, after what it printed). The
#   command runs in bash (pipes allowed, with pipefail) in a fresh temporary folder (holding
#   tests/fixtures/devices/, the GPUs' description files, as the source tree does), with `tally`
#   the TALLY given; it must exit 0 unless its output shows a "tally: error:" line, then non-zero.
#   Comparison is line by line and exact, but for two elisions, kept for what varies by run or
#   machine (timings, rates measured at start-up):
#     a line that is only "..." (indentation aside) stands for any number of lines, none included;
#     "…" (U+2026) inside a line stands for any text within that line.
#   A line with "…" that could hold a value of the plan is a hole in the check: keep "…" for time.
# - not checked, with its reason: the line just before the fence is <!-- not checked: REASON -->,
#   REASON saying why (a measured run, a GPU or several processes needed, not an output at all);
# - commands only (no output shown): every line a command, a comment or a continuation;
# - code: cpp and cmake blocks (README's C++ is tests/readme_examples.sh's).
# Any other block is a failure: an output with no command, or a block that is not marked.
#
# The environment is cli.plan_golden's, so that an output holds on every processor: the reference
# convolution path (TALLY_CPU_CONV=reference: im2col + GEMM, workspaces of tally's own, and `auto`
# memory format then contiguous), 2 OpenMP threads, and a machine's usable memory fixed at 64 GiB
# (TALLY_TEST_HOST_MEMORY), so no "a plan for another machine?" warning depends on this one. Rates
# that a plan would measure at start-up are given in the commands (--copy-bandwidth, --compute-rate).
# Commands that train are kept to a step or two of small synthetic data: the whole check takes
# seconds on 2 cores. It prints each block it checked or skipped, with its file and line.
set -uo pipefail
tally=${1:?usage: doc_outputs.sh TALLY SOURCE_DIR}
src=${2:?usage: doc_outputs.sh TALLY SOURCE_DIR}
tally=$(cd "$(dirname "$tally")" && pwd)/$(basename "$tally")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin"
ln -s "$tally" "$tmp/bin/tally"
export PATH=$tmp/bin:$PATH TALLY_CPU_CONV=reference OMP_NUM_THREADS=2 OMP_WAIT_POLICY=passive
export TALLY_TEST_HOST_MEMORY=$((64 << 30))

failures=0 checked=0 commands=0 skipped=0 listed=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }

# glob_of LINE: the line as a bash pattern, "…" matching any text and everything else itself.
glob_of() {
  local l=$1 out="" part
  while [[ $l == *…* ]]; do
    part=${l%%…*}
    out+=$(printf '%q' "$part")'*'
    l=${l#*…}
  done
  out+=$(printf '%q' "$l")
  printf '%s' "$out"
}
is_elision() { [[ $1 =~ ^[[:space:]]*\.\.\.[[:space:]]*$ ]]; }

# matches EXPECTED_FILE ACTUAL_FILE: 0 when the actual lines match the expected ones; else prints
# the first expected line that found no match.
matches() {
  local -a want have
  mapfile -t want <"$1"
  mapfile -t have <"$2"
  local i=0 j=0 nw=${#want[@]} nh=${#have[@]} pat skip=0
  while ((i < nw)); do
    if is_elision "${want[i]}"; then skip=1; i=$((i + 1)); continue; fi
    pat=$(glob_of "${want[i]}")
    while ((j < nh)); do
      # shellcheck disable=SC2053  # the right side is a pattern on purpose
      if eval "[[ \${have[j]} == $pat ]]"; then break; fi
      if ((!skip)); then
        echo "    expected: ${want[i]}"
        echo "    found:    ${have[j]}"
        return 1
      fi
      j=$((j + 1))
    done
    if ((j >= nh)); then echo "    expected: ${want[i]}"; echo "    found:    (end of output)"; return 1; fi
    skip=0 i=$((i + 1)) j=$((j + 1))
  done
  if ((!skip && j < nh)); then echo "    expected: (end of output)"; echo "    found:    ${have[j]}"; return 1; fi
  return 0
}

# run_checked WHERE: the block's lines are in the array `block`.
run_checked() {
  local where=$1 cmd="" cont=0 n=0 l
  local -a cmds=() outs=()
  local exp=""
  for l in "${block[@]}"; do
    if ((cont)); then
      cmd+=$'\n'$l
      [[ $l == *\\ ]] || { cont=0; }
      continue
    fi
    if [[ $l == '$ '* ]]; then
      ((n > 0)) && { cmds+=("$cmd"); outs+=("$exp"); }
      cmd=${l#'$ '} exp="" n=$((n + 1))
      [[ $l == *\\ ]] && cont=1
    else
      exp+=$l$'\n'
    fi
  done
  cmds+=("$cmd"); outs+=("$exp")
  local k rc want_fail shown ok=1
  for k in "${!cmds[@]}"; do
    rm -rf "$tmp/work" && mkdir -p "$tmp/work/tests/fixtures"
    ln -s "$src/tests/fixtures/devices" "$tmp/work/tests/fixtures/devices"  # the GPUs' files, as in the tree
    printf '%s' "${outs[k]}" >"$tmp/expected"
    (cd "$tmp/work" && bash -o pipefail -c "${cmds[k]}") >"$tmp/actual" 2>"$tmp/stderr"
    rc=$?
    cat "$tmp/stderr" >>"$tmp/actual"
    want_fail=0
    grep -q '^tally: error:' "$tmp/expected" && want_fail=1
    if ((want_fail && rc == 0)) || ((!want_fail && rc != 0)); then
      shown=success
      ((want_fail)) && shown="an error"
      fail "$where: \$ ${cmds[k]%%$'\n'*} exited with status $rc; the doc shows $shown"
      sed 's/^/    | /' "$tmp/actual" | head -20
      ok=0
      continue
    fi
    if ! matches "$tmp/expected" "$tmp/actual" >"$tmp/why"; then
      fail "$where: the output of \$ ${cmds[k]%%$'\n'*} is not the one shown:"
      cat "$tmp/why"
      echo "    the whole output:"
      sed 's/^/    | /' "$tmp/actual"
      ok=0
    fi
  done
  ((ok)) && echo "ok   $where: ${#cmds[@]} command(s), output as shown"
  checked=$((checked + 1))
}

is_command_line() {
  local l=${1#"${1%%[![:space:]]*}"}
  [[ -z $l || $l == '#'* || $l =~ ^(tally|mpirun|make|cmake|ctest|cd)([[:space:]]|$) ||
     $l =~ ^(scripts|build[^/]*)/ || $l =~ ^[A-Z_]+=[^[:space:]]*[[:space:]] ]]
}

classify() {  # WHERE LANG MARKER
  local where=$1 lang=$2 marker=$3 l cont=0 all=1
  case $lang in
    cpp | c++ | cmake) return ;;
  esac
  if ((${#block[@]} > 0)) && [[ ${block[0]} == '$ '* ]]; then run_checked "$where"; return; fi
  if [[ -n $marker ]]; then
    echo "not checked $where: $marker"
    skipped=$((skipped + 1))
    return
  fi
  for l in "${block[@]}"; do
    if ((cont)) || is_command_line "$l"; then
      [[ $l == *\\ ]] && cont=1 || cont=0
    else
      all=0
    fi
  done
  if ((all)); then
    echo "commands  $where (no output shown)"
    commands=$((commands + 1))
  else
    fail "$where: a block with no \"\$ \" command line and no <!-- not checked: REASON --> before it"
  fi
}

for md in "$src/README.md" "$src"/docs/*.md; do
  name=${md#"$src"/}
  in=0 fence="" lang="" start=0 prev="" marker="" n=0
  block=()
  while IFS= read -r line; do
    n=$((n + 1))
    if ((in)); then
      if [[ $line =~ ^[[:space:]]*(\`\`\`+|~~~+)[[:space:]]*$ && ${BASH_REMATCH[1]} == "$fence" ]]; then
        in=0
        classify "$name:$start" "$lang" "$marker"
        listed=$((listed + 1))
      else
        block+=("${line#"$indent"}")
      fi
    elif [[ $line =~ ^([[:space:]]*)(\`\`\`+|~~~+)[[:space:]]*([A-Za-z+-]*)[[:space:]]*$ ]]; then
      in=1 indent=${BASH_REMATCH[1]} fence=${BASH_REMATCH[2]} lang=${BASH_REMATCH[3]} start=$n block=()
      marker=""
      marker_re='^[[:space:]]*<!--[[:space:]]*not checked:[[:space:]]*(.*[^[:space:]])[[:space:]]*-->[[:space:]]*$'
      if [[ $prev =~ $marker_re ]]; then
        marker=${BASH_REMATCH[1]}
      elif [[ $prev == *'not checked'* ]]; then
        fail "$name:$n: a marker before this block that does not read <!-- not checked: REASON -->"
      fi
    fi
    prev=$line
  done <"$md"
  ((in)) && fail "$name:$start: a fence that is never closed"
done

echo "doc outputs: $listed blocks; $checked checked, $commands commands only, $skipped not checked" \
     "(each with its reason), $failures failed"
((failures == 0 && checked > 0))
