#!/usr/bin/env bash
# Run roccl-perf RUNS times with the given arguments and print, per (op, size, placement), the median
# over runs of time_us and busbw (each run's time_us is already the median over iterations
# of the slowest rank). Usage: scripts/perf-median.sh RUNS roccl-perf-args...
set -euo pipefail
runs="$1"; shift
cd "$(dirname "$0")/.."
target=$(scripts/target-dir)
cargo build --release --quiet --bin roccl-perf
tmp=$(mktemp -d)
for i in $(seq "$runs"); do
  $target/release/roccl-perf "$@" --json "$tmp/$i.json" > "$tmp/$i.txt"
done
python3 - "$tmp" "$runs" <<'PY'
import json, statistics, sys
d, n = sys.argv[1], int(sys.argv[2])
runs = [json.load(open(f"{d}/{i}.json"))["results"] for i in range(1, n + 1)]
print(f"| op | bytes | algo | time µs (median of {n}) | min–max | busbw GB/s | wrong |")
print("|---|---:|---|---:|---:|---:|---:|")
for rows in zip(*runs):
    t = [r["time_us"] for r in rows]; bw = [r["busbw_gbs"] for r in rows]
    algos = "/".join(sorted({r["algo"] for r in rows}))
    where = " (in place)" if rows[0].get("inplace") else ""
    print(f"| {rows[0]['op']}{where} | {rows[0]['bytes']} | {algos} | {statistics.median(t):.2f} | {min(t):.2f}–{max(t):.2f} | {statistics.median(bw):.3f} | {'N/A' if rows[0]['wrong'] is None else sum(r['wrong'] for r in rows)} |")
PY
rm -rf "$tmp"
