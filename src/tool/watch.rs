//! `roccl-info --watch ADDR...`: a live view of the ranks behind several metrics endpoints
//! (`ROCCL_METRICS_ADDR`), refreshed every interval: per rank and peer the transport's
//! round-trip time, the send throughput estimate, the bytes and messages per second since
//! the last refresh, the call in flight, and the rates of the networks' own counters that
//! moved (retransmissions, spurious ones, timeouts, NAKs, sleeps...).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::status::fetch;

/// Per (communicator, rank, peer): bytes sent, bytes received, messages sent and received.
type Totals = BTreeMap<(String, u64, u64), [u64; 4]>;
/// Per (communicator, rank): calls completed.
type Calls = BTreeMap<(String, u64), u64>;
/// Per (communicator, rank, network, counter): the network's counter.
type NetCounters = BTreeMap<(String, u64, String, String), u64>;

/// One look at every endpoint.
pub struct Snapshot {
    at: Instant,
    comms: Vec<(String, Value)>,
    failed: Vec<String>,
    totals: Totals,
    calls: Calls,
    nets: NetCounters,
}

/// Read every endpoint's `/status` now.
pub fn snapshot(addrs: &[String]) -> Snapshot {
    let mut comms = Vec::new();
    let mut failed = Vec::new();
    for a in addrs {
        match fetch(a) {
            Ok(s) => comms.extend(s.comms.into_iter().map(|c| (s.from.clone(), c))),
            Err(e) => failed.push(format!("{a}: no answer ({e})")),
        }
    }
    let mut totals = Totals::new();
    let mut calls = Calls::new();
    let mut nets = NetCounters::new();
    for (_, c) in &comms {
        let comm = c["comm"].as_str().unwrap_or("?").to_string();
        let rank = c["rank"].as_u64().unwrap_or(u64::MAX);
        calls.insert((comm.clone(), rank), c["calls"].as_u64().unwrap_or(0));
        for (net, counters) in c["net_counters"].as_object().into_iter().flatten() {
            for (name, v) in counters.as_object().into_iter().flatten() {
                let key = (comm.clone(), rank, net.clone(), name.clone());
                nets.insert(key, v.as_u64().unwrap_or(0));
            }
        }
        for p in c["peers"].as_array().into_iter().flatten() {
            let n = |k: &str| p[k].as_u64().unwrap_or(0);
            totals.insert(
                (comm.clone(), rank, n("rank")),
                [
                    n("bytes_sent"),
                    n("bytes_received"),
                    n("messages_sent"),
                    n("messages_received"),
                ],
            );
        }
    }
    Snapshot {
        at: Instant::now(),
        comms,
        failed,
        totals,
        calls,
        nets,
    }
}

/// The counters of (`comm`, `rank`)'s networks that moved since `prev`, as per-second
/// rates: `rocev2: retransmits 12/s, spurious_retransmits 12/s`.
fn net_rates(prev: &Snapshot, cur: &Snapshot, dt: f64, comm: &str, rank: u64) -> String {
    let mut by_net: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    if !prev.calls.contains_key(&(comm.to_string(), rank)) {
        return String::new(); // not seen before: no rate yet
    }
    let lo = (comm.to_string(), rank, String::new(), String::new());
    for ((c, r, net, name), &now) in cur.nets.range(lo..) {
        if c != comm || *r != rank {
            break;
        }
        let key = (c.clone(), *r, net.clone(), name.clone());
        // A counter that was not there yet started at zero.
        let before = prev.nets.get(&key).copied().unwrap_or(0);
        if now > before {
            by_net.entry(net).or_default().push(format!(
                "{name} {}/s",
                rate((now - before) as f64 / dt).trim_end()
            ));
        }
    }
    by_net
        .iter()
        .map(|(net, v)| format!("{net}: {}", v.join(", ")))
        .collect::<Vec<_>>()
        .join("; ")
}

fn rate(v: f64) -> String {
    match v {
        v if v >= 1e9 => format!("{:.2} G", v / 1e9),
        v if v >= 1e6 => format!("{:.2} M", v / 1e6),
        v if v >= 1e3 => format!("{:.1} k", v / 1e3),
        v => format!("{v:.0} "),
    }
}

/// The view of `cur`, with rates since `prev` (none on the first refresh).
pub fn render(prev: Option<&Snapshot>, cur: &Snapshot) -> String {
    let mut out = String::new();
    let dt = prev.map(|p| cur.at.duration_since(p.at).as_secs_f64().max(1e-3));
    for f in &cur.failed {
        let _ = writeln!(out, "{f}: its ranks may be dead, stopped or unreachable");
    }
    let mut by_comm: BTreeMap<&str, Vec<(&str, &Value)>> = BTreeMap::new();
    for (from, c) in &cur.comms {
        by_comm
            .entry(c["comm"].as_str().unwrap_or("?"))
            .or_default()
            .push((from, c));
    }
    for (comm, mut ranks) in by_comm {
        ranks.sort_by_key(|(_, c)| c["rank"].as_u64());
        let first = ranks[0].1;
        let _ = writeln!(
            out,
            "communicator {comm}: {} ranks over {}, {} answered",
            first["nranks"],
            first["network"].as_str().unwrap_or("?"),
            ranks.len()
        );
        if let Some(links) = super::status::measured_links(first) {
            let _ = writeln!(out, "  links measured at init: {links}");
        }
        let _ = writeln!(
            out,
            "  {:>4} {:>4} {:>10} {:>11} {:>11} {:>11} {:>9} {:>9}",
            "rank", "peer", "rtt", "est. send", "sent/s", "recv/s", "msgs/s", "calls/s"
        );
        for (from, c) in ranks {
            let rank = c["rank"].as_u64().unwrap_or(u64::MAX);
            let calls = c["calls"].as_u64().unwrap_or(0);
            let calls_s = match (prev, dt) {
                (Some(p), Some(dt)) => p
                    .calls
                    .get(&(comm.to_string(), rank))
                    .map(|&b| rate(calls.saturating_sub(b) as f64 / dt)),
                _ => None,
            };
            let peers = c["peers"].as_array().cloned().unwrap_or_default();
            for (i, p) in peers.iter().enumerate() {
                let peer = p["rank"].as_u64().unwrap_or(u64::MAX);
                let rtt = p["rtt_s"]
                    .as_f64()
                    .map_or("-".to_string(), |s| format!("{:.1} us", s * 1e6));
                let est = p["send_throughput_Bps"]
                    .as_f64()
                    .map_or("-".to_string(), |b| format!("{}B/s", rate(b)));
                let key = (comm.to_string(), rank, peer);
                let (sent, recv, msgs) = match (prev.and_then(|p| p.totals.get(&key)), dt) {
                    (Some(b), Some(dt)) => {
                        let now = cur.totals.get(&key).copied().unwrap_or_default();
                        let d = |k: usize| now[k].saturating_sub(b[k]) as f64 / dt;
                        (
                            format!("{}B", rate(d(0))),
                            format!("{}B", rate(d(1))),
                            rate(d(2) + d(3)),
                        )
                    }
                    _ => ("-".into(), "-".into(), "-".into()),
                };
                let calls_col = if i == 0 {
                    calls_s.clone().unwrap_or_else(|| "-".into())
                } else {
                    String::new()
                };
                let _ = writeln!(
                    out,
                    "  {rank:>4} {peer:>4} {rtt:>10} {est:>11} {sent:>11} {recv:>11} {msgs:>9} {calls_col:>9}"
                );
            }
            if let (Some(p), Some(dt)) = (prev, dt) {
                let moved = net_rates(p, cur, dt, comm, rank);
                if !moved.is_empty() {
                    let _ = writeln!(out, "  rank {rank} network counters: {moved}");
                }
            }
            let f = &c["in_flight"];
            let on: Vec<u64> = f["waiting_on"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default();
            if !f.is_null() {
                let _ = writeln!(
                    out,
                    "  rank {rank} ({from}): in {} of {} bytes, {}",
                    f["collective"].as_str().unwrap_or("?"),
                    f["bytes"],
                    if on.is_empty() {
                        "running".to_string()
                    } else {
                        format!(
                            "waiting {:.1} s on rank(s) {on:?}",
                            f["waiting_s"].as_f64().unwrap_or(0.0)
                        )
                    }
                );
            }
        }
    }
    if cur.comms.is_empty() {
        let _ = writeln!(out, "no communicator answered");
    }
    out
}

/// Refresh every `interval`, `count` times (forever with `None`), printing each view (after
/// clearing the terminal when standard output is one).
pub fn run(addrs: &[String], interval: Duration, count: Option<u64>) {
    use std::io::IsTerminal;
    let tty = std::io::stdout().is_terminal();
    let mut prev: Option<Snapshot> = None;
    let mut n = 0u64;
    loop {
        let cur = snapshot(addrs);
        let view = render(prev.as_ref(), &cur);
        let head = format!(
            "roccl-info --watch: {} endpoint(s), every {:.1} s{}",
            addrs.len(),
            interval.as_secs_f64(),
            if tty { " (Ctrl-C ends)" } else { "" }
        );
        if tty {
            super::print_line(format_args!("\x1b[H\x1b[2J{head}\n{}", view.trim_end()));
        } else {
            super::print_line(format_args!("{head}\n{}", view.trim_end()));
        }
        prev = Some(cur);
        n += 1;
        if count.is_some_and(|c| n >= c) {
            return;
        }
        std::thread::sleep(interval);
    }
}
