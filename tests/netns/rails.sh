#!/usr/bin/env bash
# roccl over several NICs: 2 network namespaces ("hosts") joined by 2 veth pairs, each pair its
# own subnet (rail 0: 10.82.0.0/24 on "r0", rail 1: 10.82.1.0/24 on "r1"), each direction of
# each rail limited by tbf to RATE (default 300 Mbit/s). Rank K runs in host K with
# ROCCL_IB_HCA=r0,r1: the userspace RoCE v2 engine runs on each rail's address, channels take
# the rails in turn, and ROCCL_IB_QPS_PER_CONNECTION=2 gives each connection two queue pairs.
# Checks: every collective over rocev2 with "# wrong results: 0" on rank 0 and every rank
# exiting 0, at 1 rank per host and at 2 (by host: local rank i starts on rail i); both rails
# carrying the job's traffic both ways each time. Then prints the 8 MiB all-reduce on one
# rail (ROCCL_IB_HCA=r0) against both, alternated (a benchmark, not asserted). Skips (exit 0) only when namespaces or tc are unavailable.
set -euo pipefail
cd "$(dirname "$0")/../.."

N=2
ROOT=10.82.0.1:29702
PERF=$(scripts/target-dir)/release/roccl-perf
LIMIT=${ROCCL_NETNS_TEST_LIMIT:-120}
RATE=${ROCCL_RAILS_RATE:-300mbit}
NS=(roccl-r0 roccl-r1)

unset ROCCL_ROCEV2_FAULTS ROCCL_ROCEV2_PORT ROCCL_NET ROCCL_ROOT ROCCL_RANK ROCCL_NRANKS \
  ROCCL_SOCKET_IFNAME ROCCL_IB_HCA ROCCL_IB_QPS_PER_CONNECTION
# shellcheck source=tests/netns/lib.sh
. tests/netns/lib.sh
need_netns
command -v tc >/dev/null || skip "'tc' (iproute2) not installed"

cargo build --release --quiet --bin roccl-perf

netns_start

echo "-- 2 hosts, 2 rails: a veth pair per rail, each its own subnet, each direction at $RATE"
for ((k = 0; k < N; k++)); do
  ip netns add "${NS[$k]}"
  ip -n "${NS[$k]}" link set lo up
done
for rail in 0 1; do
  ip link add "rr$rail-0" type veth peer name "rr$rail-1"
  for ((k = 0; k < N; k++)); do
    ip link set "rr$rail-$k" netns "${NS[$k]}"
    ip -n "${NS[$k]}" link set "rr$rail-$k" name "r$rail"
    ip -n "${NS[$k]}" addr add "10.82.$rail.$((k + 1))/24" dev "r$rail"
    ip -n "${NS[$k]}" link set "r$rail" up
    if ! err=$(ip netns exec "${NS[$k]}" tc qdisc replace dev "r$rail" root tbf rate "$RATE" \
      burst 256kb latency 50ms 2>&1); then
      skip "tc tbf failed: $err"
    fi
  done
done

# Bytes each host sent on each rail.
sent() {
  local k rail
  for ((k = 0; k < N; k++)); do
    for rail in 0 1; do
      printf '%s,%s=%s ' "$k" "$rail" "$(ip netns exec "${NS[$k]}" cat "/sys/class/net/r$rail/statistics/tx_bytes")"
    done
  done
}

# run NAME HCA QPS PERF_ARGS...: P (default 1) ranks per host, rank K on host K / P.
run() {
  local name=$1 hca=$2 qps=$3 p=${P:-1} k
  local r=$((N * p))
  shift 3
  echo "-- $name: for K in 0..$((r - 1)): ip netns exec roccl-r\$((K / $p)) env ROCCL_RANK=K ROCCL_NRANKS=$r" \
    "ROCCL_ROOT=$ROOT ROCCL_HOSTID=roccl-r\$((K / $p)) ROCCL_TIMEOUT=60 ROCCL_IB_HCA=$hca ROCCL_IB_QPS_PER_CONNECTION=$qps${NCH:+ ROCCL_NCHANNELS=$NCH} $PERF $*"
  pids=()
  for ((k = 0; k < r; k++)); do
    ip netns exec "${NS[$((k / p))]}" env ROCCL_RANK="$k" ROCCL_NRANKS="$r" ROCCL_ROOT="$ROOT" \
      ROCCL_HOSTID="${NS[$((k / p))]}" ROCCL_TIMEOUT=60 ROCCL_IB_HCA="$hca" \
      ROCCL_IB_QPS_PER_CONNECTION="$qps" ROCCL_NCHANNELS="${NCH:-}" \
      timeout -k 5 "$LIMIT" "$PERF" "$@" >"$tmp/$name.$k.log" 2>&1 &
    pids+=($!)
  done
  ranks_done "$name" "$r"
  echo "   ok: $(grep -c '^ ' "$tmp/$name.0.log") result rows, '# wrong results: 0', all $r ranks exited 0"
}

# rails_carried NAME BEFORE: both rails carried at least MIN bytes each way since BEFORE.
rails_carried() {
  local name=$1 before=$2 min=$3 after pair key was now
  after=$(sent)
  for pair in $after; do
    key=${pair%%=*}
    was=$(tr ' ' '\n' <<<"$before" | grep "^$key=" | cut -d= -f2)
    now=${pair#*=}
    if [ $((now - was)) -lt "$min" ]; then
      echo "FAILED: $name: host ${key%,*} sent only $((now - was)) bytes on rail ${key#*,}"
      exit 1
    fi
  done
  echo "   both rails carried traffic both ways: $(for pair in $after; do
    key=${pair%%=*}; was=$(tr ' ' '\n' <<<"$before" | grep "^$key=" | cut -d= -f2)
    printf 'host %s rail %s %s KiB, ' "${key%,*}" "${key#*,}" $(((${pair#*=} - was) / 1024)); done)"
}

# Every collective, both rails, two queue pairs per connection; two channels from the
# smallest size (the model takes one per NIC from 1 MiB on), so every size crosses both.
before=$(sent)
NCH=2 run all-rails r0,r1 2 --op all -b 8 -e 4M -f 16 --iters 2 --warmup 1 --net rocev2
rails_carried all-rails "$before" 1048576

# Two ranks per host, by host (shared memory inside each host, the ranks of one local index
# across hosts): local rank i starts on rail i, so the two exchanges between hosts take one
# rail each; every collective.
before=$(sent)
P=2 run by-host r0,r1 1 --op all -b 8 -e 4M -f 16 --iters 2 --warmup 1 --net rocev2 --algo hier
rails_carried by-host "$before" 1048576

# The 8 MiB all-reduce (the model's choice) on one rail and on both, alternated; rank 0's
# out-of-place time and bus bandwidth. Then the same by host, 2 ranks per host.
big=(--op all_reduce -b 8M -e 8M --iters 3 --warmup 1 --net rocev2)
t_of() { grep '^ ' "$tmp/$1.0.log" | awk '{ print $7 " " $8 " us (busbw " $10 " GB/s)"; exit }'; }
for round in 1 2; do
  run "one-rail-$round" r0 1 "${big[@]}"
  run "two-rails-$round" r0,r1 1 "${big[@]}"
done
for round in 1 2; do
  P=2 run "hier-one-rail-$round" r0 1 "${big[@]}" --algo hier
  P=2 run "hier-two-rails-$round" r0,r1 1 "${big[@]}" --algo hier
done
echo "   8 MiB all-reduce at $RATE per rail, 1 rank per host: one rail $(t_of one-rail-1); $(t_of one-rail-2)." \
  "Two rails $(t_of two-rails-1); $(t_of two-rails-2)"
echo "   2 ranks per host, by host: one rail $(t_of hier-one-rail-1); $(t_of hier-one-rail-2)." \
  "Two rails $(t_of hier-two-rails-1); $(t_of hier-two-rails-2)"
echo "-- several NICs passed"
