#!/usr/bin/env bash
# Networks chosen per peer and call size (ROCCL_NETS) across network namespaces. Three hosts
# share a LAN (a bridge) whose links tbf limits to TCP_RATE (default 400 Mbit/s) each way:
# TCP runs there (ROCCL_SOCKET_IFNAME==lan), fast to start a message, slow to move many
# bytes. Hosts 0 and 1 also have a second path, a chain of HOPS routers (namespaces that
# forward; default 12), unshaped: the userspace RoCE v2 engine runs there (ROCCL_IB_HCA=rr),
# slower to start a message (every hop adds some microseconds) but far faster for many bytes.
# Host 2 has no second path and offers TCP only. The links are measured at init, and:
#   - hosts 0↔1 must carry small calls over TCP and large ones over the engine, at the
#     crossover of the measured figures; pairs with host 2 only TCP;
#   - every collective is correct ("# wrong results: 0" on rank 0, every rank exits 0), and
#     the engine's path carried the large calls' bytes;
#   - with ROCCL_CHOICE_BENCH=1, a benchmark (printed, not asserted): the 2-rank all-reduce
#     between hosts 0 and 1 at 8 B, 4 KiB, 256 KiB and 2 MiB with the choice, TCP alone and the
#     engine alone, alternated.
# A measurement takes milliseconds per network: a rank descheduled that long on a loaded
# machine can swap two figures, so the choice check allows 3 tries. Skips (exit 0) only
# when namespaces or tc are unavailable.
set -euo pipefail
cd "$(dirname "$0")/../.."

N=3
HOPS=${ROCCL_CHOICE_HOPS:-12}
TCP_RATE=${ROCCL_CHOICE_TCP_RATE:-400mbit}
ROOT=10.83.0.1:29731
PERF=$(scripts/target-dir)/release/roccl-perf
LIMIT=${ROCCL_NETNS_TEST_LIMIT:-120}
NS=(roccl-c0 roccl-c1 roccl-c2)
for ((i = 1; i <= HOPS; i++)); do NS+=("roccl-cr$i"); done

unset ROCCL_ROCEV2_FAULTS ROCCL_ROCEV2_PORT ROCCL_NET ROCCL_NETS ROCCL_ROOT ROCCL_RANK \
  ROCCL_NRANKS ROCCL_SOCKET_IFNAME ROCCL_IB_HCA ROCCL_MEASURE
# shellcheck source=tests/netns/lib.sh
. tests/netns/lib.sh
need_netns
command -v tc >/dev/null || skip "'tc' (iproute2) not installed"

cargo build --release --quiet --bin roccl-perf

netns_start
ip link del roccl-cbr 2>/dev/null || true
trap 'cleanup; ip link del roccl-cbr 2>/dev/null || true' EXIT

echo "-- 3 hosts on a LAN shaped to $TCP_RATE each way; hosts 0 and 1 also joined through $HOPS routers, unshaped"
for ns in "${NS[@]}"; do
  ip netns add "$ns"
  ip -n "$ns" link set lo up
done
ip link add roccl-cbr type bridge
ip link set roccl-cbr type bridge stp_state 0 forward_delay 0 2>/dev/null || true
ip link set roccl-cbr up
for ((k = 0; k < N; k++)); do
  ip link add "roccl-cv$k" type veth peer name "roccl-cp$k"
  ip link set "roccl-cp$k" netns "${NS[$k]}"
  ip -n "${NS[$k]}" link set "roccl-cp$k" name lan
  ip -n "${NS[$k]}" addr add "10.83.0.$((k + 1))/24" dev lan
  ip -n "${NS[$k]}" link set lan up
  ip link set "roccl-cv$k" master roccl-cbr
  ip link set "roccl-cv$k" up
  # Both directions: the host's sends, and the bridge's sends to it.
  for dev in "ip netns exec ${NS[$k]} tc qdisc replace dev lan" "tc qdisc replace dev roccl-cv$k"; do
    if ! err=$($dev root tbf rate "$TCP_RATE" burst 64kb latency 50ms 2>&1); then
      skip "tc tbf failed: $err"
    fi
  done
done
# The chain: link i joins its two ends in 10.84.i.0/24 (.1 the host-0 side, .2 the other).
prev=${NS[0]}
for ((i = 1; i <= HOPS + 1; i++)); do
  if [ "$i" -le "$HOPS" ]; then next=roccl-cr$i; else next=${NS[1]}; fi
  ip link add "roccl-ca$i" type veth peer name "roccl-cb$i"
  ip link set "roccl-ca$i" netns "$prev"
  ip link set "roccl-cb$i" netns "$next"
  a=roccl-ca$i b=roccl-cb$i
  [ "$i" -eq 1 ] && { ip -n "$prev" link set "$a" name rr; a=rr; }
  [ "$i" -eq $((HOPS + 1)) ] && { ip -n "$next" link set "$b" name rr; b=rr; }
  ip -n "$prev" addr add "10.84.$i.1/24" dev "$a"
  ip -n "$next" addr add "10.84.$i.2/24" dev "$b"
  ip -n "$prev" link set "$a" up
  ip -n "$next" link set "$b" up
  prev=$next
done
ip -n "${NS[0]}" route add 10.84.0.0/16 via 10.84.1.2
ip -n "${NS[1]}" route add 10.84.0.0/16 via "10.84.$((HOPS + 1)).1"
for ((i = 1; i <= HOPS; i++)); do
  ip netns exec "roccl-cr$i" sysctl -qw net.ipv4.ip_forward=1
  [ "$i" -lt "$HOPS" ] && ip -n "roccl-cr$i" route add "10.84.$((HOPS + 1)).0/24" via "10.84.$((i + 1)).2"
  [ "$i" -gt 1 ] && ip -n "roccl-cr$i" route add 10.84.1.0/24 via "10.84.$i.1"
done

# Bytes host 0 sent on its chain.
chain_sent() { ip netns exec "${NS[0]}" cat /sys/class/net/rr/statistics/tx_bytes; }

# run NAME RANKS NETS0 NETS1 NETS2 PERF_ARGS...: rank K on host K, offering NETS_K
# (ROCCL_NETS; "-": ROCCL_NET=tcp alone, "engine": ROCCL_NET=rocev2 alone).
run() {
  local name=$1 r=$2 k nets
  local offer=("$3" "$4" "$5")
  shift 5
  echo "-- $name: rank K on host K with ROCCL_NETS=(${offer[*]::$r}) ROCCL_SOCKET_IFNAME==lan ROCCL_IB_HCA=rr ROCCL_HOSTID=host-K ROCCL_DEBUG=INFO $PERF $*"
  pids=()
  for ((k = 0; k < r; k++)); do
    nets=(ROCCL_NETS="${offer[$k]}")
    [ "${offer[$k]}" = "-" ] && nets=(ROCCL_NET=tcp)
    [ "${offer[$k]}" = "engine" ] && nets=(ROCCL_NET=rocev2)
    ip netns exec "${NS[$k]}" env ROCCL_RANK="$k" ROCCL_NRANKS="$r" ROCCL_ROOT="$ROOT" \
      ROCCL_HOSTID="host-$k" ROCCL_TIMEOUT=60 ROCCL_SOCKET_IFNAME==lan ROCCL_IB_HCA=rr \
      ROCCL_DEBUG=INFO "${nets[@]}" \
      timeout -k 5 "$LIMIT" "$PERF" "$@" >"$tmp/$name.$k.log" 2>&1 &
    pids+=($!)
  done
  ranks_done "$name" "$r"
  echo "   ok: $(grep -c '^ ' "$tmp/$name.0.log") result rows, '# wrong results: 0', all $r ranks exited 0"
}

# Rank 0's measured line of hosts A↔B over NET: "ALPHA BETA" (µs, GB/s).
figures() {
  grep -m1 "hosts $1↔$2 (ranks [0-9]*↔[0-9]*) over $3:" "$tmp/$4.0.log" |
    sed 's/.*α=\([0-9.]*\)µs β=\([0-9.]*\)GB\/s.*/\1 \2/'
}

# Every collective, 8 B to 4 MiB; the choice must be TCP for small calls and the engine for
# large ones between hosts 0 and 1, at the crossover the measured figures give.
for attempt in 1 2 3; do
  before=$(chain_sent)
  run choice 3 tcp,rocev2 tcp,rocev2 tcp --op all -b 8 -e 1M -f 16 --iters 2 --warmup 1
  carried=$(($(chain_sent) - before))
  line=$(grep -m1 "  hosts 0↔1: " "$tmp/choice.0.log" || true)
  read -r ta tb <<<"$(figures 0 1 tcp choice)"
  read -r ea eb <<<"$(figures 0 1 rocev2 choice)"
  echo "   measured hosts 0↔1: tcp α=${ta:-?}µs β=${tb:-?}GB/s, rocev2 α=${ea:-?}µs β=${eb:-?}GB/s; choice: ${line# *}; the chain carried $((carried / 1024)) KiB"
  cross=$(awk -v ta="$ta" -v tb="$tb" -v ea="$ea" -v eb="$eb" 'BEGIN {
    d = 1 / (tb * 1e3) - 1 / (eb * 1e3)
    if (ta > 0 && ea > ta && d > 0) printf "%d", (ea - ta) / d + 1; else print "none" }')
  if [ "$cross" != none ]; then
    at=$(sed -n 's/.*tcp below \([^,]*\), rocev2 from.*/\1/p' <<<"$line")
    echo "   the figures cross at $cross bytes; the choice says ${at:-nothing}"
    if [ -n "$at" ]; then
      break
    fi
  fi
  if [ "$attempt" -eq 3 ]; then
    sed 's/^/   | /' "$tmp/choice.0.log" | grep -v '^   |  '
    echo "FAILED: choice (the engine's path must start slower and carry more: tcp below a size, rocev2 from it)"
    exit 1
  fi
  echo "   (attempt $attempt: the measured figures do not cross; again)"
done
# The size said is the crossover of the printed figures (rounded as printed: within 10 %).
said=$(sed -n 's/.*tcp below \([0-9.]*\) \([KMG]*i*B\).*/\1 \2/p' <<<"$line")
awk -v s="$said" -v c="$cross" 'BEGIN {
  split(s, p, " "); m = (p[2] == "KiB") ? 1024 : (p[2] == "MiB") ? 1048576 : (p[2] == "GiB") ? 1073741824 : 1
  b = p[1] * m; if (b < 0.9 * c - 1024 || b > 1.1 * c + 1024) exit 1 }' ||
  { echo "FAILED: choice: the crossover said ($said) is not the one the figures give ($cross bytes)"; exit 1; }
# Host 2 offers TCP only: no other network measured toward it, no choice.
if grep -q "hosts [0-9]↔2 (ranks [0-9]*↔[0-9]*) over rocev2" "$tmp/choice.0.log" ||
  grep -q "  hosts [0-9]↔2: " "$tmp/choice.0.log"; then
  echo "FAILED: choice: host 2 offers only TCP, yet another network was measured or chosen toward it"
  exit 1
fi
grep -q "hosts 0↔2 (ranks 0↔2) over tcp" "$tmp/choice.0.log" ||
  { echo "FAILED: choice: the TCP link to host 2 was not measured"; exit 1; }
# Calls of 1 MiB between hosts 0 and 1 (every collective, 3 times each) went through the chain.
if [ "$carried" -lt $((4 << 20)) ]; then
  echo "FAILED: choice: the engine's path carried only $carried bytes: large calls did not take it"
  exit 1
fi
echo "   ok: small calls over tcp, large over rocev2 between hosts 0 and 1, tcp alone toward host 2"

# A benchmark (ROCCL_CHOICE_BENCH=1; not part of the test command's run): 2 ranks (hosts 0 and
# 1), the choice against each network alone, alternated.
if [ -z "${ROCCL_CHOICE_BENCH:-}" ]; then
  echo "-- networks chosen per peer and size across namespaces: passed (ROCCL_CHOICE_BENCH=1 adds the benchmark)"
  exit 0
fi
bench=(--op all_reduce -b 8 -e 2M -f 8 --iters 20 --warmup 3)
for round in 1 2; do
  run "bench-choice-$round" 2 tcp,rocev2 tcp,rocev2 - "${bench[@]}"
  run "bench-tcp-$round" 2 - - - "${bench[@]}"
  run "bench-engine-$round" 2 engine engine - "${bench[@]}"
done
echo "   2-rank all-reduce between hosts 0 and 1, out-of-place µs (round 1 / round 2):"
printf '   %10s %18s %18s %18s\n' bytes choice "tcp alone" "rocev2 alone"
for size in 8 4096 262144 2097152; do
  cell() { awk -v s="$size" '$2 == s { printf "%s", $8; exit }' "$tmp/bench-$1-1.0.log"; printf ' / '
    awk -v s="$size" '$2 == s { printf "%s", $8; exit }' "$tmp/bench-$1-2.0.log"; }
  printf '   %10s %18s %18s %18s\n' "$size" "$(cell choice)" "$(cell tcp)" "$(cell engine)"
done
echo "-- networks chosen per peer and size across namespaces: passed"
