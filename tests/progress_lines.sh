#!/usr/bin/env bash
# progress_lines.sh TALLY MPIEXEC — under mpirun on a terminal, rank 0's progress bar prints whole
# lines: the ranks share the terminal, and a bar redrawn in place with \r ran into their lines.
set -uo pipefail
tally=$1 mpiexec=$2
out=$(script -qec "$mpiexec --oversubscribe -np 2 $tally train --data synthetic:3x16x16 --steps 3 --batch-size 32 \
  --memory-limit 64MiB --no-eval --device cpu" /dev/null 2>&1)
n=$(grep -c '^epoch 1/1 (3 of its 312 steps) \[' <<<"$out")
[[ $n -eq 3 ]] || { echo "expected 3 whole progress lines, found $n:"; cat -A <<<"$out" | tail -8; exit 1; }
echo "ok: 3 whole progress lines under mpirun on a terminal"
