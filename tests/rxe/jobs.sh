#!/usr/bin/env bash
# roccl-perf jobs across machines for the soft-RoCE tests (sourced after tests/rxe/vm.sh):
# ranks on the host ("h", the userspace RoCE v2 engine) and in VMs ("a", "b": Linux rxe
# through libibverbs), joined from the environment. Each machine ("side") runs its ranks of
# each job in turn; before a job, its sides meet at a barrier of files in $RXE_OUT.
#
#   rxe_job NAME "PLACES" "ENV" ARGS...
#        a job: PLACES gives each rank's side in rank order ("h a", "a a b b"), ENV is
#        added to every rank's environment, ARGS are roccl-perf's
#   rxe_side_script SIDE    the script that runs SIDE's ranks of every job
#   rxe_jobs_check          prints each job's outcome; returns how many failed
#
# Addresses: the host 10.99.0.1 (its second rank's engine 10.99.0.11), VM a 10.99.0.2,
# VM b 10.99.0.3. Needs $bin (the build) and $RXE_OUT.

JOB_NAMES=()
JOB_PLACES=()
JOB_ENVS=()
JOB_ARGS=()
JOB_LIMIT=${JOB_LIMIT:-300}

rxe_job() {
  # RXE_JOBS (a regular expression) keeps only the jobs whose names match.
  [[ -z "${RXE_JOBS:-}" || "$1" =~ $RXE_JOBS ]] || return 0
  JOB_NAMES+=("$1")
  JOB_PLACES+=("$2")
  JOB_ENVS+=("$3")
  shift 3
  JOB_ARGS+=("$*")
}

rxe_side_ip() {
  case $1 in h) echo 10.99.0.1 ;; a) echo 10.99.0.2 ;; b) echo 10.99.0.3 ;; esac
}

# The environment of the i-th rank of a job on SIDE.
rxe_side_env() {
  local side=$1 i=$2
  case $side in
    # Each host rank's engine on its own address: a NIC reaches an engine only on port 4791.
    h) echo "ROCCL_NET=rocev2 ROCCL_SOCKET_IFNAME==rxebr0 ROCCL_IB_HCA=10.99.0.$((1 + 10 * i))" ;;
    *) echo "ROCCL_NET=verbs ROCCL_SOCKET_IFNAME==eth0 ROCCL_IB_HCA==rxe0" ;;
  esac
}

rxe_side_script() {
  local side=$1 j k n i root sides places
  echo "set -u"
  echo "barrier() { local t=\$SECONDS; touch \"$RXE_OUT/sync.\$1.$side\";" \
    "while [ \"\$(ls \"$RXE_OUT\"/sync.\$1.* 2>/dev/null | wc -l)\" -lt \"\$2\" ]; do" \
    "[ \$((SECONDS - t)) -gt 120 ] && { echo \"barrier \$1: the other side never came\"; return 1; }; sleep 0.2; done; }"
  for j in "${!JOB_NAMES[@]}"; do
    read -ra places <<<"${JOB_PLACES[$j]}"
    [[ " ${places[*]} " == *" $side "* ]] || continue
    n=${#places[@]}
    sides=$(printf '%s\n' "${places[@]}" | sort -u | wc -l)
    root="$(rxe_side_ip "${places[0]}"):$((29600 + j))"
    echo "barrier $j $sides || exit 1"
    echo "pids=()"
    i=0
    for k in "${!places[@]}"; do
      [ "${places[$k]}" = "$side" ] || continue
      echo "env ROCCL_RANK=$k ROCCL_NRANKS=$n ROCCL_ROOT=$root ROCCL_HOSTID=side-$side ROCCL_TIMEOUT=60" \
        "$(rxe_side_env "$side" "$i") ${JOB_ENVS[$j]} timeout -k 5 $JOB_LIMIT $bin/roccl-perf ${JOB_ARGS[$j]}" \
        "--counters >\"$RXE_OUT/${JOB_NAMES[$j]}.$k.log\" 2>&1 & pids+=(\$!)"
      i=$((i + 1))
    done
    echo "for p in \"\${pids[@]}\"; do wait \$p || echo \"$side exit \$?\" >>\"$RXE_OUT/${JOB_NAMES[$j]}.failed\"; done"
  done
  if [ "$side" != h ]; then
    echo "grep . /sys/class/infiniband/rxe0/ports/1/hw_counters/* 2>/dev/null | sed 's|.*/||' | tr '\n' ' ' >\"$RXE_OUT/$side.hw_counters\""
  fi
}

rxe_jobs_check() {
  local j k name places failed=0 line
  for j in "${!JOB_NAMES[@]}"; do
    name=${JOB_NAMES[$j]}
    read -ra places <<<"${JOB_PLACES[$j]}"
    if [ ! -f "$RXE_OUT/$name.failed" ] && grep -qx "# wrong results: 0" "$RXE_OUT/$name.0.log" 2>/dev/null; then
      echo "   ok: $name (ranks on ${places[*]}; roccl-perf ${JOB_ARGS[$j]})"
      for k in "${!places[@]}"; do
        line=$(grep -m1 "^# network counters, rank $k (\(rocev2\|verbs\))" "$RXE_OUT/$name.$k.log" | sed 's/^# network counters, //')
        [ "${places[$k]}" = h ] && [ -n "$line" ] && echo "       $line"
      done
    else
      echo "   FAILED: $name (ranks on ${places[*]}; roccl-perf ${JOB_ARGS[$j]} ${JOB_ENVS[$j]})"
      cat "$RXE_OUT/$name.failed" 2>/dev/null | sed 's/^/     /'
      for k in "${!places[@]}"; do
        echo "     ---- rank $k (${places[$k]})"
        tail -15 "$RXE_OUT/$name.$k.log" 2>/dev/null | sed 's/^/     | /'
      done
      failed=$((failed + 1))
    fi
  done
  return "$failed"
}
