#!/usr/bin/env bash
# Soft-RoCE across machines (run by tests/rxe/run.sh, which builds $bin and exports it):
# two VMs ("a", "b", each its own rxe0) and the host ("h", the userspace RoCE v2 engine)
# joined by a bridge in a network namespace of the test's own. Every job's ranks run on the
# machines its placement names; every result is checked (tests/rxe/jobs.sh):
# - the engine and rxe in one job ("one protocol, two providers"): every collective from
#   8 B, all-reduce to 64 MiB, with the engine's fault injector on, and 2 ranks per machine;
# - two VMs as two hosts over rxe: 1 and 2 ranks per VM (by-host collectives across NICs).
set -uo pipefail
source "$(dirname "$0")/vm.sh"
source "$(dirname "$0")/jobs.sh"
: "${bin:?run by tests/rxe/run.sh}"
rxe_prepare || { echo "SKIPPED (soft-RoCE across machines): $rxe_skip"; exit 0; }

NS=roccl-rxe
ns() { ip netns exec "$NS" "$@"; }
ip netns del "$NS" 2>/dev/null
ip netns add "$NS" || { echo "SKIPPED (soft-RoCE across machines): cannot make a network namespace"; exit 0; }
trap 'kill ${watcher:-} 2>/dev/null; rxe_cleanup; ip netns del "$NS" 2>/dev/null' EXIT
ns ip link set lo up
ns ip link add rxebr0 type bridge
ns ip addr add 10.99.0.1/24 dev rxebr0
ns ip addr add 10.99.0.11/24 dev rxebr0
ns ip link set rxebr0 up
for t in rxetapa rxetapb; do
  ns ip tuntap add "$t" mode tap
  ns ip link set "$t" master rxebr0
  ns ip link set "$t" up
done

all="--op all --check"
faults="ROCCL_ROCEV2_FAULTS=drop=0.01,dup=0.01,reorder=0.01,corrupt=0.01,seed=7"
# Verb by verb, the engine and rxe each as requester and responder: SENDs across the path
# MTU, RDMA WRITE WITH IMM, multi-packet RDMA READ responses, RNR NAKs (examples/rdma_pair.rs).
rxe_job pair-engine-rxe "h a" "" @rdma_pair
rxe_job pair-rxe-engine "a h" "" @rdma_pair
rxe_job pair-rxe-rxe "a b" "" @rdma_pair
rxe_job engine-rxe "h a" "" $all -b 8 -e 1M -n 2 -w 1
rxe_job rxe-engine "a h" "" --op all_reduce,all_to_all --check -b 8 -e 1M -n 2 -w 1
# At INFO, so that the engine's queue pairs are dumped every 5 s. This job hung now and then
# on a loaded machine (rxe's requester stopped mid-write, every packet it had sent received
# by the engine): the verbs provider kicks a QP whose sends make no progress, ringing its
# doorbell (src/rdma/ibv/kick.rs). Kicks every 100 ms here, so that they go out all through
# every 64 MiB write (3-4 s under TCG): the job checks some write was kicked 10 times in a
# row (1 s without a completion) and that they did no harm, against the engine as responder.
rxe_job engine-rxe-64M "h a" "ROCCL_DEBUG=INFO ROCCL_IB_KICK_MS=100" $all -b 64M -e 64M -n 1 -w 0 --out-of-place
rxe_expect_log "rxe0: QP 0x[0-9a-f]+: [0-9]+ send\(s\) outstanding.*kick 10 \("
# rxe itself can stop for good mid-message on a loaded host (docs/ROCE.md, "The rxe stall"):
# a run that stalls so is reported with the VM's kernel view, and the job runs once more.
rxe_again_if_stalled
rxe_job engine-rxe-faults "h a" "$faults" $all -b 8 -e 256K -n 2 -w 1
rxe_job engine-rxe-2x2 "h h a a" "" $all -b 8 -e 256K -n 2 -w 1
# An engine a NIC cannot reach (not on UDP port 4791) is refused at setup, naming the port.
rxe_job engine-off-port "h a" "ROCCL_ROCEV2_PORT=4792 ROCCL_TIMEOUT=20" --op all_reduce --check -b 8 -e 8 -n 1 -w 0
rxe_fault h "true" "only to (UDP )?port 4791"
# Kicks (src/rdma/ibv/kick.rs) every 20 ms without progress, so that they go out behind the
# larger messages here, rxe the responder: checked to happen and to do no harm.
rxe_job rxe-rxe "a b" "ROCCL_DEBUG=INFO ROCCL_IB_KICK_MS=20" $all -b 8 -e 1M -n 2 -w 1
rxe_expect_log "rxe0: QP 0x[0-9a-f]+: [0-9]+ send\(s\) outstanding.*kick 1 \("
rxe_job rxe-rxe-2x2 "a a b b" "" $all -b 8 -e 256K -n 2 -w 1
rxe_job three-machines "h a b" "" --op all_reduce,all_gather,broadcast --check -b 8 -e 1M -n 2 -w 1

# Faults a NIC sees, while a job runs (about 10 s of all-reduces; the fault 3 s in).
long="--op all_reduce --check -b 8 -e 256K -n 10 -w 1 -N 4"
rxe_job flap-link "a b" "" $long
rxe_fault h "sleep 3; ip link set rxetapb down; sleep 1; ip link set rxetapb up" ok
# rxe fails a queue pair whose packet the kernel cannot hand to the link (LOC_QP_OP_ERR) where
# a NIC retries: its own port's flap is survived when no such send falls in it (sends wait
# for the link), else reported naming the cause — also when the port is down as a rank starts
# (under TCG a rank's init can outlast the 3 s before the flap; or the rank starts while eth0
# is down: ROCCL_SOCKET_IFNAME==eth0 then says it is down, or the port goes down between the
# rank's choice of rxe0 and its opening it: "rxe0 port 1 is DOWN (not ACTIVE)", seen on a
# loaded machine).
rxe_job flap-port "a b" "" $long
rxe_fault b "sleep 3; ip link set eth0 down; sleep 1; ip link set eth0 up" "ok-or:lost its link|could not send a packet|port [0-9]+ is DOWN|eth0 exists but is down"
rxe_job flap-engine-link "h a" "" $long
rxe_fault h "sleep 3; ip link set rxetapa down; sleep 1; ip link set rxetapa up" ok
# A fault that cannot be survived is reported within ROCCL_TIMEOUT (20 s here), naming rank
# and cause.
rxe_job readdress "a b" "ROCCL_TIMEOUT=20" $long
rxe_fault b "sysctl -qw net.ipv4.conf.eth0.promote_secondaries=1; sleep 3; ip addr add 10.99.0.13/24 dev eth0; ip addr del 10.99.0.3/24 dev eth0" "rank 1"
# VM b is at 10.99.0.13 now, its RoCE v2 GID at another index: a new job must find it.
rxe_job after-readdress "a b" "" --op all_reduce --check -b 8 -e 64K -n 2 -w 1
rxe_job peer-killed "a b" "ROCCL_TIMEOUT=20" $long
rxe_fault h "sleep 3; kill -9 \$(cat $RXE_OUT/b.pid)" "rank 1"

rxe_side_script a >"$RXE_OUT/side-a.sh"
rxe_side_script b >"$RXE_OUT/side-b.sh"
rxe_side_script h >"$RXE_OUT/side-h.sh"
start=$SECONDS
RXE_NETNS=$NS rxe_boot a 10.99.0.2/24 tap:rxetapa "$RXE_OUT/side-a.sh"
RXE_NETNS=$NS rxe_boot b 10.99.0.3/24 tap:rxetapb "$RXE_OUT/side-b.sh"
ns bash "$RXE_OUT/side-h.sh" >"$RXE_OUT/side-h.log" 2>&1 &
host=$!
# A VM whose kernel crashes is marked at once: the other machines skip its jobs, not wait.
rxe_watch a b &
watcher=$!
limit=${RXE_TIMEOUT:-1500}
rc=0
rxe_wait a "$limit" >/dev/null || rc=$?
# VM b is killed by the last fault when it runs.
rxe_wait b "$limit" >/dev/null 2>&1 || [ -n "$(rxe_job_seconds peer-killed)" ] || rc=$?
wait "$host" || rc=$?
kill "$watcher" 2>/dev/null
echo "-- across machines: ${#JOB_NAMES[@]} jobs in $((SECONDS - start)) s"
for side in a b; do
  # VM b's end by the last job's fault is that job's business.
  [ "$side" = b ] && [ -n "$(rxe_job_seconds peer-killed)" ] && continue
  [ -f "$RXE_OUT/ended.$side" ] && echo "   $(cat "$RXE_OUT/ended.$side"); its jobs did not run"
done
rxe_jobs_check || rc=1
for side in a b; do
  echo "   rxe counters of VM $side: $(cat "$RXE_OUT/$side.hw_counters" 2>/dev/null)"
done
[ "$rc" = 0 ] || { echo "   VM logs:"; cat "$RXE_OUT"/a.log "$RXE_OUT"/b.log "$RXE_OUT/side-h.log" 2>/dev/null | tail -20; }
exit "$rc"
