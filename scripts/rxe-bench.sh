#!/usr/bin/env bash
# Floors measured side by side on Linux soft-RoCE (a benchmark, not a test): two qemu VMs
# (tests/rxe/vm.sh) with rxe0 each, and the host's userspace RoCE v2 engine, on a bridge.
# Alternated in one window, ROUNDS times (default 3):
#   perftest between the VMs: ib_write_lat and ib_send_lat (8 B), ib_write_bw (4 MiB), one way
#   and both ways at once (-b: each side sends while it receives, as an all-reduce does);
#   roccl between the VMs (verbs on rxe): 8-byte all-reduce latency, 64 MiB all-reduce bus
#   bandwidth (2 ranks);
#   roccl between the host's engine and VM a's rxe: the same two figures.
# Prints each run's figures and the ratios of the medians (roccl / perftest). Absolute
# figures under TCG mean little: the ratios are the figures to report.
#
#   scripts/rxe-bench.sh [ROUNDS]      (root; about 3 minutes per round)
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
source tests/rxe/vm.sh
rxe_prepare || { echo "SKIPPED: $rxe_skip"; exit 0; }
cargo build --release --quiet --features verbs --bin roccl-perf || exit 1
target=$(scripts/target-dir)
bin=$RXE_OUT/bin
mkdir -p "$bin" && cp "$target/release/roccl-perf" "$bin/"

NS=roccl-rxe-bench
ns() { ip netns exec "$NS" "$@"; }
ip netns del "$NS" 2>/dev/null
ip netns add "$NS" || exit 1
trap 'rxe_cleanup; ip netns del "$NS" 2>/dev/null; rm -rf "$RXE_OUT"' EXIT
ns ip link set lo up
ns ip link add rxebr0 type bridge
ns ip addr add 10.99.0.1/24 dev rxebr0
ns ip link set rxebr0 up
for t in rxetapa rxetapb; do
  ns ip tuntap add "$t" mode tap && ns ip link set "$t" master rxebr0 && ns ip link set "$t" up
done

# Steps: each side runs its command of step k after all sides reached step k.
steps=()
add() { steps+=("$1|$2|$3"); } # A-command | B-command | host-command
perf="$bin/roccl-perf --op all_reduce"
rank() { # rank R of 2, root on the side given, network, then roccl-perf's arguments
  local r=$1 root=$2 net=$3 ifc=$4
  shift 4
  echo "env ROCCL_RANK=$r ROCCL_NRANKS=2 ROCCL_ROOT=$root ROCCL_NET=$net ROCCL_SOCKET_IFNAME==$ifc ROCCL_TIMEOUT=120 ${RXE_BENCH_ENV:-} $perf $*"
}
for ((r = 1; r <= rounds; r++)); do
  port=$((29700 + 10 * r))
  add "sleep 2; ib_write_lat -d rxe0 -x 1 -F -s 8 -n 2000 10.99.0.3" "ib_write_lat -d rxe0 -x 1 -F -s 8 -n 2000" ""
  add "sleep 2; ib_send_lat -d rxe0 -x 1 -F -s 8 -n 2000 10.99.0.3" "ib_send_lat -d rxe0 -x 1 -F -s 8 -n 2000" ""
  add "$(rank 0 10.99.0.2:$port verbs eth0 -b 8 -e 8 -n 2000 -w 100)" "$(rank 1 10.99.0.2:$port verbs eth0 -b 8 -e 8 -n 2000 -w 100)" ""
  add "$(rank 1 10.99.0.1:$((port + 1)) verbs eth0 -b 8 -e 8 -n 2000 -w 100)" "" "$(rank 0 10.99.0.1:$((port + 1)) rocev2 rxebr0 -b 8 -e 8 -n 2000 -w 100)"
  add "sleep 2; ib_write_bw -d rxe0 -x 1 -F -s 4194304 -n 40 10.99.0.3" "ib_write_bw -d rxe0 -x 1 -F -s 4194304 -n 40" ""
  add "sleep 2; ib_write_bw -b -d rxe0 -x 1 -F -s 4194304 -n 40 10.99.0.3" "ib_write_bw -b -d rxe0 -x 1 -F -s 4194304 -n 40" ""
  add "$(rank 0 10.99.0.2:$((port + 2)) verbs eth0 -b 64M -e 64M -n 3 -w 1 --out-of-place)" "$(rank 1 10.99.0.2:$((port + 2)) verbs eth0 -b 64M -e 64M -n 3 -w 1 --out-of-place)" ""
  add "$(rank 1 10.99.0.1:$((port + 3)) verbs eth0 -b 64M -e 64M -n 3 -w 1 --out-of-place)" "" "$(rank 0 10.99.0.1:$((port + 3)) rocev2 rxebr0 -b 64M -e 64M -n 3 -w 1 --out-of-place)"
done

side_script() { # SIDE FIELD: the side's commands, one step after another
  local side=$1 field=$2 k cmd
  echo "cd $RXE_OUT"
  for k in "${!steps[@]}"; do
    cmd=$(cut -d'|' -f"$field" <<<"${steps[$k]}")
    echo "touch $RXE_OUT/step.$k.$side; while [ \$(ls $RXE_OUT/step.$k.* | wc -l) -lt 3 ]; do sleep 0.1; done"
    [ -n "$cmd" ] && echo "echo '=== step $k'; $cmd 2>&1"
  done
}
side_script a 1 >"$RXE_OUT/bench-a.sh"
side_script b 2 >"$RXE_OUT/bench-b.sh"
side_script h 3 >"$RXE_OUT/bench-h.sh"
RXE_NETNS=$NS rxe_boot a 10.99.0.2/24 tap:rxetapa "$RXE_OUT/bench-a.sh"
RXE_NETNS=$NS rxe_boot b 10.99.0.3/24 tap:rxetapb "$RXE_OUT/bench-b.sh"
ns bash "$RXE_OUT/bench-h.sh" >"$RXE_OUT/h.log" 2>&1 &
rxe_wait a $((600 * rounds)) >/dev/null
rxe_wait b 60 >/dev/null
wait

# Figures per step, from the logs: perftest's typical latency (us) and average bandwidth
# (MB/s); roccl-perf's median time (us) and bus bandwidth (GB/s).
step_of() { awk -v k="=== step $1" '$0 == k {on = 1; next} /^=== step/ {on = 0} on' "$2"; }
lat_pt() { awk '$1 == 8 && NF >= 6 {print $5; exit}'; }    # #bytes #iter min max typical ...
bw_pt() { awk '$1 == 4194304 {print $4; exit}'; }          # #bytes #iter peak avg ...
time_rp() { awk '$1 == "all_reduce" {print $8; exit}'; }
busbw_rp() { awk '$1 == "all_reduce" {print $10; exit}'; }
declare -A fig
per=8
for ((r = 0; r < rounds; r++)); do
  b=$((per * r))
  fig[wlat]+=" $(step_of $b "$RXE_OUT/a.log" | lat_pt)"
  fig[slat]+=" $(step_of $((b + 1)) "$RXE_OUT/a.log" | lat_pt)"
  fig[rlat]+=" $(step_of $((b + 2)) "$RXE_OUT/a.log" | time_rp)"
  fig[elat]+=" $(step_of $((b + 3)) "$RXE_OUT/h.log" | time_rp)"
  fig[wbw]+=" $(step_of $((b + 4)) "$RXE_OUT/a.log" | bw_pt)"
  fig[bbw]+=" $(step_of $((b + 5)) "$RXE_OUT/a.log" | bw_pt)"
  fig[rbw]+=" $(step_of $((b + 6)) "$RXE_OUT/a.log" | busbw_rp)"
  fig[ebw]+=" $(step_of $((b + 7)) "$RXE_OUT/h.log" | busbw_rp)"
done
median() { tr ' ' '\n' | grep -E '^[0-9.]+$' | sort -g | awk '{v[NR] = $1} END {if (NR) print v[int((NR + 1) / 2)]; else print "nan"}'; }
echo "# soft-RoCE floors, $rounds rounds alternated ($(date -u +%F), host: $(nproc) cores; VMs under qemu TCG)"
printf '%-52s %-28s %s\n' "figure" "runs" "median"
show() { printf '%-52s %-28s %s\n' "$1" "${fig[$2]# }" "$(echo "${fig[$2]}" | median)"; }
show "ib_write_lat 8 B, rxe-rxe (us, typical)" wlat
show "ib_send_lat 8 B, rxe-rxe (us, typical)" slat
show "roccl all-reduce 8 B, 2 ranks, rxe-rxe (us)" rlat
show "roccl all-reduce 8 B, 2 ranks, engine-rxe (us)" elat
show "ib_write_bw 4 MiB, rxe-rxe (MB/s)" wbw
show "ib_write_bw -b 4 MiB, rxe-rxe, both ways (MB/s)" bbw
show "roccl all-reduce 64 MiB busbw, rxe-rxe (GB/s)" rbw
show "roccl all-reduce 64 MiB busbw, engine-rxe (GB/s)" ebw
m() { echo "${fig[$1]}" | median; }
awk -v wl="$(m wlat)" -v rl="$(m rlat)" -v el="$(m elat)" -v wb="$(m wbw)" -v bb="$(m bbw)" -v rb="$(m rbw)" -v eb="$(m ebw)" 'BEGIN {
  printf "ratio: roccl 8 B all-reduce / ib_write_lat:  rxe-rxe %.2f, engine-rxe %.2f (target <= 2.5)\n", rl / wl, el / wl
  # perftest reports MB/sec of 2^20 bytes; roccl-perf GB/s of 10^9.
  printf "ratio: roccl 64 MiB busbw / ib_write_bw:     rxe-rxe %.2f, engine-rxe %.2f (target >= 0.80)\n", rb * 1e9 / (wb * 1048576), eb * 1e9 / (wb * 1048576)
  # A 2-rank all-reduce moves its bus bandwidth each way at once: beside half of what
  # ib_write_bw -b reports for both ways together.
  printf "ratio: roccl 64 MiB busbw / (ib_write_bw -b / 2): rxe-rxe %.2f, engine-rxe %.2f\n", rb * 1e9 / (bb / 2 * 1048576), eb * 1e9 / (bb / 2 * 1048576)
}'
