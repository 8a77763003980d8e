#!/usr/bin/env bash
# Compare algorithms on this machine, interleaved so that slow and fast phases of a shared
# machine hit every algorithm alike: for each size, ROUNDS rounds, each running every algorithm
# once (roccl-perf with --algo). Prints per size the median over rounds of each algorithm's
# time (µs) and which is fastest; used to fit the cost model (docs/PERFORMANCE-LOG.md).
#   scripts/algo-sweep.sh ROUNDS "ALGO ALGO ..." "SIZE SIZE ..." roccl-perf-args...
#   e.g. scripts/algo-sweep.sh 3 "shm1 shm2 doubling ring" "4K 256K 4M" --op all_reduce --ranks 2 --iters 50
set -euo pipefail
rounds=$1 algos=$2 sizes=$3
shift 3
cd "$(dirname "$0")/.."
target=$(scripts/target-dir)
cargo build --release --quiet --bin roccl-perf
printf "%10s" bytes
for a in $algos; do printf "%12s" "$a"; done
printf "%10s\n" best
for s in $sizes; do
  declare -A t=()
  for _ in $(seq "$rounds"); do
    for a in $algos; do
      v=$($target/release/roccl-perf "$@" -b "$s" -e "$s" --algo "$a" 2>/dev/null |
        awk '$1 !~ /^#/ && NF >= 10 {print ($8 == "-" ? $12 : $8); exit}')
      t[$a]="${t[$a]:-} ${v:-nan}"
    done
  done
  printf "%10s" "$s"
  best="" bv=""
  for a in $algos; do
    m=$(echo "${t[$a]}" | tr ' ' '\n' | grep -v '^$' | sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}')
    printf "%12s" "$m"
    if [ -z "$bv" ] || awk -v a="$m" -v b="$bv" 'BEGIN {exit !(a < b)}'; then best=$a bv=$m; fi
  done
  printf "%10s\n" "$best"
  unset t
done
