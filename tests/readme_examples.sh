#!/usr/bin/env bash
# readme_examples.sh SOURCE_DIR — README's C++ examples are the compiled examples' own lines, so they
# run as written and cannot go stale: each ```cpp block whose introducing paragraph names a file
# `examples/NAME.cpp` must consist of that file's lines (each line's code without its comment and
# indentation), in the file's order; comment-only lines are free. Blocks that name no file are
# listed, and the first two (the training loop and the MBP executor) must name one.
set -uo pipefail
src=$1
readme=$src/README.md
failures=0 checked=0 block=0
named=""
in_block=0
lines=()
code() { sed -E 's#[[:space:]]*//.*$##; s#^[[:space:]]+##; s#[[:space:]]+$##' <<<"$1"; }
check_block() {
  local file=$1 at=0 n line want found
  mapfile -t have < <(while IFS= read -r l; do code "$l"; done <"$src/$file")
  n=${#have[@]}
  for line in "${lines[@]}"; do
    want=$(code "$line")
    [[ -z $want ]] && continue
    found=0
    while ((at < n)); do
      if [[ ${have[at]} == "$want" ]]; then found=1; at=$((at + 1)); break; fi
      at=$((at + 1))
    done
    if ((!found)); then
      echo "FAIL: README block $block: '$want' is not a line of $file (in order)"
      failures=$((failures + 1))
      return
    fi
  done
  echo "ok   README block $block is $file's code"
  checked=$((checked + 1))
}
while IFS= read -r l; do
  if ((in_block)); then
    if [[ $l == '```' ]]; then
      in_block=0
      block=$((block + 1))
      if [[ -n $named ]]; then
        check_block "$named"
      else
        echo "note: README block $block names no example file"
        ((block <= 2)) && { echo "FAIL: README block $block must name the example it comes from"; failures=$((failures + 1)); }
      fi
      named=""
    else
      lines+=("$l")
    fi
  elif [[ $l == '```cpp' ]]; then
    in_block=1
    lines=()
  elif [[ $l =~ \`(examples/[a-z_/]+\.cpp)\` ]]; then
    named=${BASH_REMATCH[1]}
  elif [[ -z $l ]]; then
    :  # a paragraph's end keeps its file for the block that follows
  fi
done <"$readme"
echo "readme examples: $checked blocks checked, $failures failed"
((failures == 0 && checked >= 2))
