#!/usr/bin/env bash
# Emulated hosts for multi-node tests of roccl on one machine, using network namespaces.
#
#   scripts/netns.sh up N          create hosts roccl0..roccl{N-1} (recreates them if present)
#   scripts/netns.sh down          remove every host, veth and the bridge (never fails)
#   scripts/netns.sh status        show what exists
#   scripts/netns.sh run K -- CMD  run CMD inside host K (same as: ip netns exec roccl$K CMD)
#
# Host i is the namespace "roccl$i" with interface "eth0" at 10.77.0.(i+1)/24 and "lo" up.
# The eth0s are veth pairs whose other ends ("roccl-v$i") are enslaved to the bridge
# "roccl-br" in the root namespace. The link of the last host is rate-limited with tbf
# (1gbit, burst 256kb, latency 50ms) in both directions, to exercise a slow peer.
# Use ROCCL_SOCKET_IFNAME==eth0 and ROCCL_ROOT=10.77.0.1:PORT for ranks run in the hosts.
# Needs root and iproute2 (ip, tc).
set -euo pipefail

PREFIX=roccl
BRIDGE=roccl-br
SUBNET=10.77.0
SLOW_RATE=${ROCCL_NETNS_SLOW_RATE:-1gbit}

die() {
  echo "netns.sh: error: $*" >&2
  exit 1
}

usage() {
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
  exit "${1:-2}"
}

check_tools() {
  [ "$(id -u)" -eq 0 ] || die "must run as root (network namespaces, veth and bridges need CAP_NET_ADMIN)"
  command -v ip >/dev/null || die "'ip' not found: install iproute2 (apt-get install -y iproute2)"
}

# Remove everything this script may have created; ignores what does not exist.
down() {
  local ns v
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}[0-9]+$" || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  # Deleting a namespace deletes its veth end and hence the pair; clean leftovers anyway.
  for v in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E "^${PREFIX}-v[0-9]+$" || true); do
    ip link del "$v" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
}

up() {
  local n=$1 i ns host peer tbf
  if ! [[ "$n" =~ ^[0-9]+$ ]] || [ "$n" -lt 1 ] || [ "$n" -gt 200 ]; then
    die "N must be between 1 and 200, got '$n'"
  fi
  down
  ip link add "$BRIDGE" type bridge || die "cannot create bridge $BRIDGE"
  # No STP, no forwarding delay: ports forward at once.
  ip link set "$BRIDGE" type bridge stp_state 0 forward_delay 0 2>/dev/null || true
  ip link set "$BRIDGE" up
  for ((i = 0; i < n; i++)); do
    ns="$PREFIX$i"
    host="$PREFIX-v$i"  # end in the root namespace, on the bridge
    peer="$PREFIX-p$i"  # end moved into the namespace and renamed eth0
    ip netns add "$ns"
    ip link add "$host" type veth peer name "$peer"
    ip link set "$peer" netns "$ns"
    ip -n "$ns" link set "$peer" name eth0
    ip -n "$ns" addr add "$SUBNET.$((i + 1))/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    ip link set "$host" master "$BRIDGE"
    ip link set "$host" up
  done
  tbf=""
  if [ "$n" -ge 2 ]; then
    command -v tc >/dev/null || die "'tc' not found: install iproute2"
    i=$((n - 1))
    # Egress of the bridge-side veth shapes traffic to the host; eth0 inside shapes its sends.
    tc qdisc replace dev "$PREFIX-v$i" root tbf rate "$SLOW_RATE" burst 256kb latency 50ms
    ip netns exec "$PREFIX$i" tc qdisc replace dev eth0 root tbf rate "$SLOW_RATE" burst 256kb latency 50ms
    tbf="$PREFIX$i ($SLOW_RATE tbf both ways)"
  fi
  echo "netns.sh: $n hosts on bridge $BRIDGE, subnet $SUBNET.0/24, interface eth0 in each:"
  for ((i = 0; i < n; i++)); do
    echo "  $PREFIX$i  $SUBNET.$((i + 1))"
  done
  [ -z "$tbf" ] || echo "  slow link: $tbf"
  echo "  run in a host: ip netns exec ${PREFIX}K CMD   (or: $0 run K -- CMD)"
}

status() {
  ip netns list | grep -E "^${PREFIX}[0-9]+" || echo "no $PREFIX namespaces"
  ip -br link show master "$BRIDGE" 2>/dev/null || echo "no bridge $BRIDGE"
  tc qdisc show 2>/dev/null | grep -E "tbf" || true
}

[ $# -ge 1 ] || usage
cmd=$1
shift
case "$cmd" in
  up)
    [ $# -eq 1 ] || usage
    check_tools
    up "$1"
    ;;
  down)
    check_tools
    down
    echo "netns.sh: removed ${PREFIX}* namespaces, veths and bridge $BRIDGE"
    ;;
  status)
    check_tools
    status
    ;;
  run)
    if [ $# -lt 3 ] || [ "$2" != "--" ]; then usage; fi
    check_tools
    k=$1
    shift 2
    ip netns list | awk '{print $1}' | grep -x "$PREFIX$k" >/dev/null || die "no host $PREFIX$k: run '$0 up N' first"
    exec ip netns exec "$PREFIX$k" "$@"
    ;;
  -h | --help | help) usage 0 ;;
  *) usage ;;
esac
