# Shared by the namespace tests (sourced): the checks that skip when namespaces are not
# available, and the tear-down of the namespaces in NS, the ranks in pids and the directory
# tmp on exit.

skip() {
  echo "SKIPPED: network namespaces unavailable: $*"
  exit 0
}

# Skip unless root with iproute2 and a namespace can be made.
need_netns() {
  local probe=roccl-probe$$ err
  [ "$(id -u)" -eq 0 ] || skip "not root (needs CAP_NET_ADMIN)"
  command -v ip >/dev/null || skip "'ip' (iproute2) not installed"
  if ! err=$(ip netns add "$probe" 2>&1); then
    skip "ip netns add failed: $err"
  fi
  ip netns del "$probe"
}

down() {
  local ns
  for ns in "${NS[@]}"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
}

cleanup() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  down
  rm -rf "$tmp"
}

# A scratch directory in tmp, no ranks yet, the tear-down on exit, and no namespaces of an
# earlier run left.
netns_start() {
  tmp=$(mktemp -d)
  pids=()
  trap cleanup EXIT
  down
}

# ranks_done NAME N: wait for the N ranks of run NAME (pids; logs $tmp/NAME.K.log); unless
# every rank exited 0 and rank 0 reported "# wrong results: 0", print every rank's log and
# exit 1.
ranks_done() {
  local name=$1 n=$2 k rc fail=0
  for ((k = 0; k < n; k++)); do
    rc=0
    wait "${pids[$k]}" || rc=$?
    [ "$rc" -eq 0 ] || { echo "   rank $k exited with $rc$([ "$rc" -eq 124 ] && echo " (killed by its time limit)")"; fail=1; }
  done
  pids=()
  grep -qx "# wrong results: 0" "$tmp/$name.0.log" || { echo "   rank 0 did not report '# wrong results: 0'"; fail=1; }
  if [ "$fail" -ne 0 ]; then
    for ((k = 0; k < n; k++)); do
      echo "   ---- rank $k output ($name)"
      sed 's/^/   | /' "$tmp/$name.$k.log"
    done
    echo "FAILED: $name"
    exit 1
  fi
}
