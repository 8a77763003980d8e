#!/usr/bin/env bash
# torch's own distributed test suite with roccl (run_suite.py), in the torch environment
# ../run.sh makes (ROCCL_TORCH_VENV, default ~/.cache/roccl/torch-venv; else the python on
# PATH, which needs torch, expecttest and roccl installed).
#
#   run.sh ci          the part chosen for CI: 2 ranks, one or two tests per area (about 2.5 min)
#   run.sh all [N...]  every test, at each rank count given (default 2 and 3; 15-25 min each)
#
# Each test spawns its ranks as torch's test_distributed_spawn.py does; a failing test fails
# the run. Tests skipped by the suite say why (no GPU, another backend's feature, or one of
# the differences docs/TORCH.md names).
set -euo pipefail
cd "$(dirname "$0")"
venv=${ROCCL_TORCH_VENV:-$HOME/.cache/roccl/torch-venv}
py=python
[ -x "$venv/bin/python" ] && py="$venv/bin/python"
mode=${1:-ci}
shift || true

# Chosen for what they cover: every collective, async work and futures, object collectives,
# coalesced calls, point-to-point (tags, batches), subgroups (and torch's debug wrapper, which
# compares sequence numbers), a barrier's timeout (an error path), a monitored barrier with a
# rank missing, DDP with and without no_sync and communication hooks, and group teardown.
CI_TESTS=(
  test_all_reduce_sum test_all_reduce_sum_async test_all_reduce_max test_all_reduce_sum_complex
  test_all_reduce_coalesced_sum test_all_reduce_full_group_sum
  test_broadcast test_reduce_sum test_all_gather test_all_gather_coalesced_simple
  test_all_gather_object_default_pg test_all_gather_object_subgroup test_gather test_scatter
  test_scatter_object_list test_barrier test_barrier_timeout_full_group test_get_future
  test_send_recv test_isend test_send_recv_with_tag test_batch_isend_irecv_gloo
  test_monitored_barrier_gloo
  test_DistributedDataParallelCPU test_accumulate_gradients_no_sync_allreduce_hook
  test_ddp_create_graph test_static_graph_api_cpu test_get_backend test_destroy_group
)

run() {
  local world=$1
  shift
  local tmp log rc=0
  tmp=$(mktemp -d)
  log=$tmp/log
  echo "-- torch suite, BACKEND=roccl, WORLD_SIZE=$world: ${*:-every test}"
  local start=$SECONDS
  BACKEND=roccl WORLD_SIZE=$world TEMP_DIR=$tmp "$py" run_suite.py -v "$@" >"$log" 2>&1 || rc=$?
  grep -E '^(Ran |OK|FAILED|FAIL: |ERROR: )' "$log" || true
  if [ "$rc" -ne 0 ]; then
    echo "-- the last 150 lines of the run:"
    tail -n 150 "$log"
  fi
  rm -rf "$tmp"
  echo "-- WORLD_SIZE=$world: exit $rc in $((SECONDS - start)) s"
  return "$rc"
}

case $mode in
ci)
  run 2 "${CI_TESTS[@]/#/TestDistBackendWithSpawn.}"
  ;;
all)
  [ $# -gt 0 ] || set -- 2 3
  rc=0
  for world in "$@"; do
    run "$world" || rc=1
  done
  exit $rc
  ;;
*)
  echo "usage: $0 ci | all [ranks...]" >&2
  exit 2
  ;;
esac
