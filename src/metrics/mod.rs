//! Counters kept per communicator, per peer and per network, always on (relaxed atomics:
//! a few nanoseconds per message and per call), and the registry the metrics endpoint
//! reads them from (`ROCCL_METRICS_ADDR`, [`http`]).
//!
//! A communicator registers its [`CommMetrics`] at init; the executor adds each completed
//! message's bytes to its peer's counters, the dispatcher each call's count, bytes and time
//! to its collective and algorithm, and marks the call in flight (and, once it waits without
//! progress, the peers it waits on) for `/status` and the stuck-call warning. Networks give
//! their own counters through a source closure read only when scraped.
//!
//! Cost: one thread of a communicator writes its counters at a time (calls hold the
//! communicator's state), so counts are plain loads and stores of relaxed atomics (no
//! locked read-modify-write), and the clock is read for one call in [`TIME_EVERY`] only
//! (its time counted that many times) and when a call is about to sleep: an 8-byte
//! all-reduce pays a few nanoseconds (docs/PERFORMANCE.md).

pub mod http;
pub mod trace;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::Mutex;

/// Algorithms per kind that are counted apart (index 0: none, for point-to-point calls):
/// as many as a call tag's 4 algorithm bits tell apart.
pub const MAX_ALGOS: usize = 16;
/// One call in this many is timed; its time counts for all of them.
pub const TIME_EVERY: u64 = 64;

/// `c += v` for a counter only one thread writes at a time (no locked instruction).
#[inline]
fn bump(c: &AtomicU64, v: u64) {
    c.store(c.load(Relaxed).wrapping_add(v), Relaxed);
}

/// One peer's traffic.
#[derive(Default)]
pub struct PeerCounters {
    /// Payload bytes of completed sends to the peer.
    pub bytes_sent: AtomicU64,
    /// Payload bytes of completed receives from the peer.
    pub bytes_received: AtomicU64,
    /// Completed sends.
    pub messages_sent: AtomicU64,
    /// Completed receives.
    pub messages_received: AtomicU64,
    /// The connection's round-trip time as its transport last reported it (TCP's smoothed
    /// RTT, the RoCE engine's), nanoseconds; 0 until known. The executor reads it now and then.
    pub rtt_ns: AtomicU64,
    /// Running estimate of the send throughput to the peer, bytes per second: sends of
    /// large enough to measure bandwidth (the executor says which), from post to completion,
    /// averaged with weight 1/8.
    pub throughput_bps: AtomicU64,
}

/// One (kind, algorithm)'s calls.
#[derive(Default)]
pub struct CallCounters {
    /// Calls completed (successfully or not).
    pub calls: AtomicU64,
    /// Bytes of their buffers (as every rank passes them).
    pub bytes: AtomicU64,
    /// Nanoseconds spent in them.
    pub nanos: AtomicU64,
}

/// A source of a network's counters: appends `(name, value)` pairs when scraped.
pub type NetSource = Box<dyn Fn(&mut Vec<(&'static str, u64)>) + Send + Sync>;

/// A link between two hosts measured at init: the hosts, the ranks that measured it, its
/// latency in µs and its bandwidth in GB/s.
pub type MeasuredRow = ((usize, usize), (usize, usize), &'static str, f64, f64);

/// A pair of hosts' choice of network by call size: (hosts, (from bytes, network) steps).
pub type NetChoiceRow = ((usize, usize), Vec<(usize, &'static str)>);

/// The call in flight and what it waits on.
#[derive(Default)]
struct InFlight {
    active: AtomicBool,
    kind: AtomicUsize,
    algo: AtomicUsize,
    bytes: AtomicU64,
    /// Nanoseconds since the registry's epoch when it began to wait (0: it has not).
    started: AtomicU64,
    /// When a timed call (one in [`TIME_EVERY`]) started (0: this call is not timed).
    timed: AtomicU64,
    /// Calls started (which one is timed).
    seq: AtomicU64,
    /// Peers the call waits on, set when it found nothing to do (not on the fast path).
    waiting: Mutex<Vec<usize>>,
    /// The stuck warning was given for this call.
    warned: AtomicBool,
}

/// The counters of one communicator (one rank of it).
pub struct CommMetrics {
    /// This rank.
    pub rank: usize,
    /// Ranks in the communicator.
    pub nranks: usize,
    /// Equal on every rank of the communicator (its hash).
    pub comm: u64,
    /// The network's name.
    pub net: &'static str,
    /// Names of the kinds of call counted (see [`CommMetrics::new`]).
    kinds: &'static [&'static str],
    /// Names of the algorithms (index 1.. of a call's algorithm).
    pub algos: &'static [&'static str],
    /// Per peer (index = rank).
    pub peers: Vec<PeerCounters>,
    calls: Vec<CallCounters>,
    inflight: InFlight,
    nets: Mutex<Vec<(&'static str, NetSource)>>,
    /// The links between hosts measured at init: (hosts, ranks, latency µs, GB/s).
    measured: Mutex<(Vec<MeasuredRow>, Vec<NetChoiceRow>)>,
    /// The trace `ROCCL_TRACE` asks for ([`trace`]), and when the traced call started.
    trace: Option<trace::Trace>,
    trace_start: AtomicU64,
}

impl Drop for CommMetrics {
    fn drop(&mut self) {
        if let Some(t) = &self.trace {
            t.write();
        }
    }
}

/// Nanoseconds since the process's first use of the metrics (the clock of `started` and of
/// trace events).
pub fn now_ns() -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

impl CommMetrics {
    /// The counters of rank `rank` of `nranks` of communicator `comm` over `net`, with the
    /// names of the kinds of call it counts (the index [`CommMetrics::call_start`] takes;
    /// the last is where unknown kinds go) and of its algorithms; traced to the file
    /// `trace` names, if any ([`trace::Trace::for_rank`]).
    pub fn new(
        rank: usize,
        nranks: usize,
        comm: u64,
        net: &'static str,
        (kinds, algos): (&'static [&'static str], &'static [&'static str]),
        trace: Option<&str>,
    ) -> Arc<CommMetrics> {
        let kinds = if kinds.is_empty() {
            &["call"][..]
        } else {
            kinds
        };
        let m = Arc::new(CommMetrics {
            rank,
            nranks,
            comm,
            net,
            kinds,
            algos,
            peers: (0..nranks).map(|_| PeerCounters::default()).collect(),
            calls: (0..kinds.len() * MAX_ALGOS)
                .map(|_| CallCounters::default())
                .collect(),
            inflight: InFlight {
                // Room for every peer a call may wait on (the executor passes at most 64):
                // no allocation on the waiting path.
                waiting: Mutex::new(Vec::with_capacity(64.max(nranks))),
                ..InFlight::default()
            },
            nets: Mutex::new(Vec::new()),
            measured: Mutex::new((Vec::new(), Vec::new())),
            trace: trace::Trace::for_rank(trace, rank, comm),
            trace_start: AtomicU64::new(0),
        });
        if let Some(t) = &m.trace {
            crate::info!(
                "rank {rank}: tracing to {} (ROCCL_TRACE)",
                t.path().display()
            );
        }
        REGISTRY.lock().push(Arc::downgrade(&m));
        m
    }

    /// A completed send of `bytes` to `peer`.
    #[inline]
    pub fn sent(&self, peer: usize, bytes: usize) {
        if let Some(p) = self.peers.get(peer) {
            bump(&p.bytes_sent, bytes as u64);
            bump(&p.messages_sent, 1);
        }
    }

    /// The transport's round-trip time to `peer`.
    #[inline]
    pub fn rtt(&self, peer: usize, rtt: std::time::Duration) {
        if let Some(p) = self.peers.get(peer) {
            p.rtt_ns.store(rtt.as_nanos() as u64, Relaxed);
        }
    }

    /// A send of `bytes` (large enough to measure bandwidth) to `peer` took `nanos` from post to
    /// completion.
    #[inline]
    pub fn throughput(&self, peer: usize, bytes: usize, nanos: u64) {
        let Some(p) = self.peers.get(peer) else {
            return;
        };
        let bps = (bytes as u128 * 1_000_000_000 / u128::from(nanos.max(1))) as u64;
        let old = p.throughput_bps.load(Relaxed);
        let new = if old == 0 {
            bps
        } else {
            old - old / 8 + bps / 8
        };
        p.throughput_bps.store(new, Relaxed);
    }

    /// A completed receive of `bytes` from `peer`.
    #[inline]
    pub fn received(&self, peer: usize, bytes: usize) {
        if let Some(p) = self.peers.get(peer) {
            bump(&p.bytes_received, bytes as u64);
            bump(&p.messages_received, 1);
        }
    }

    /// A call of `kind` (index into the kinds given to [`CommMetrics::new`]) on `bytes` starts.
    #[inline]
    pub fn call_start(&self, kind: usize, bytes: usize) {
        let f = &self.inflight;
        f.kind.store(kind, Relaxed);
        f.algo.store(0, Relaxed);
        f.bytes.store(bytes as u64, Relaxed);
        f.started.store(0, Relaxed);
        let seq = f.seq.load(Relaxed);
        f.seq.store(seq.wrapping_add(1), Relaxed);
        f.timed.store(
            if seq % TIME_EVERY == 0 {
                now_ns().max(1)
            } else {
                0
            },
            Relaxed,
        );
        f.warned.store(false, Relaxed);
        f.active.store(true, Relaxed);
        if self.trace.is_some() {
            self.trace_start.store(now_ns(), Relaxed);
        }
    }

    /// The call in flight runs algorithm `algo` (1.. into [`CommMetrics::algos`]).
    #[inline]
    pub fn call_algo(&self, algo: usize) {
        self.inflight.algo.store(algo, Relaxed);
    }

    /// The call in flight is over: counted under its kind and algorithm.
    #[inline]
    pub fn call_done(&self) {
        let f = &self.inflight;
        if !f.active.load(Relaxed) {
            return;
        }
        f.active.store(false, Relaxed);
        let kind = f.kind.load(Relaxed).min(self.kinds.len() - 1);
        let algo = f.algo.load(Relaxed).min(MAX_ALGOS - 1);
        let c = &self.calls[kind * MAX_ALGOS + algo];
        bump(&c.calls, 1);
        bump(&c.bytes, f.bytes.load(Relaxed));
        let t = f.timed.load(Relaxed);
        if t != 0 {
            bump(&c.nanos, now_ns().saturating_sub(t) * TIME_EVERY);
        }
        if f.started.load(Relaxed) != 0 {
            f.waiting.lock().clear();
        }
        if let Some(t) = &self.trace {
            let start = self.trace_start.load(Relaxed);
            t.call(
                self.kinds[kind],
                f.bytes.load(Relaxed),
                self.algo_name(algo),
                self.net,
                start,
                now_ns().saturating_sub(start),
            );
        }
    }

    /// The trace of this rank, when `ROCCL_TRACE` asked for one.
    #[inline]
    pub fn trace(&self) -> Option<&trace::Trace> {
        self.trace.as_ref()
    }

    /// The call in flight found nothing to do for a while and waits on `peers` (called when
    /// it is about to sleep, not per message). Returns how long the call has run and, the
    /// first time it passes `warn_after`, its description for a warning.
    pub fn waiting_on(&self, peers: &[usize], warn_after: std::time::Duration) -> Option<String> {
        let f = &self.inflight;
        if !f.active.load(Relaxed) {
            return None;
        }
        {
            let mut w = f.waiting.lock();
            w.clear();
            let room = w.capacity();
            w.extend_from_slice(&peers[..peers.len().min(room)]);
            w.sort_unstable();
            w.dedup();
        }
        let now = now_ns();
        if f.started.load(Relaxed) == 0 {
            f.started.store(now, Relaxed);
        }
        let age = now.saturating_sub(f.started.load(Relaxed));
        if age < warn_after.as_nanos() as u64 || f.warned.swap(true, Relaxed) {
            return None;
        }
        Some(self.describe_inflight(age))
    }

    fn describe_inflight(&self, age_ns: u64) -> String {
        let f = &self.inflight;
        let peers = f.waiting.lock().clone();
        format!(
            "rank {} (communicator {:016x}): {} of {} bytes{} has made no progress for {:.1} s; it waits on rank(s) {:?}",
            self.rank,
            self.comm,
            self.kind_name(f.kind.load(Relaxed)),
            f.bytes.load(Relaxed),
            self.algo_name(f.algo.load(Relaxed))
                .map(|a| format!(" ({a})"))
                .unwrap_or_default(),
            age_ns as f64 / 1e9,
            peers
        )
    }

    fn algo_name(&self, algo: usize) -> Option<&'static str> {
        algo.checked_sub(1).and_then(|i| self.algos.get(i)).copied()
    }

    /// Keep the links measured at init (hosts, ranks, network, latency in µs, GB/s) and
    /// the networks chosen by size for `/status`.
    pub fn set_measured_links(
        &self,
        rows: impl Iterator<Item = MeasuredRow>,
        choices: Vec<NetChoiceRow>,
    ) {
        *self.measured.lock() = (rows.collect(), choices);
    }

    /// Add a source of the network's counters (`net`: its name, a label).
    pub fn add_net_source(&self, net: &'static str, src: NetSource) {
        self.nets.lock().push((net, src));
    }

    /// The counters of a (kind, algorithm) pair.
    pub fn calls(&self, kind: usize, algo: usize) -> &CallCounters {
        &self.calls[kind.min(self.kinds.len() - 1) * MAX_ALGOS + algo.min(MAX_ALGOS - 1)]
    }

    /// The name of call kind `kind` (unknown ones count as the last).
    pub fn kind_name(&self, kind: usize) -> &'static str {
        self.kinds[kind.min(self.kinds.len() - 1)]
    }

    /// The names of the kinds of call counted.
    pub fn kinds(&self) -> &'static [&'static str] {
        self.kinds
    }
}

/// Every communicator alive in this process.
static REGISTRY: Mutex<Vec<Weak<CommMetrics>>> = Mutex::new(Vec::new());

/// The live communicators' counters (dropping those that are gone).
pub fn live() -> Vec<Arc<CommMetrics>> {
    let mut r = REGISTRY.lock();
    r.retain(|w| w.strong_count() > 0);
    r.iter().filter_map(Weak::upgrade).collect()
}

/// Escape a Prometheus label value.
fn label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Every live communicator's counters in the Prometheus text format (names `roccl_*`).
pub fn prometheus() -> String {
    let comms = live();
    let mut out = String::new();
    write_call_families(&mut out, &comms);
    write_peer_counter_families(&mut out, &comms);
    write_peer_gauge_families(&mut out, &comms);
    write_waiting_family(&mut out, &comms);
    write_net_families(&mut out, &comms);
    out
}

/// The `# HELP` and `# TYPE` lines that open a family of metrics in the exposition.
fn family_header(out: &mut String, name: &str, help: &str, kind: &str) {
    use std::fmt::Write;
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// The labels that name a communicator on each of its rows: its rank, its id and the
/// network (`net`) the figures come from.
fn comm_labels(m: &CommMetrics, net: &str) -> String {
    format!(
        "rank=\"{}\",comm=\"{:016x}\",network=\"{}\"",
        m.rank,
        m.comm,
        label(net)
    )
}

/// The per-call counters (calls, bytes, seconds): a row for each communicator, collective
/// and algorithm that has completed at least one call, so that unused pairs stay out.
fn write_call_families(out: &mut String, comms: &[Arc<CommMetrics>]) {
    use std::fmt::Write;
    type Pick = fn(&CallCounters) -> f64;
    let call_families: [(&str, &str, Pick); 3] = [
        (
            "roccl_calls_total",
            "Calls completed, by collective and algorithm.",
            |c| c.calls.load(Relaxed) as f64,
        ),
        (
            "roccl_call_bytes_total",
            "Bytes of the buffers of the calls completed.",
            |c| c.bytes.load(Relaxed) as f64,
        ),
        (
            "roccl_call_seconds_total",
            "Time spent in the calls completed.",
            |c| c.nanos.load(Relaxed) as f64 / 1e9,
        ),
    ];
    for (name, help, pick) in call_families {
        family_header(out, name, help, "counter");
        for m in comms {
            for (k, kind) in m.kinds().iter().enumerate() {
                for a in 0..MAX_ALGOS {
                    let c = m.calls(k, a);
                    if c.calls.load(Relaxed) == 0 {
                        continue;
                    }
                    let _ = writeln!(
                        out,
                        "{name}{{{},collective=\"{}\",algorithm=\"{}\"}} {}",
                        comm_labels(m, m.net),
                        kind,
                        m.algo_name(a).unwrap_or("none"),
                        pick(c)
                    );
                }
            }
        }
    }
}

/// The per-peer traffic counters (bytes and messages, each way): a row for each
/// communicator and each peer other than the rank itself.
fn write_peer_counter_families(out: &mut String, comms: &[Arc<CommMetrics>]) {
    use std::fmt::Write;
    type PeerPick = fn(&PeerCounters) -> u64;
    let peer_families: [(&str, &str, PeerPick); 4] = [
        (
            "roccl_peer_bytes_sent_total",
            "Payload bytes sent to each peer.",
            |p| p.bytes_sent.load(Relaxed),
        ),
        (
            "roccl_peer_bytes_received_total",
            "Payload bytes received from each peer.",
            |p| p.bytes_received.load(Relaxed),
        ),
        (
            "roccl_peer_messages_sent_total",
            "Messages sent to each peer.",
            |p| p.messages_sent.load(Relaxed),
        ),
        (
            "roccl_peer_messages_received_total",
            "Messages received from each peer.",
            |p| p.messages_received.load(Relaxed),
        ),
    ];
    for (name, help, pick) in peer_families {
        family_header(out, name, help, "counter");
        for m in comms {
            for (peer, p) in m.peers.iter().enumerate() {
                if peer != m.rank {
                    let _ = writeln!(
                        out,
                        "{name}{{{},peer=\"{peer}\"}} {}",
                        comm_labels(m, m.net),
                        pick(p)
                    );
                }
            }
        }
    }
}

/// The per-peer gauges (round-trip time, send throughput): a row only for the peers whose
/// transport has measured the figure yet, since a zero would read as a real measurement.
fn write_peer_gauge_families(out: &mut String, comms: &[Arc<CommMetrics>]) {
    use std::fmt::Write;
    type PeerGauge = fn(&PeerCounters) -> Option<f64>;
    let peer_gauges: [(&str, &str, PeerGauge); 2] = [
        (
            "roccl_peer_rtt_seconds",
            "Round-trip time to each peer as its transport measures it (TCP's smoothed RTT, the RoCE engine's); absent until known.",
            |p| match p.rtt_ns.load(Relaxed) {
                0 => None,
                v => Some(v as f64 / 1e9),
            },
        ),
        (
            "roccl_peer_send_throughput_bytes_per_second",
            "Running estimate of the send throughput to each peer (sends of 64 KiB or more, post to completion); absent until one.",
            |p| match p.throughput_bps.load(Relaxed) {
                0 => None,
                v => Some(v as f64),
            },
        ),
    ];
    for (name, help, pick) in peer_gauges {
        family_header(out, name, help, "gauge");
        for m in comms {
            for (peer, p) in m.peers.iter().enumerate() {
                if let (true, Some(v)) = (peer != m.rank, pick(p)) {
                    let _ = writeln!(
                        out,
                        "{name}{{{},peer=\"{peer}\"}} {v}",
                        comm_labels(m, m.net)
                    );
                }
            }
        }
    }
}

/// How long each communicator's call in flight has gone without progress (0 when none
/// is in flight): the gauge that shows a stuck job from outside.
fn write_waiting_family(out: &mut String, comms: &[Arc<CommMetrics>]) {
    use std::fmt::Write;
    family_header(
        out,
        "roccl_call_waiting_seconds",
        "How long the call in flight has waited without progress (0: none).",
        "gauge",
    );
    for m in comms {
        let f = &m.inflight;
        let started = f.started.load(Relaxed);
        let age = if f.active.load(Relaxed) && started != 0 {
            now_ns().saturating_sub(started) as f64 / 1e9
        } else {
            0.0
        };
        let _ = writeln!(
            out,
            "roccl_call_waiting_seconds{{{}}} {age}",
            comm_labels(m, m.net)
        );
    }
}

/// Each network's own counters, read from the sources the networks added: one family per
/// counter name (`roccl_net_<name>_total`), in order of name, with a row for each
/// communicator and network that reports it.
fn write_net_families(out: &mut String, comms: &[Arc<CommMetrics>]) {
    use std::fmt::Write;
    let mut net_rows: Vec<(&'static str, String, u64)> = Vec::new();
    for m in comms {
        for (net, src) in m.nets.lock().iter() {
            let mut v = Vec::new();
            src(&mut v);
            for (name, value) in v {
                net_rows.push((name, comm_labels(m, net), value));
            }
        }
    }
    net_rows.sort_by(|a, b| a.0.cmp(b.0));
    let mut i = 0;
    while i < net_rows.len() {
        let name = net_rows[i].0;
        let _ = writeln!(
            out,
            "# HELP roccl_net_{name}_total The network's {name} counter."
        );
        let _ = writeln!(out, "# TYPE roccl_net_{name}_total counter");
        while i < net_rows.len() && net_rows[i].0 == name {
            let _ = writeln!(
                out,
                "roccl_net_{name}_total{{{}}} {}",
                net_rows[i].1, net_rows[i].2
            );
            i += 1;
        }
    }
}

/// Every live communicator and its call in flight, as JSON (`/status`).
pub fn status() -> serde_json::Value {
    let comms: Vec<serde_json::Value> = live()
        .iter()
        .map(|m| {
            let f = &m.inflight;
            let inflight = f.active.load(Relaxed).then(|| {
                let started = f.started.load(Relaxed);
                let age = if started == 0 {
                    0
                } else {
                    now_ns().saturating_sub(started)
                };
                serde_json::json!({
                    "collective": m.kind_name(f.kind.load(Relaxed)),
                    "algorithm": m.algo_name(f.algo.load(Relaxed)),
                    "bytes": f.bytes.load(Relaxed),
                    // Since it began to wait (a call that never waited has not run long).
                    "waiting_s": age as f64 / 1e9,
                    "waiting_on": f.waiting.lock().clone(),
                })
            });
            let peers: Vec<serde_json::Value> = m
                .peers
                .iter()
                .enumerate()
                .filter(|(r, _)| *r != m.rank)
                .map(|(r, p)| {
                    let rtt = p.rtt_ns.load(Relaxed);
                    let bps = p.throughput_bps.load(Relaxed);
                    serde_json::json!({
                        "rank": r,
                        "bytes_sent": p.bytes_sent.load(Relaxed),
                        "bytes_received": p.bytes_received.load(Relaxed),
                        "messages_sent": p.messages_sent.load(Relaxed),
                        "messages_received": p.messages_received.load(Relaxed),
                        "rtt_s": (rtt != 0).then(|| rtt as f64 / 1e9),
                        "send_throughput_Bps": (bps != 0).then_some(bps),
                    })
                })
                .collect();
            let calls: u64 = m.calls.iter().map(|c| c.calls.load(Relaxed)).sum();
            // Each network's own counters, by network and name.
            let mut nets = serde_json::Map::new();
            for (net, src) in m.nets.lock().iter() {
                let mut v = Vec::new();
                src(&mut v);
                let counters: serde_json::Map<String, serde_json::Value> = v
                    .into_iter()
                    .map(|(k, n)| (k.to_string(), n.into()))
                    .collect();
                nets.insert(net.to_string(), counters.into());
            }
            let (measured, choices) = {
                let kept = m.measured.lock();
                let rows: Vec<serde_json::Value> = kept
                    .0
                    .iter()
                    .map(|&(hosts, ranks, net, alpha_us, beta_gbs)| {
                        serde_json::json!({
                            "hosts": [hosts.0, hosts.1],
                            "ranks": [ranks.0, ranks.1],
                            "network": net,
                            "latency_us": alpha_us,
                            "bandwidth_GBps": beta_gbs,
                        })
                    })
                    .collect();
                let choices: Vec<serde_json::Value> = kept
                    .1
                    .iter()
                    .map(|(hosts, steps)| {
                        serde_json::json!({
                            "hosts": [hosts.0, hosts.1],
                            "from_bytes": steps.iter().map(|&(f, n)| serde_json::json!([f, n])).collect::<Vec<_>>(),
                        })
                    })
                    .collect();
                (rows, choices)
            };
            serde_json::json!({
                "rank": m.rank,
                "nranks": m.nranks,
                "measured_links": measured,
                "network_by_size": choices,
                "comm": format!("{:016x}", m.comm),
                "network": m.net,
                "pid": std::process::id(),
                "calls": calls,
                "in_flight": inflight,
                "peers": peers,
                "net_counters": nets,
            })
        })
        .collect();
    serde_json::json!({ "communicators": comms })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_reach_the_text_format_and_the_status() {
        let kinds = &["all_reduce", "broadcast", "p2p", "other"];
        let m = CommMetrics::new(1, 3, 0xabcd, "tcp", (kinds, &["ring", "tree"]), None);
        m.call_start(0, 4096);
        m.call_algo(1);
        m.sent(0, 100);
        m.sent(2, 50);
        m.received(2, 70);
        let s = status();
        let me = s["communicators"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["comm"] == "000000000000abcd")
            .unwrap()
            .clone();
        assert_eq!(me["in_flight"]["collective"], "all_reduce");
        assert_eq!(me["in_flight"]["algorithm"], "ring");
        assert!(m
            .waiting_on(&[2, 0, 2], std::time::Duration::from_secs(3600))
            .is_none());
        let w = m.waiting_on(&[2], std::time::Duration::ZERO).unwrap();
        assert!(
            w.contains("waits on rank(s) [2]") && w.contains("all_reduce"),
            "{w}"
        );
        assert!(
            m.waiting_on(&[2], std::time::Duration::ZERO).is_none(),
            "warned once"
        );
        m.call_done();
        let t = prometheus();
        let line = |prefix: &str| {
            t.lines()
                .find(|l| l.starts_with(prefix) && l.contains("comm=\"000000000000abcd\""))
                .map(|l| l.rsplit(' ').next().unwrap().to_string())
        };
        assert_eq!(line("roccl_calls_total{").as_deref(), Some("1"));
        assert!(t.contains("collective=\"all_reduce\",algorithm=\"ring\""));
        assert_eq!(line("roccl_call_bytes_total{").as_deref(), Some("4096"));
        let sent: Vec<&str> = t
            .lines()
            .filter(|l| l.starts_with("roccl_peer_bytes_sent_total{") && l.contains("abcd"))
            .collect();
        assert_eq!(sent.len(), 2, "no line for the rank itself");
        assert!(sent
            .iter()
            .any(|l| l.contains("peer=\"0\"") && l.ends_with(" 100")));
        assert!(t.contains("# TYPE roccl_calls_total counter"));
        drop(m);
        assert!(
            !prometheus().contains("abcd"),
            "a dropped communicator leaves"
        );
    }
}
