#!/usr/bin/env python3
"""Join the per-rank Chrome trace files that ROCCL_TRACE (or roccl-perf --trace) wrote into
one timeline that Perfetto (ui.perfetto.dev) and chrome://tracing open: one process per rank
(pid = rank), a thread for the calls and one per peer for the sends and receives.

    scripts/trace-merge.py OUT.json RANK0.json RANK1.json ...
"""
import json
import sys


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, files = sys.argv[1], sys.argv[2:]
    events = []
    for f in files:
        with open(f) as fh:
            try:
                doc = json.load(fh)
            except json.JSONDecodeError as e:
                sys.exit(f"{f}: not a trace file ({e})")
        evs = doc.get("traceEvents") if isinstance(doc, dict) else doc
        if not isinstance(evs, list):
            sys.exit(f"{f}: no traceEvents")
        events.extend(evs)
    # Thread names: the calls, then one per peer.
    named = {(e["pid"], e.get("tid", 0)) for e in events if e.get("ph") == "X"}
    for pid, tid in sorted(named):
        name = "calls" if tid == 0 else f"with rank {tid - 1}"
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
    with open(out, "w") as fh:
        json.dump({"displayTimeUnit": "ns", "traceEvents": events}, fh)
    spans = sum(1 for e in events if e.get("ph") == "X")
    print(f"{out}: {len(files)} files, {spans} spans, ranks {sorted({e['pid'] for e in events})}")


if __name__ == "__main__":
    main()
