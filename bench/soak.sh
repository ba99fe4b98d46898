#!/usr/bin/env bash
# bench/soak.sh — `make train`'s recipe for many epochs, watched: the process's resident memory,
# the arena's measured peak and the step time, per epoch. Flat lines say nothing grows with the
# run (no leak in the loader, the autograd graph, the plan cache, the metrics, the checkpoints).
# Usage: bench/soak.sh [EPOCHS (20)] [OUT_DIR (soak-<time>)] [TALLY (build/apps/tally)]
# Writes OUT/soak.csv (epoch, seconds since the start, resident MiB at the epoch's end and at its
# most, arena peak bytes, mean step seconds, train loss) and prints it; the run folder is OUT/run.
set -euo pipefail
epochs=${1:-20}
out=${2:-soak-$(date +%Y%m%d-%H%M%S)}
tally=${3:-build/apps/tally}
mkdir -p "$out"
start=$(date +%s.%N)
"$tally" train --model resnet20 --data fashion-mnist --epochs "$epochs" --batch-size 512 --memory-limit 32MiB \
  --lr 0.4 --warmup-epochs 0.5 --schedule cosine --no-progress --out "$out/run" >"$out/train.log" 2>&1 &
pid=$!
# Resident memory every 2 s, with the time.
: >"$out/rss.txt"
while kill -0 "$pid" 2>/dev/null; do
  rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)
  [[ -n "$rss" ]] && echo "$(date +%s.%N) $rss" >>"$out/rss.txt"
  grep -c '^epoch .*train loss' "$out/train.log" >"$out/epochs_done.txt" 2>/dev/null || true
  echo "$(date +%s.%N) $(cat "$out/epochs_done.txt")" >>"$out/epoch_times.txt"
  sleep 2
done
wait "$pid"
# Per epoch: the samples taken while it ran; the steps of metrics.csv with its epoch number.
awk -v start="$start" '
  FNR == 1 { file++ }
  file == 1 { t_epoch[NR] = $1; done[NR] = $2; n = NR; next }            # time, epochs finished
  file == 2 { rss_t[FNR] = $1; rss[FNR] = $2; m = FNR; next }           # time, VmRSS kB
  file == 3 && FNR > 1 { split($0, f, ","); e = f[2] + 1; steps[e]++; secs[e] += 512 / f[5];
                         if (f[6] > peak[e]) peak[e] = f[6]; last_e = e }
  END {
    # The epoch running at each RSS sample: the number finished at the nearest earlier epoch probe.
    j = 1
    for (i = 1; i <= m; i++) {
      while (j < n && t_epoch[j + 1] <= rss_t[i]) j++
      e = done[j] + 1
      if (rss[i] > most[e]) most[e] = rss[i]
      at_end[e] = rss[i]; t_end[e] = rss_t[i]
    }
    print "epoch,seconds,rss_mib_end,rss_mib_max,arena_peak_bytes,step_seconds_mean"
    for (e = 1; e <= last_e; e++)
      printf "%d,%.0f,%.1f,%.1f,%d,%.3f\n", e, t_end[e] - start, at_end[e] / 1024, most[e] / 1024, peak[e], secs[e] / steps[e]
  }' "$out/epoch_times.txt" "$out/rss.txt" "$out/run/metrics.csv" >"$out/soak.csv"
grep '^epoch .*train loss' "$out/train.log" | sed 's/^/  /'
column -s, -t "$out/soak.csv"
