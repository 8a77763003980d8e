#!/usr/bin/env bash
# roccl-perf jobs across machines for the soft-RoCE tests (sourced after tests/rxe/vm.sh):
# ranks on the host ("h", the userspace RoCE v2 engine) and in VMs ("a", "b": Linux rxe
# through libibverbs), joined from the environment. Each machine ("side") runs its ranks of
# each job in turn; before a job, its sides meet at a barrier of files in $RXE_OUT.
#
#   rxe_job NAME "PLACES" "ENV" ARGS...
#        a job: PLACES gives each rank's side in rank order ("h a", "a a b b"), ENV is
#        added to every rank's environment, ARGS are roccl-perf's (or "@PROGRAM ARGS...":
#        $bin/PROGRAM runs instead, and must print "# wrong results: 0" on rank 0)
#   rxe_fault SIDE ACTION EXPECT
#        the last job gets a fault: SIDE ("h" for the host, in the test's namespace) runs
#        ACTION in the background once the job starts; EXPECT is "ok" (the job must survive),
#        a regular expression that some rank's error must match (the job must fail, and in
#        time: no rank killed by the job's time limit), or "ok-or:REGEX" (either)
#   rxe_expect_log REGEX
#        the last job must also leave a line matching REGEX in some rank's log (something
#        the job must have done on the way, not only its results)
#   rxe_again_if_stalled
#        the last job runs once more (as NAME.again) when it failed while a VM's NIC sent
#        nothing for JOB_STALL seconds (its NAME.stall-SIDE exists): Linux rxe under TCG on a
#        loaded host can stop sending for good mid-message (docs/ROCE.md, "The rxe stall");
#        the report says so and shows the kernel's view; the second run must pass
#   rxe_side_script SIDE    the script that runs SIDE's ranks of every job
#   rxe_jobs_check          prints each job's outcome; returns how many failed
#
# Addresses: the host 10.99.0.1 (its second rank's engine 10.99.0.11), VM a 10.99.0.2,
# VM b 10.99.0.3. Needs $bin (the build) and $RXE_OUT.

JOB_NAMES=()
JOB_PLACES=()
JOB_ENVS=()
JOB_ARGS=()
JOB_ACT_SIDE=()
JOB_ACT=()
JOB_EXPECT=()
JOB_LOG=()
# For a job's second run (rxe_again_if_stalled): the index of its first run; "" otherwise.
JOB_AGAIN_OF=()
JOB_LIMIT=${JOB_LIMIT:-300}
# Seconds into a job when a VM side records its kernel's view of the job (`rdma res show qp`:
# each queue pair's state and PSNs; the NIC's non-zero counters) in $RXE_OUT/NAME.peek-SIDE:
# a job that hangs (ROCCL_TIMEOUT is 60 s) then shows where rxe stood.
JOB_PEEK=${JOB_PEEK:-45}
# A VM side also watches its NIC through each job: once eth0 has sent nothing for
# JOB_STALL seconds, it records the kernel's view then (queue pairs, the NIC's counters, the
# queueing discipline's, the NIC's interrupts) in $RXE_OUT/NAME.stall-SIDE: where a job
# that stopped moving stood, whatever the fixed-time look above saw.
JOB_STALL=${JOB_STALL:-5}
# How long a side waits at a job's barrier for the others, which may be busy with jobs of
# their own before it (the VMs' own time limit bounds the whole).
JOB_BARRIER=${JOB_BARRIER:-1200}

rxe_job() {
  # RXE_JOBS (a regular expression) keeps only the jobs whose names match.
  JOB_KEPT=0
  [[ -z "${RXE_JOBS:-}" || "$1" =~ $RXE_JOBS ]] || return 0
  JOB_KEPT=1
  JOB_NAMES+=("$1")
  JOB_PLACES+=("$2")
  JOB_ENVS+=("$3")
  shift 3
  JOB_ARGS+=("$*")
  JOB_ACT_SIDE+=("")
  JOB_ACT+=("")
  JOB_EXPECT+=(ok)
  JOB_LOG+=("")
  JOB_AGAIN_OF+=("")
}

rxe_again_if_stalled() {
  [ "${JOB_KEPT:-0}" = 1 ] || return 0
  local last=$((${#JOB_NAMES[@]} - 1))
  # shellcheck disable=SC2086 # the arguments were kept as one string
  RXE_JOBS="" rxe_job "${JOB_NAMES[last]}.again" "${JOB_PLACES[last]}" "${JOB_ENVS[last]}" ${JOB_ARGS[last]}
  JOB_LOG[last + 1]=${JOB_LOG[last]}
  JOB_AGAIN_OF[last + 1]=$last
}

# Whether job J failed while a VM's NIC had stopped sending (the condition of its second run).
rxe_job_stalled() {
  local name=${JOB_NAMES[$1]}
  [ -f "$RXE_OUT/$name.failed" ] && ls "$RXE_OUT/$name".stall-* >/dev/null 2>&1
}

rxe_fault() {
  local last=$((${#JOB_NAMES[@]} - 1))
  [ "${JOB_KEPT:-0}" = 1 ] || return 0
  JOB_ACT_SIDE[last]=$1
  JOB_ACT[last]=$2
  JOB_EXPECT[last]=$3
}

rxe_expect_log() {
  [ "${JOB_KEPT:-0}" = 1 ] || return 0
  JOB_LOG[${#JOB_NAMES[@]} - 1]=$1
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
  local side=$1 j k n i root sides places machines
  echo "set -u"
  # barrier J N "SIDES": waits for job J's N sides; returns 2 when one of SIDES is a VM that
  # has ended (crashed: rxe_watch marks it; the job is skipped, later jobs without it run),
  # 1 after JOB_BARRIER seconds (the side stops).
  echo "barrier() { local t=\$SECONDS v; touch \"$RXE_OUT/sync.\$1.$side\";" \
    "while [ \"\$(ls \"$RXE_OUT\"/sync.\$1.* 2>/dev/null | wc -l)\" -lt \"\$2\" ]; do" \
    "for v in \$3; do [ -f \"$RXE_OUT/ended.\$v\" ] && { echo \"barrier \$1: \$(cat \"$RXE_OUT/ended.\$v\")\"; return 2; }; done;" \
    "[ \$((SECONDS - t)) -gt $JOB_BARRIER ] && { echo \"barrier \$1: the other side never came\"; return 1; }; sleep 0.2; done; }"
  if [ "$side" != h ]; then
    echo "JOB_STALL=$JOB_STALL"
    cat <<'EOF'
stalltrace_off() {
  echo 0 >/sys/kernel/tracing/tracing_on
  echo nop >/sys/kernel/tracing/current_tracer
  echo 1 >/sys/kernel/tracing/tracing_on
  echo 0 >/sys/kernel/tracing/events/kprobes/enable
  echo 'module rdma_rxe -p' >/sys/kernel/debug/dynamic_debug/control
} 2>/dev/null
# stallwatch FILE: once eth0 has sent nothing for JOB_STALL s, writes the kernel's view to
# FILE, then traces rxe for 6 s (its debug messages, its tasks and timers, what the requester
# and completer return) and appends that: which of rxe's parts still run in a stall.
stallwatch() {
  local prev= same=0 tx t=/sys/kernel/tracing f
  while sleep 1; do
    tx=$(cat /sys/class/net/eth0/statistics/tx_packets)
    if [ "$tx" = "$prev" ]; then same=$((same + 1)); else same=0; fi
    prev=$tx
    [ "$same" = "$JOB_STALL" ] && break
  done
  { date +%s; echo "eth0 sent nothing for $JOB_STALL s (tx_packets $tx)"; rdma res show qp | grep -v GSI
    ethtool -S eth0 | grep -v ': 0$'; tc -s qdisc show dev eth0; grep -i virtio /proc/interrupts; } >"$1" 2>&1
  mount -t debugfs none /sys/kernel/debug 2>/dev/null
  mount -t tracefs none "$t" 2>/dev/null
  [ -w "$t/current_tracer" ] || return 0
  echo 'r:rxe_req_ret rdma_rxe:rxe_requester ret=$retval' >>"$t/kprobe_events" 2>/dev/null
  echo 'r:rxe_comp_ret rdma_rxe:rxe_completer ret=$retval' >>"$t/kprobe_events" 2>/dev/null
  for f in rxe_post_send rxe_requester rxe_completer retransmit_timer rnr_nak_timer rxe_xmit_packet rxe_skb_tx_dtor; do
    echo "$f" >>"$t/set_ftrace_filter" 2>/dev/null
  done
  echo >"$t/trace"
  # Tracing stops when the job ends first (the side kills the watcher then).
  trap 'stalltrace_off; exit 0' TERM
  echo 'module rdma_rxe +p' >/sys/kernel/debug/dynamic_debug/control 2>/dev/null
  echo 1 >"$t/events/kprobes/enable" 2>/dev/null
  echo function >"$t/current_tracer"
  sleep 6
  # Read before the tracer changes: changing it empties the buffer.
  echo 0 >"$t/tracing_on"
  { echo "---- 6 s of rxe's functions (ftrace: $(grep -c . "$t/set_ftrace_filter") functions," \
      "$(grep -c . "$t/kprobe_events") return probes), then its debug messages"
    rdma res show qp | grep -v GSI; grep -v '^#' "$t/trace" | tail -400; dmesg | grep rxe | tail -200; } >>"$1" 2>&1
  stalltrace_off
}
EOF
  fi
  echo "await() { local t=\$SECONDS v; while [ \"\$(ls \"$RXE_OUT\"/sync.\$1.* 2>/dev/null | wc -l)\" -lt \"\$2\" ]; do" \
    "for v in \$3; do [ -f \"$RXE_OUT/ended.\$v\" ] && return 1; done;" \
    "[ \$((SECONDS - t)) -gt 600 ] && return 1; sleep 0.2; done; }"
  for j in "${!JOB_NAMES[@]}"; do
    read -ra places <<<"${JOB_PLACES[$j]}"
    n=${#places[@]}
    # The job's machines, each once ("a h"), and how many.
    machines=$(printf '%s\n' "${places[@]}" | sort -u | tr '\n' ' ')
    sides=$(wc -w <<<"$machines")
    if [[ " ${places[*]} " != *" $side "* ]]; then
      # Not in the job, but its fault's side: act once the job's sides have met.
      if [ "${JOB_ACT_SIDE[$j]}" = "$side" ]; then
        echo "await $j $sides \"$machines\" && ( ${JOB_ACT[$j]} ) >>\"$RXE_OUT/${JOB_NAMES[$j]}.action\" 2>&1"
      fi
      continue
    fi
    root="$(rxe_side_ip "${places[0]}"):$((29600 + j))"
    echo "barrier $j $sides \"$machines\"; r=\$?"
    echo "[ \$r = 1 ] && exit 1"
    local again=""
    if [ -n "${JOB_AGAIN_OF[$j]:-}" ]; then
      local first=$RXE_OUT/${JOB_NAMES[${JOB_AGAIN_OF[$j]}]}
      again=" && [ -f \"$first.failed\" ] && ls \"$first\".stall-* >/dev/null 2>&1"
    fi
    echo "if [ \$r = 0 ]$again; then"
    echo "echo \"$side start \$(date +%s)\" >>\"$RXE_OUT/${JOB_NAMES[$j]}.times\""
    if [ "${JOB_ACT_SIDE[$j]}" = "$side" ]; then
      echo "( ${JOB_ACT[$j]} ) >>\"$RXE_OUT/${JOB_NAMES[$j]}.action\" 2>&1 &"
    fi
    echo "pids=()"
    i=0
    local prog="roccl-perf ${JOB_ARGS[$j]} --counters"
    [[ "${JOB_ARGS[$j]}" == @* ]] && prog=${JOB_ARGS[$j]#@}
    for k in "${!places[@]}"; do
      [ "${places[$k]}" = "$side" ] || continue
      echo "env ROCCL_RANK=$k ROCCL_NRANKS=$n ROCCL_ROOT=$root ROCCL_HOSTID=side-$side ROCCL_TIMEOUT=60" \
        "$(rxe_side_env "$side" "$i") ${JOB_ENVS[$j]} timeout -k 5 $JOB_LIMIT $bin/$prog" \
        ">\"$RXE_OUT/${JOB_NAMES[$j]}.$k.log\" 2>&1 & pids+=(\$!)"
      i=$((i + 1))
    done
    if [ "$side" != h ]; then
      echo "( sleep $JOB_PEEK; { date +%s; rdma res show qp; ethtool -S eth0 | grep -v ': 0\$'; } >\"$RXE_OUT/${JOB_NAMES[$j]}.peek-$side\" 2>&1 ) & peek=\$!"
      echo "stallwatch \"$RXE_OUT/${JOB_NAMES[$j]}.stall-$side\" & stall=\$!"
    fi
    echo "for p in \"\${pids[@]}\"; do wait \$p || echo \"$side exit \$?\" >>\"$RXE_OUT/${JOB_NAMES[$j]}.failed\"; done"
    [ "$side" != h ] && echo "kill \$peek \$stall 2>/dev/null"
    echo "echo \"$side end \$(date +%s)\" >>\"$RXE_OUT/${JOB_NAMES[$j]}.times\""
    echo "fi"
  done
  if [ "$side" != h ]; then
    echo "grep . /sys/class/infiniband/rxe0/ports/1/hw_counters/* 2>/dev/null | sed 's|.*/||' | tr '\n' ' ' >\"$RXE_OUT/$side.hw_counters\""
  fi
}

# A job that expects a failure: it failed, no rank ran into the job's time limit (124), and
# some rank's error matches the expectation. Prints the errors.
rxe_failed_as_expected() {
  local name=$1 expect=$2 ok=1
  [ -f "$RXE_OUT/$name.failed" ] || { echo "   FAILED: $name survived a fault it should report"; return 1; }
  if grep -q "exit 124" "$RXE_OUT/$name.failed"; then
    echo "   FAILED: $name: a rank hung until the job's time limit"; ok=0
  fi
  if ! grep -h "error" "$RXE_OUT/$name".*.log 2>/dev/null | grep -E "$expect" >/dev/null; then
    echo "   FAILED: $name: no rank's error matches /$expect/"; ok=0
  fi
  [ "$ok" = 1 ] && echo "   ok: $name failed as it must, in $(rxe_job_seconds "$name") s:"
  grep -h "roccl-perf: error" "$RXE_OUT/$name".*.log 2>/dev/null | cut -c1-400 | sed 's/^/       /'
  [ "$ok" = 1 ]
}

# Seconds from a job's first start to its last end, over its sides.
rxe_job_seconds() {
  awk '$2 == "start" && (s == "" || $3 < s) {s = $3} $2 == "end" && $3 > e {e = $3} END {print e - s}' \
    "$RXE_OUT/$1.times" 2>/dev/null
}

rxe_jobs_check() {
  local j k name places failed=0 line
  for j in "${!JOB_NAMES[@]}"; do
    name=${JOB_NAMES[$j]}
    read -ra places <<<"${JOB_PLACES[$j]}"
    # A second run counts only where the first stalled; a first run that stalled is reported
    # with what its VM's kernel saw, and its second run decides.
    if [ -n "${JOB_AGAIN_OF[$j]:-}" ] && ! rxe_job_stalled "${JOB_AGAIN_OF[$j]}"; then
      continue
    fi
    if [ -n "${JOB_AGAIN_OF[$j + 1]:-}" ] && rxe_job_stalled "$j"; then
      echo "   STALLED: $name (a VM's NIC sent nothing for ${JOB_STALL} s, and the job timed out: rxe stopped sending; docs/ROCE.md, \"The rxe stall\"); it runs once more"
      grep -h "roccl-perf: error" "$RXE_OUT/$name".*.log 2>/dev/null | cut -c1-300 | sed 's/^/       /'
      for f in "$RXE_OUT/$name".stall-*; do
        echo "     ---- ${f##*.stall-}'s kernel once its NIC had sent nothing for ${JOB_STALL} s"
        head -60 "$f" | sed 's/^/     | /'
      done
      continue
    fi
    local expect=${JOB_EXPECT[$j]}
    if [[ "$expect" == ok-or:* && -f "$RXE_OUT/$name.failed" ]]; then
      expect=${expect#ok-or:}
    fi
    if [[ "$expect" != ok && "$expect" != ok-or:* ]]; then
      rxe_failed_as_expected "$name" "$expect" || failed=$((failed + 1))
      continue
    fi
    local logged=1
    if [ -n "${JOB_LOG[$j]}" ] && ! grep -hEq "${JOB_LOG[$j]}" "$RXE_OUT/$name".*.log 2>/dev/null; then
      logged=0
      echo "   FAILED: $name: no rank's log has a line matching /${JOB_LOG[$j]}/"
    fi
    if [ "$logged" = 1 ] && [ ! -f "$RXE_OUT/$name.failed" ] && grep -qx "# wrong results: 0" "$RXE_OUT/$name.0.log" 2>/dev/null; then
      echo "   ok: $name (ranks on ${places[*]}; roccl-perf ${JOB_ARGS[$j]}; $(rxe_job_seconds "$name") s)"
      [ -n "${JOB_ACT[$j]}" ] && echo "       survived, on ${JOB_ACT_SIDE[$j]}: ${JOB_ACT[$j]}"
      for k in "${!places[@]}"; do
        line=$(grep -m1 "^# network counters, rank $k (\(rocev2\|verbs\))" "$RXE_OUT/$name.$k.log" | sed 's/^# network counters, //')
        # The engine's counters, and a VM rank's where it has any (its kicks: src/rdma/ibv/kick.rs).
        [[ "$line" =~ :\ *[^\ ] ]] && echo "       $line"
      done
    else
      echo "   FAILED: $name (ranks on ${places[*]}; roccl-perf ${JOB_ARGS[$j]} ${JOB_ENVS[$j]})"
      cat "$RXE_OUT/$name.failed" 2>/dev/null | sed 's/^/     /'
      for k in "${!places[@]}"; do
        echo "     ---- rank $k (${places[$k]})"
        tail -15 "$RXE_OUT/$name.$k.log" 2>/dev/null | sed 's/^/     | /'
      done
      for f in "$RXE_OUT/$name".peek-*; do
        [ -f "$f" ] || continue
        echo "     ---- ${f##*.peek-}'s kernel ${JOB_PEEK} s into the job (rdma res show qp; ethtool -S eth0)"
        head -40 "$f" | sed 's/^/     | /'
      done
      for f in "$RXE_OUT/$name".stall-*; do
        [ -f "$f" ] || continue
        echo "     ---- ${f##*.stall-}'s kernel once its NIC had sent nothing for ${JOB_STALL} s"
        head -60 "$f" | sed 's/^/     | /'
      done
      failed=$((failed + 1))
    fi
  done
  return "$failed"
}
