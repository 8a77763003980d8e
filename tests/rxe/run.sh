#!/usr/bin/env bash
# The NIC suite on a real kernel RDMA stack: Linux soft-RoCE (rdma_rxe) in a qemu VM
# (tests/rxe/vm.sh). Builds roccl with the `verbs` feature on the host, boots one VM and runs
# in it, over ROCCL_NET=verbs on rxe0: tests/verbs.rs's hardware tests (every collective ×
# algorithm on 2, 3 and 4 ranks, also with the registration cache, without inline sends and
# with short retry settings), roccl-perf over every collective as processes, roccl-info, the C
# ABI programs and the NCCL/RCCL net plugin harness. Then tests/rxe/cross.sh: two VMs and
# the host on a bridge, jobs across them (the userspace engine and rxe in one job; two VMs
# as two hosts).
#
# First run: fetches the Debian kernel package (~70 MB) and qemu; then about 9 minutes (3.5 in
# one VM, 5.5 across machines; 10 with a core busy).
# ROCCL_SKIP_RXE=1 skips it; without root or qemu it prints SKIPPED and why.
#
# Env: FEATURES (cargo features for the test binaries; scripts/test.sh passes its own so
# nothing is built twice), RXE_TIMEOUT (seconds the VM may run, default 900).
set -uo pipefail
cd "$(dirname "$0")/../.."

if [ -n "${ROCCL_SKIP_RXE:-}" ]; then
  echo "SKIPPED (soft-RoCE VM): ROCCL_SKIP_RXE is set"
  exit 0
fi
source tests/rxe/vm.sh
if ! rxe_prepare; then
  echo "SKIPPED (soft-RoCE VM): $rxe_skip"
  exit 0
fi
# The logs stay when something failed, for a look.
trap 'rxe_cleanup; if [ "${rc:-1}" = 0 ]; then rm -rf "$RXE_OUT"; else echo "-- logs kept in $RXE_OUT"; fi' EXIT
features=${FEATURES:-roccl/verbs}

# The build, copied into $RXE_OUT so that later steps of the test command may rebuild
# target/ without verbs while the VM runs.
echo "-- building with --features $features: the tests, roccl-perf, roccl-info, the C ABI and the plugin"
set -e
target=$(scripts/target-dir)
verbs_test=$(cargo test --release --workspace --features "$features" --test verbs --no-run --message-format json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*verbs-[^"]*\)".*/\1/p' | tail -1)
cargo build --release --quiet --features "$features" --bin roccl-perf --bin roccl-info --example rdma_pair
# The same features as the tests, so that the core is not built a second time.
cargo build --release --quiet -p roccl -p roccl-capi -p roccl-netplugin --features "$features" --lib
bin=$RXE_OUT/bin
mkdir -p "$bin/lib"
cp "$verbs_test" "$bin/verbs-tests"
cp "$target/release/roccl-perf" "$target/release/roccl-info" "$target/release/examples/rdma_pair" "$bin/"
cp "$target/release/libroccl.so" "$bin/lib/libroccl.so.0"
ln -sf libroccl.so.0 "$bin/lib/libroccl.so"
cp "$target/release/libnccl_net_roccl.so" "$bin/lib/libnccl-net-roccl.so"
cflags=(-std=c11 -Wall -Wextra -Werror -O1 -Iinclude)
gcc "${cflags[@]}" tests/c/test_collectives.c -o "$bin/test_collectives" -L"$bin/lib" -lroccl -lpthread -lm -Wl,-rpath,"$bin/lib"
gcc "${cflags[@]}" tests/c/test_initall.c -o "$bin/test_initall" -L"$bin/lib" -lroccl -lm -Wl,-rpath,"$bin/lib"
gcc -std=c11 -Wall -Wextra -Werror -O1 tests/plugin/harness.c -o "$bin/harness" -ldl
set +e

cat >"$RXE_OUT/suite.sh" <<EOF
set -u
# The guest's /tmp is its own: a checkout under /tmp is not there, so nothing runs from it.
cd "$RXE_OUT"
bin="$bin"
EOF
cat >>"$RXE_OUT/suite.sh" <<'EOF'
export ROCCL_SOCKET_IFNAME=lo ROCCL_TIMEOUT=60 ROCCL_TEST_IB_DEVICE=rxe0
fails=0
step() {
  local what=$1 t=$SECONDS; shift
  echo "-- $what"
  if "$@" >"$RXE_OUT/step.log" 2>&1; then
    echo "   ok ($((SECONDS - t)) s)"
  else
    echo "   FAILED ($((SECONDS - t)) s): $*"; tail -40 "$RXE_OUT/step.log"; fails=$((fails + 1))
  fi
}
# roccl-perf over every collective, checked; passes when no result is wrong.
perf() {
  "$bin/roccl-perf" --net verbs --op all --check "$@" | tee "$RXE_OUT/perf.txt" | tail -4
  grep -q "# wrong results: 0" "$RXE_OUT/perf.txt"
}
rdma link show
step "roccl-info: rxe0 chosen, its RoCE v2 GID, rdma-core's version" sh -c \
  '"$0/roccl-info" | tee "$1/info.txt" && grep -q "rxe0" "$1/info.txt" && ! grep -q "unknown version" "$1/info.txt"' "$bin" "$RXE_OUT"
step "tests/verbs.rs: every collective x algorithm, 2, 3 and 4 ranks" "$bin/verbs-tests" --ignored --test-threads 1
step "tests/verbs.rs with the registration cache (ROCCL_IB_REG_CACHE=1)" env ROCCL_IB_REG_CACHE=1 "$bin/verbs-tests" --ignored --test-threads 1 verbs_3_ranks_pipelined
step "tests/verbs.rs without inline sends (ROCCL_IB_INLINE=0)" env ROCCL_IB_INLINE=0 "$bin/verbs-tests" --ignored --test-threads 1 verbs_2_ranks
step "tests/verbs.rs with short retries (ROCCL_IB_TIMEOUT=12 ROCCL_IB_RETRY_CNT=2)" env ROCCL_IB_TIMEOUT=12 ROCCL_IB_RETRY_CNT=2 "$bin/verbs-tests" --ignored --test-threads 1 verbs_2_ranks
step "roccl-perf: every collective, 2 ranks as processes, 8 B - 4 MiB, checked" perf --ranks 2 -b 8 -e 4M -n 3 -w 1
step "roccl-perf: every collective, 4 ranks, 8 B - 1 MiB, checked" perf --ranks 4 -b 8 -e 1M -n 2 -w 1
step "C ABI programs over verbs" sh -c 'ROCCL_NET=verbs "$0/test_collectives" && ROCCL_NET=verbs "$0/test_initall"' "$bin"
step "NCCL net plugin harness over verbs (every exported version)" env ROCCL_NET=verbs LD_LIBRARY_PATH="$bin/lib" "$bin/harness" libnccl-net-roccl.so
echo "-- $fails step(s) failed"
exit $fails
EOF

echo "-- booting the soft-RoCE VM (qemu TCG; about 8 s) and running the suite in it"
start=$SECONDS
rxe_boot rxe1 10.99.0.2/24 user "$RXE_OUT/suite.sh"
rxe_wait rxe1 "${RXE_TIMEOUT:-900}"
rc=$?
echo "-- soft-RoCE VM suite: exit $rc after $((SECONDS - start)) s"

echo "-- across machines: two VMs and the host (the userspace engine) on a bridge of the test's own"
export bin RXE_OUT
tests/rxe/cross.sh || rc=1
exit $rc
