#!/usr/bin/env bash
# roccl on a switchless mesh, as Strix Halo owners cable USB4/Thunderbolt ports (docs/USB4.md):
# 3 network namespaces joined pairwise by veth pairs, each pair its own /24 and no bridge, so
# a host reaches a peer only over the link they share. Each host also has one address of its
# own (10.80.0.K/32 on lo) and a route to each peer's through their link (`src` its own): roccl
# publishes that address, and every peer is reached over the cable that leads to it.
# Checks: every collective over tcp and over rocev2 (the userspace RoCE v2 engine) with
# "# wrong results: 0" on rank 0 and every rank exiting 0; every link carrying traffic both
# ways; the 8-byte all-reduce as the model chooses (one exchange over every link at once)
# against the ring over the same links. Skips (exit 0) only when namespaces are unavailable.
set -euo pipefail
cd "$(dirname "$0")/../.."

N=3
ROOT=10.80.0.1:29700
PERF=$(scripts/target-dir)/release/roccl-perf
LIMIT=${ROCCL_NETNS_TEST_LIMIT:-120}
NS=(roccl-m0 roccl-m1 roccl-m2)
IFNAME=

unset ROCCL_ROCEV2_FAULTS ROCCL_ROCEV2_PORT ROCCL_NET ROCCL_ROOT ROCCL_RANK ROCCL_NRANKS ROCCL_SOCKET_IFNAME
# shellcheck source=tests/netns/lib.sh
. tests/netns/lib.sh
need_netns

cargo build --release --quiet --bin roccl-perf

netns_start

# The link between hosts a < b: veth "to$b" in a and "to$a" in b, subnet 10.81.L.0/24 (a .1,
# b .2), L numbering the pairs 1, 2, 3.
echo "-- a mesh of $N hosts: a veth pair per pair of hosts, each its own subnet, no bridge"
for ((k = 0; k < N; k++)); do
  ip netns add "${NS[$k]}"
  ip -n "${NS[$k]}" link set lo up
  ip -n "${NS[$k]}" addr add "10.80.0.$((k + 1))/32" dev lo
done
link=0
declare -A addr
for ((a = 0; a < N; a++)); do
  for ((b = a + 1; b < N; b++)); do
    link=$((link + 1))
    ip link add "rm$a$b" type veth peer name "rm$b$a"
    ip link set "rm$a$b" netns "${NS[$a]}"
    ip link set "rm$b$a" netns "${NS[$b]}"
    ip -n "${NS[$a]}" link set "rm$a$b" name "to$b"
    ip -n "${NS[$b]}" link set "rm$b$a" name "to$a"
    ip -n "${NS[$a]}" addr add "10.81.$link.1/24" dev "to$b"
    ip -n "${NS[$b]}" addr add "10.81.$link.2/24" dev "to$a"
    ip -n "${NS[$a]}" link set "to$b" up
    ip -n "${NS[$b]}" link set "to$a" up
    addr[$a,$b]=10.81.$link.1
    addr[$b,$a]=10.81.$link.2
  done
done
# Each host's own address is reached over the link to it, and a host sends from its own.
for ((a = 0; a < N; a++)); do
  for ((b = 0; b < N; b++)); do
    [ "$a" -eq "$b" ] && continue
    ip -n "${NS[$a]}" route add "10.80.0.$((b + 1))/32" via "${addr[$b,$a]}" dev "to$b" src "10.80.0.$((a + 1))"
  done
done
# No path but the shared link: host 0 cannot reach the link between 1 and 2.
if ip netns exec "${NS[0]}" ping -c1 -W1 "${addr[1,2]}" >/dev/null 2>&1; then
  echo "FAILED: host 0 reaches the 1-2 link: not a switchless mesh"
  exit 1
fi

# Bytes each host sent on each of its links.
sent() {
  local a b
  for ((a = 0; a < N; a++)); do
    for ((b = 0; b < N; b++)); do
      [ "$a" -eq "$b" ] && continue
      printf '%s,%s=%s ' "$a" "$b" "$(ip netns exec "${NS[$a]}" cat "/sys/class/net/to$b/statistics/tx_bytes")"
    done
  done
}

# run NAME PERF_ARGS...: rank K on host K.
run() {
  local name=$1 k
  shift
  echo "-- $name: for K in 0..$((N - 1)): ip netns exec roccl-mK env ROCCL_RANK=K ROCCL_NRANKS=$N" \
    "ROCCL_ROOT=$ROOT ROCCL_HOSTID=roccl-mK ROCCL_TIMEOUT=60${IFNAME:+ ROCCL_SOCKET_IFNAME=$IFNAME} $PERF $*"
  pids=()
  for ((k = 0; k < N; k++)); do
    ip netns exec "${NS[$k]}" env ROCCL_RANK="$k" ROCCL_NRANKS="$N" ROCCL_ROOT="$ROOT" \
      ROCCL_HOSTID="${NS[$k]}" ROCCL_TIMEOUT=60 ${IFNAME:+ROCCL_SOCKET_IFNAME=$IFNAME} \
      timeout -k 5 "$LIMIT" "$PERF" "$@" >"$tmp/$name.$k.log" 2>&1 &
    pids+=($!)
  done
  ranks_done "$name" "$N"
  echo "   rank 0: $(grep -m1 '^# roccl-perf:' "$tmp/$name.0.log" | sed 's/^# roccl-perf: //')"
  echo "   ok: $(grep -c '^ ' "$tmp/$name.0.log") result rows, '# wrong results: 0', all $N ranks exited 0"
}

common=(--op all -b 8 -e 256K -f 64 --iters 2 --warmup 1)
# run_checked NAME PERF_ARGS...: run, then every link, both ways, carried the job's traffic
# (more than 64 KiB each).
run_checked() {
  local name=$1 before after pair key was now
  before=$(sent)
  run "$@"
  after=$(sent)
  for pair in $after; do
    key=${pair%%=*}
    was=$(tr ' ' '\n' <<<"$before" | grep "^$key=" | cut -d= -f2)
    now=${pair#*=}
    if [ $((now - was)) -lt 65536 ]; then
      echo "FAILED: $name: host ${key%,*} sent $((now - was)) bytes to host ${key#*,} over their link"
      exit 1
    fi
  done
  echo "   every link carried traffic both ways: $(for pair in $after; do
    key=${pair%%=*}; was=$(tr ' ' '\n' <<<"$before" | grep "^$key=" | cut -d= -f2)
    printf '%s→%s %s KiB, ' "${key%,*}" "${key#*,}" $(((${pair#*=} - was) / 1024)); done)"
}
for net in tcp rocev2; do
  run_checked "mesh-$net" "${common[@]}" --net "$net"
done

# The 8-byte all-reduce: the model's choice (one exchange over all links at once) against the
# ring over the same links, alternated; rank 0's out-of-place time.
small=(--op all_reduce -b 8 -e 8 --iters 200 --warmup 20 --net rocev2)
t_of() { grep '^ ' "$tmp/$1.0.log" | awk '{ print $7, $8; exit }'; }
for round in 1 2; do
  run "small-auto-$round" "${small[@]}"
  run "small-ring-$round" "${small[@]}" --algo ring
done
echo "   8 B all-reduce over rocev2, µs (algorithm, time): model $(t_of small-auto-1), $(t_of small-auto-2); ring $(t_of small-ring-1), $(t_of small-ring-2)"

# The same mesh as it comes up: only the cables' addresses, no address of a host's own and no
# route beyond each cable's subnet. With the cables named (ROCCL_SOCKET_IFNAME), each rank
# publishes every address of theirs and reaches a peer at the one on a subnet they share;
# the root is named by its address on each cable.
echo "-- the mesh without own addresses or routes: each cable's subnet only"
for ((a = 0; a < N; a++)); do
  for ((b = 0; b < N; b++)); do
    [ "$a" -eq "$b" ] && continue
    ip -n "${NS[$a]}" route del "10.80.0.$((b + 1))/32"
  done
  ip -n "${NS[$a]}" addr del "10.80.0.$((a + 1))/32" dev lo
done
if ip netns exec "${NS[2]}" ping -c1 -W1 "${addr[0,1]}" >/dev/null 2>&1; then
  echo "FAILED: host 2 reaches host 0's cable to host 1: routes are left"
  exit 1
fi
ROOT="${addr[0,1]},${addr[0,2]}:29701"
# The cables are the interfaces to use ("to1", "to2", ...): naming them publishes all of them.
IFNAME=to
for net in tcp rocev2; do
  run_checked "subnets-$net" "${common[@]}" --net "$net"
done
echo "-- the switchless mesh passed"
