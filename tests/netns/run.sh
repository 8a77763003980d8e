#!/usr/bin/env bash
# roccl across emulated hosts: 3 network namespaces on a bridge (scripts/netns.sh, one link
# slowed by tbf), one roccl-perf rank in each, joined from the environment (ROCCL_RANK,
# ROCCL_NRANKS, ROCCL_ROOT). Runs every collective over RoCE v2 plainly, over RoCE v2 with
# the fault injector, and over TCP; then hosts of several ranks (2 + 2 + 2 and 3 + 1 + 2,
# each namespace its own ROCCL_HOSTID: shared memory inside, the network between) with the
# hierarchical algorithms forced and as the model chooses, and the hierarchical all-reduce
# against the flat ring across the slowed link. Each run must exit 0 on every rank and rank 0
# must report "# wrong results: 0". Skips (exit 0) only when network namespaces are
# unavailable.
set -euo pipefail
cd "$(dirname "$0")/../.."

N=3
ROOT=10.77.0.1:29600
PERF=$(scripts/target-dir)/release/roccl-perf
LIMIT=${ROCCL_NETNS_TEST_LIMIT:-120}  # seconds before a rank is killed (ROCCL_TIMEOUT is 60)
FAULTS="drop=0.01,dup=0.01,reorder=0.01,corrupt=0.01,seed=3"

skip() {
  echo "SKIPPED: network namespaces unavailable: $*"
  exit 0
}

# Each run sets what it needs; nothing leaks in from the caller's environment.
unset ROCCL_ROCEV2_FAULTS ROCCL_ROCEV2_PORT ROCCL_NET ROCCL_ROOT ROCCL_RANK ROCCL_NRANKS

# Can this machine create a namespace and a veth pair? Anything else failing later is an error.
[ "$(id -u)" -eq 0 ] || skip "not root (needs CAP_NET_ADMIN)"
command -v ip >/dev/null || skip "'ip' (iproute2) not installed"
probe=roccl-probe$$
if ! err=$(ip netns add "$probe" 2>&1); then
  skip "ip netns add failed: $err"
fi
if ! err=$(ip -n "$probe" link add roccl-pa type veth peer name roccl-pb 2>&1); then
  ip netns del "$probe" 2>/dev/null || true
  skip "veth in a namespace failed: $err"
fi
ip netns del "$probe"

echo "-- build roccl-perf"
cargo build --release --quiet --bin roccl-perf

tmp=$(mktemp -d)
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  scripts/netns.sh down >/dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT

echo "-- scripts/netns.sh up $N"
scripts/netns.sh up "$N"

# The namespace of each rank (PLACE=(0 0 1 1 2 2): two ranks on each host); each rank's
# ROCCL_HOSTID is its namespace (they share the machine's hostname and boot id).
PLACE=(0 1 2)

# run NAME EXTRA_ENV... -- PERF_ARGS...: rank K in namespace PLACE[K], all at once.
run() {
  local name=$1 extra=() args=() k rc fail=0 t0 ms n=${#PLACE[@]}
  shift
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do extra+=("$1"); shift; done
  shift
  args=("$@")
  echo "-- $name"
  echo "   for K in 0..$((n - 1)): ip netns exec roccl\${PLACE[K]} env ROCCL_RANK=K ROCCL_NRANKS=$n" \
    "ROCCL_HOSTID=roccl\${PLACE[K]} ROCCL_ROOT=$ROOT ROCCL_SOCKET_IFNAME==eth0 ROCCL_TIMEOUT=60" \
    "${extra[*]} $PERF ${args[*]}   (PLACE=${PLACE[*]})"
  t0=$(date +%s%N)
  pids=()
  for ((k = 0; k < n; k++)); do
    ip netns exec "roccl${PLACE[$k]}" env ROCCL_RANK="$k" ROCCL_NRANKS="$n" ROCCL_ROOT="$ROOT" \
      ROCCL_HOSTID="roccl${PLACE[$k]}" ROCCL_SOCKET_IFNAME==eth0 ROCCL_TIMEOUT=60 "${extra[@]}" \
      timeout -k 5 "$LIMIT" "$PERF" "${args[@]}" >"$tmp/$name.$k.log" 2>&1 &
    pids+=($!)
  done
  for ((k = 0; k < n; k++)); do
    rc=0
    wait "${pids[$k]}" || rc=$?
    if [ "$rc" -ne 0 ]; then
      echo "   rank $k exited with $rc$([ "$rc" -eq 124 ] && echo " (killed after ${LIMIT}s)")"
      fail=1
    fi
  done
  pids=()
  if ! grep -qx "# wrong results: 0" "$tmp/$name.0.log"; then
    echo "   rank 0 did not report '# wrong results: 0'"
    fail=1
  fi
  if [ "$fail" -ne 0 ]; then
    for ((k = 0; k < n; k++)); do
      echo "   ---- rank $k output ($name)"
      sed 's/^/   | /' "$tmp/$name.$k.log"
    done
    echo "FAILED: $name"
    exit 1
  fi
  ms=$((($(date +%s%N) - t0) / 1000000))
  echo "   rank 0: $(grep -m1 '^# roccl-perf:' "$tmp/$name.0.log" | sed 's/^# roccl-perf: //')"
  echo "   ok: $(grep -c '^ ' "$tmp/$name.0.log") result rows, '# wrong results: 0', all $n ranks exited 0, $((ms / 1000)).$(printf %03d $((ms % 1000)))s"
}

# The result rows of run NAME's rank 0 (op, size, ..., algo, time out of place, ...).
rows() { grep '^ ' "$tmp/$1.0.log"; }

common=(--op all -b 8 -e 256K -f 64 --iters 2 --warmup 1)
run rocev2 -- "${common[@]}" --net rocev2
run rocev2-faults ROCCL_ROCEV2_FAULTS="$FAULTS" -- "${common[@]}" --net rocev2
run tcp -- "${common[@]}" --net tcp
# A link down for longer than ROCCL_TIMEOUT: the rank whose link it is says that its own
# network failed; the others name that rank, and none blames a survivor or says "exited".
flap() {
  local name=flap victim=1 k rc fail=0 line other
  echo "-- $name: rank $victim's link down for 4 s during rocev2 all-reduces, ROCCL_TIMEOUT=2"
  pids=()
  for ((k = 0; k < N; k++)); do
    ip netns exec "roccl$k" env ROCCL_RANK="$k" ROCCL_NRANKS="$N" ROCCL_ROOT="$ROOT" \
      ROCCL_SOCKET_IFNAME==eth0 ROCCL_TIMEOUT=2 \
      timeout -k 5 "$LIMIT" "$PERF" --net rocev2 -b 8 -e 1M -f 4 --iters 100000 --warmup 1 \
      >"$tmp/$name.$k.log" 2>&1 &
    pids+=($!)
  done
  # Down once the job runs (rank 0 printed a result row).
  for _ in $(seq 200); do
    grep -q '^ ' "$tmp/$name.0.log" 2>/dev/null && break
    sleep 0.1
  done
  ip -n "roccl$victim" link set eth0 down
  sleep 4
  ip -n "roccl$victim" link set eth0 up
  for ((k = 0; k < N; k++)); do
    rc=0
    wait "${pids[$k]}" || rc=$?
    line=$(grep -m1 'roccl-perf: error' "$tmp/$name.$k.log" || true)
    if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || [ -z "$line" ]; then
      echo "   rank $k exited with $rc, error: ${line:-none}"
      fail=1
    elif [ "$k" -eq "$victim" ]; then
      if ! grep -q "this rank's network failed" <<<"$line"; then
        echo "   rank $k (link down) does not say that its own network failed: $line"
        fail=1
      fi
    else
      other=$((N - victim - k))
      if ! grep -q "rank $victim\b" <<<"$line" || grep -q "exited or aborted" <<<"$line" ||
        grep -q "remote error: rank $other\b" <<<"$line"; then
        echo "   rank $k does not name rank $victim as unreachable: $line"
        fail=1
      fi
    fi
  done
  pids=()
  if [ "$fail" -ne 0 ]; then
    for ((k = 0; k < N; k++)); do
      echo "   ---- rank $k output ($name)"
      sed 's/^/   | /' "$tmp/$name.$k.log"
    done
    echo "FAILED: $name"
    exit 1
  fi
  for ((k = 0; k < N; k++)); do
    echo "   rank $k: $(grep -m1 'roccl-perf: error' "$tmp/$name.$k.log" | cut -c1-200)"
  done
}
flap

# Hosts of several ranks: shared memory inside each namespace, the network between them.
hier_ops=all_reduce,broadcast,reduce,all_gather,reduce_scatter
PLACE=(0 0 1 1 2 2)
run hosts-rocev2-hier -- --op "$hier_ops" -b 8 -e 1M -f 32 --iters 2 --warmup 1 --net rocev2 --algo hier
run hosts-tcp-hier -- --op "$hier_ops" -b 8 -e 1M -f 32 --iters 2 --warmup 1 --net tcp --algo hier
run hosts-tcp-auto -- "${common[@]}" --net tcp
# Every forced row ran by host (the algorithm column).
if rows hosts-tcp-hier | awk '$7 != "hier" { bad = 1 } END { exit !bad }'; then
  echo "   a row of hosts-tcp-hier did not run by host:"; rows hosts-tcp-hier | sed 's/^/   | /'
  echo "FAILED: hosts-tcp-hier"; exit 1
fi
echo "   the model chose: $(rows hosts-tcp-auto | awk '$1 == "all_reduce" { printf "%s %s, ", $2, $7 }')"
# Uneven hosts: 3 + 1 + 2.
PLACE=(0 0 0 1 2 2)
run uneven-tcp-hier -- --op "$hier_ops" -b 8 -e 1M -f 32 --iters 2 --warmup 1 --net tcp --algo hier
# Uneven too: every forced row by host (all-gather and reduce-scatter through the leaders).
if rows uneven-tcp-hier | awk '$7 != "hier" { bad = 1 } END { exit !bad }'; then
  echo "   a row of uneven-tcp-hier did not run by host:"; rows uneven-tcp-hier | sed 's/^/   | /'
  echo "FAILED: uneven-tcp-hier"; exit 1
fi
run uneven-rocev2-auto -- "${common[@]}" --net rocev2
# Across the slowed link (host 2, 1 Gbit/s): by host against the host-ordered flat ring.
PLACE=(0 0 1 1 2 2)
big=(--op all_reduce -b 4M -e 4M --iters 5 --warmup 2 --net tcp)
run slow-ring -- "${big[@]}" --algo ring
run slow-hier -- "${big[@]}" --algo hier
run slow-ring2 -- "${big[@]}" --algo ring
run slow-hier2 -- "${big[@]}" --algo hier
t_of() { rows "$1" | awk '{ print $8; exit }'; }
echo "   4 MiB all-reduce over the 1 Gbit/s link, 2+2+2 ranks: ring $(t_of slow-ring) and $(t_of slow-ring2) us, by host $(t_of slow-hier) and $(t_of slow-hier2) us"

# The links measured at init (ROCCL_MEASURE, one rank per host): both pairs through the
# slowed link measure slower than the pair that avoids it, and the cost model takes the
# slowest (rank 0's INFO lines).
# A measurement is a few milliseconds per pair: on a loaded machine a rank descheduled for
# that long can make the fast pair look slow, so up to 3 jobs may try (each says its figures).
PLACE=(0 1 2)
beta() { grep -m1 "hosts $1↔$2 " "$tmp/measured.0.log" | sed 's/.*β=\([0-9.]*\)GB\/s.*/\1/'; }
for attempt in 1 2 3; do
  run measured ROCCL_DEBUG=INFO -- --op all_reduce -b 8 -e 8 --iters 2 --warmup 1 --net tcp
  b01=$(beta 0 1) b02=$(beta 0 2) b12=$(beta 1 2)
  model=$(grep -m1 "links measured at init" "$tmp/measured.0.log" | sed 's/.*takes α=[0-9.]*µs β=\([0-9.]*\)GB\/s.*/\1/')
  echo "   measured: hosts 0↔1 ${b01:-?} GB/s, 0↔2 ${b02:-?}, 1↔2 ${b12:-?} (host 2 behind tbf); the model takes ${model:-?}"
  if awk -v a="$b01" -v b="$b02" -v c="$b12" -v m="$model" \
    'BEGIN { exit !(a > 0 && b > 0 && c > 0 && b < a && c < a && m > 0 && m <= b && m <= c) }'; then
    break
  fi
  if [ "$attempt" -eq 3 ]; then
    sed 's/^/   | /' "$tmp/measured.0.log"
    echo "FAILED: measured (the slowed link must measure slower, and the model take the slowest)"
    exit 1
  fi
  echo "   (attempt $attempt: the fast pair did not measure faster; again)"
done

echo "-- all runs across network namespaces passed"
