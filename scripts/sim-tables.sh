#!/usr/bin/env bash
# The simulated cluster tables of docs/PERFORMANCE-LOG.md: roccl-sim (every rank a thread, the
# link model's virtual time, every result checked) with the cost model's choice, for 2 to
# 1024 ranks, 1 and 8 ranks per host (8: a NIC per rank, as on rail-optimised clusters),
# 100 and 400 Gbit/s NICs (2 µs between hosts, 0.5 µs and 200 Gbit/s per rank inside one,
# 0.5 µs of software per message at each end). Prints one markdown row per case.
# Usage: scripts/sim-tables.sh [ranks...]   (default: 2 8 64 256 1024)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --bin roccl-sim
sim="$(scripts/target-dir)/release/roccl-sim"
ranks=("${@:-2 8 64 256 1024}")
echo "| NIC | ranks/host | ranks | size | algorithm | time (µs) | busbw (GB/s) |"
echo "|---|---|---|---|---|---|---|"
for gbps in 100 400; do
  for per in 1 8; do
    for n in ${ranks[*]}; do
      spec="ranks_per_host=$per,nics=$per,nic_gbps=$gbps,nic_us=2,local_gbps=200,local_us=0.5,msg_us=0.5"
      for sizes in "-b 8 -e 8" "-b 64K -e 1M -f 16"; do
        # shellcheck disable=SC2086
        "$sim" --ranks "$n" --sim "$spec" --op all_reduce --algo auto $sizes -n 1 -w 1 |
          awk -v g="$gbps" -v p="$per" -v n="$n" '
            $1 == "all_reduce" { printf "| %s G | %s | %s | %s | %s | %s | %s |\n", g, p, n, $2, $3, $4, $7 }
            /wrong element/ && $4 != "0" { print "wrong results: " $0 > "/dev/stderr"; exit 1 }'
      done
    done
  done
done
