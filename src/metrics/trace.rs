//! Traces (`ROCCL_TRACE=path`, `%r` replaced by the rank): Chrome trace-event JSON that
//! Perfetto and chrome://tracing open. Per communicator rank, a span per call (collective,
//! bytes, algorithm, network) on thread 0 and, inside it, a span per send and receive from
//! its post to its completion on the thread of its peer (`tid` = 1 + peer). Events are kept
//! in memory and written when the communicator goes (or every [`FLUSH_EVERY`] events, to
//! a file per rank that is rewritten whole); `scripts/trace-merge.py` joins the ranks' files
//! into one timeline (`pid` = rank).
//!
//! Off, tracing costs a branch per call and per message; on, a clock read per message.

use std::io::Write;
use std::path::PathBuf;

use parking_lot::Mutex;

/// Events kept before the file is written again.
pub const FLUSH_EVERY: usize = 100_000;

/// One complete event (`ph: "X"`).
struct Event {
    name: &'static str,
    cat: &'static str,
    /// Start and duration in nanoseconds since the process's metrics epoch.
    ts: u64,
    dur: u64,
    tid: usize,
    bytes: u64,
    /// The peer of a message; the algorithm and network of a call (formatted at writing).
    peer: usize,
    algo: Option<&'static str>,
    net: &'static str,
}

/// A rank's trace.
pub struct Trace {
    path: PathBuf,
    rank: usize,
    comm: u64,
    events: Mutex<Vec<Event>>,
}

impl Trace {
    /// The trace of rank `rank` of communicator `comm`, written where `pattern` says
    /// (`Config::trace`, from `ROCCL_TRACE`), when there is one.
    pub fn for_rank(pattern: Option<&str>, rank: usize, comm: u64) -> Option<Trace> {
        let p = pattern?.trim();
        if p.is_empty() {
            return None;
        }
        let path = if p.contains("%r") {
            p.replace("%r", &rank.to_string())
        } else {
            // One file per rank even when the pattern does not say where the rank goes.
            format!("{p}.{rank}")
        };
        Some(Trace {
            path: PathBuf::from(path),
            rank,
            comm,
            events: Mutex::new(Vec::with_capacity(4096)),
        })
    }

    /// Where this trace is written.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    fn push(&self, e: Event) {
        let full = {
            let mut v = self.events.lock();
            v.push(e);
            v.len() % FLUSH_EVERY == 0
        };
        if full {
            self.write();
        }
    }

    /// A call of `kind` on `bytes` with `algo` over `net`, from `ts` for `dur` ns.
    pub fn call(
        &self,
        kind: &'static str,
        bytes: u64,
        algo: Option<&'static str>,
        net: &'static str,
        ts: u64,
        dur: u64,
    ) {
        self.push(Event {
            name: kind,
            cat: "call",
            ts,
            dur,
            tid: 0,
            bytes,
            peer: 0,
            algo,
            net,
        });
    }

    /// A send (`send`) or receive of `bytes` with `peer`, posted at `ts`, done `dur` later.
    pub fn message(&self, send: bool, peer: usize, bytes: usize, ts: u64, dur: u64) {
        self.push(Event {
            name: if send { "send" } else { "recv" },
            cat: "message",
            ts,
            dur,
            tid: 1 + peer,
            bytes: bytes as u64,
            peer,
            algo: None,
            net: "",
        });
    }

    /// Write the file (all events so far) as `{"traceEvents": [...]}`.
    pub fn write(&self) {
        let events = self.events.lock();
        let mut out = String::with_capacity(64 + events.len() * 160);
        out.push_str("{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n");
        let pid = self.rank;
        out.push_str(&format!(
            "{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{pid},\"tid\":0,\"args\":{{\"name\":\"rank {pid} (communicator {:016x})\"}}}}",
            self.comm
        ));
        for e in events.iter() {
            let args = if e.cat == "call" {
                format!(
                    "\"bytes\":{},\"algorithm\":{},\"network\":{}",
                    e.bytes,
                    serde_json::to_string(&e.algo).unwrap_or_default(),
                    serde_json::to_string(e.net).unwrap_or_default()
                )
            } else {
                format!("\"peer\":{},\"bytes\":{}", e.peer, e.bytes)
            };
            out.push_str(&format!(
                ",\n{{\"name\":\"{}\",\"cat\":\"{}\",\"ph\":\"X\",\"ts\":{:.3},\"dur\":{:.3},\"pid\":{pid},\"tid\":{},\"args\":{{{}}}}}",
                e.name,
                e.cat,
                e.ts as f64 / 1e3,
                e.dur as f64 / 1e3,
                e.tid,
                args
            ));
        }
        out.push_str("\n]}\n");
        let r = std::fs::File::create(&self.path).and_then(|mut f| f.write_all(out.as_bytes()));
        if let Err(e) = r {
            crate::warn!("ROCCL_TRACE: cannot write {}: {e}", self.path.display());
        }
    }
}
