#!/usr/bin/env bash
# roccl next to Open MPI (shared-memory and TCP transports) and Gloo (PyTorch), same sizes,
# same data type (f32, sum), same timing rule: per iteration the slowest rank's time, then the
# median over iterations; bus bandwidth as nccl-tests computes it. Not part of CI.
#
#   scripts/compare.sh [--ranks N] [--op all_reduce|all_gather|broadcast|reduce_scatter]
#                      [-b MIN] [-e MAX] [-f FACTOR] [--iters N] [--warmup N] [--rounds N]
#
# Each column runs ROUNDS times (default 2), interleaved with the others, and keeps its best
# time per size.
#
# Installs openmpi-bin, libopenmpi-dev and python3-torch with apt-get when missing (needs
# root). Prints one table: time (µs) and busbw (GB/s) per size for roccl (default network:
# shared memory between the local ranks), roccl over TCP, Open MPI over vader (shared
# memory), Open MPI over TCP, and Gloo. For all_reduce it adds `tcp-floor`: a bare ring
# exchange over loopback TCP of the bytes a ring all-reduce puts on the wire, with no
# reduction and no library (examples/tcp_floor.rs): what merely moving the bytes costs.
set -euo pipefail
cd "$(dirname "$0")/.."
target=$(scripts/target-dir)

ranks=2 op=all_reduce min=8 max=$((64 << 20)) factor=8 iters=20 warmup=5 rounds=2
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) ranks=$2; shift 2 ;;
    --op) op=$2; shift 2 ;;
    -b) min=$2; shift 2 ;;
    -e) max=$2; shift 2 ;;
    -f) factor=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "compare.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
bytes() { # 64M -> 67108864
  local v=$1
  case "$v" in *K) echo $(( ${v%K} << 10 ));; *M) echo $(( ${v%M} << 20 ));; *G) echo $(( ${v%G} << 30 ));; *) echo "$v";; esac
}
min=$(bytes "$min"); max=$(bytes "$max")

need=()
command -v mpirun >/dev/null || need+=(openmpi-bin)
command -v mpicc >/dev/null || need+=(libopenmpi-dev)
/usr/bin/python3 -c "import torch" 2>/dev/null || need+=(python3-torch)
if [ ${#need[@]} -gt 0 ]; then
  echo "-- installing ${need[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y "${need[@]}" >/dev/null 2>&1 ||
    { apt-get update >/dev/null && apt-get install -y "${need[@]}" >/dev/null; }
fi

out=target/compare
mkdir -p "$out"
cargo build --release --quiet --bin roccl-perf --example tcp_floor
mpicc -O2 scripts/compare/mpi_allreduce.c -o "$out/mpi_bench"

common=(--op "$op" --ranks "$ranks" -b "$min" -e "$max" -f "$factor" --iters "$iters" --warmup "$warmup")
# MPI_Bcast and Gloo's broadcast work in place: so does roccl's here (out of place, its root
# also copies its input to its output).
if [ "$op" = broadcast ]; then common+=(--inplace); else common+=(--out-of-place); fi
roccl() { # label, extra args
  local label=$1
  shift
  $target/release/roccl-perf "${common[@]}" "$@" 2>&1 |
    awk -v l="$label" -v op="$op" '$1 == op {t = $8; b = $10; if (t == "-") {t = $12; b = $14}; print l, $2, t, b}'
}
mpi() { # label, btl list
  mpirun --allow-run-as-root --oversubscribe -np "$ranks" --mca pml ob1 --mca btl "$2" \
    --mca btl_tcp_if_include lo "$out/mpi_bench" "$op" "$min" "$max" "$factor" "$iters" "$warmup" 2>/dev/null |
    awk -v l="$1" '{print l, $2, $3, $4}'
}
floor() {
  # Busy loops sharing CPUs would measure the scheduler: only with a CPU per rank.
  if [ "$op" != all_reduce ] || [ "$ranks" -gt "$(nproc)" ]; then return; fi
  $target/release/examples/tcp_floor --ranks "$ranks" -b "$min" -e "$max" -f "$factor" \
    -i "$iters" -w "$warmup"
}
gloo() {
  if [ "$op" = reduce_scatter ]; then return; fi
  local port=$((29000 + RANDOM % 1000))
  /usr/bin/python3 scripts/compare/gloo_bench.py "$op" "$ranks" "$((min < 4 ? 4 : min))" "$max" "$factor" \
    "$iters" "$warmup" "$port" 2>/dev/null | awk '{print "gloo", $2, $3, $4}'
}

# Every column runs ROUNDS times, interleaved, and keeps its best time per size: this
# machine has slow and fast phases, and a phase should not favour whoever ran in it.
for _ in $(seq "$rounds"); do
  roccl roccl
  roccl roccl-tcp --net tcp
  floor
  mpi ompi-shm self,vader
  mpi ompi-tcp self,tcp
  gloo
done >"$out/results.txt"

echo "# $op, $ranks ranks, f32 sum; time µs (busbw GB/s); median over $iters iterations of the slowest rank, best of $rounds interleaved rounds"
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores"
awk '
  { key = $1 SUBSEP $2; if (!(key in t) || $3 < t[key]) { t[key] = $3; bw[key] = $4 }; sizes[$2] = 1 }
  END {
    n = split("roccl roccl-tcp tcp-floor ompi-shm ompi-tcp gloo", cols, " ")
    printf "%10s", "bytes"
    for (i = 1; i <= n; i++) printf " %20s", cols[i]
    printf "   %s   %s\n", "roccl vs ompi-shm", "roccl-tcp vs gloo"
    m = 0
    for (s in sizes) list[++m] = s + 0
    for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (list[j] < list[i]) { x = list[i]; list[i] = list[j]; list[j] = x }
    for (k = 1; k <= m; k++) {
      s = list[k]
      printf "%10d", s
      for (i = 1; i <= n; i++) {
        key = cols[i] SUBSEP s
        if (key in t) printf " %10.2f (%7.3f)", t[key], bw[key]; else printf " %20s", "-"
      }
      a = cols[1] SUBSEP s; b = "ompi-shm" SUBSEP s
      if ((a in t) && (b in t) && t[a] > 0) printf "   %16.2fx", t[b] / t[a]; else printf "   %17s", "-"
      a = "roccl-tcp" SUBSEP s; b = "gloo" SUBSEP s
      if ((a in t) && (b in t) && t[a] > 0) printf "   %16.2fx", t[b] / t[a]
      printf "\n"
    }
  }' "$out/results.txt"
