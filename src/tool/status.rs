//! `roccl-info --status ADDR...`: read the `/status` of several ranks' metrics endpoints
//! (`ROCCL_METRICS_ADDR`) and say, per communicator, which rank the others are waiting for
//! — the question a hung job asks, answered in one command.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::Value;

/// One rank's view: its communicators (from one endpoint, which may serve several ranks of
/// one process).
pub(crate) struct Seen {
    pub(crate) from: String,
    pub(crate) comms: Vec<Value>,
}

/// The `/status` of the endpoint `addr` (`host:port` or a URL).
pub(crate) fn fetch(addr: &str) -> Result<Seen, String> {
    let url = if addr.starts_with("http://") {
        format!("{}/status", addr.trim_end_matches('/'))
    } else {
        format!("http://{addr}/status")
    };
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(3))
        .build();
    let body = agent
        .get(&url)
        .call()
        .map_err(|e| format!("{url}: {e}"))?
        .into_string()
        .map_err(|e| format!("{url}: {e}"))?;
    let v: Value =
        serde_json::from_str(&body).map_err(|e| format!("{url}: not roccl's status: {e}"))?;
    let comms = v["communicators"]
        .as_array()
        .ok_or_else(|| format!("{url}: no \"communicators\" in the answer"))?
        .clone();
    Ok(Seen {
        from: addr.to_string(),
        comms,
    })
}

/// The report for the endpoints `addrs`: every rank's call in flight, then per
/// communicator the ranks waited on and what they are doing. Endpoints that do not answer
/// are named (their ranks may be dead or stopped).
pub fn report(addrs: &[String]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    // comm -> rank -> (endpoint, the rank's entry)
    let mut by_comm: BTreeMap<String, BTreeMap<u64, (String, Value)>> = BTreeMap::new();
    let mut nranks: BTreeMap<String, u64> = BTreeMap::new();
    for a in addrs {
        match fetch(a) {
            Ok(s) => {
                for c in s.comms {
                    let comm = c["comm"].as_str().unwrap_or("?").to_string();
                    let rank = c["rank"].as_u64().unwrap_or(u64::MAX);
                    nranks.insert(comm.clone(), c["nranks"].as_u64().unwrap_or(0));
                    by_comm
                        .entry(comm)
                        .or_default()
                        .insert(rank, (s.from.clone(), c));
                }
            }
            Err(e) => {
                let _ = writeln!(
                    out,
                    "{a}: no answer ({e}): its ranks may be dead, stopped or unreachable"
                );
            }
        }
    }
    for (comm, ranks) in &by_comm {
        let n = nranks.get(comm).copied().unwrap_or(0);
        let _ = writeln!(
            out,
            "communicator {comm} ({n} ranks, {} answered):",
            ranks.len()
        );
        if let Some(links) = ranks.values().find_map(|(_, c)| measured_links(c)) {
            let _ = writeln!(out, "  links measured at init: {links}");
        }
        let mut waited: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
        for (rank, (from, c)) in ranks {
            let f = &c["in_flight"];
            if f.is_null() {
                let _ = writeln!(
                    out,
                    "  rank {rank} ({from}, pid {}): no call in flight",
                    c["pid"]
                );
                continue;
            }
            let peers: Vec<u64> = f["waiting_on"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default();
            for p in &peers {
                waited.entry(*p).or_default().insert(*rank);
            }
            let _ = writeln!(
                out,
                "  rank {rank} ({from}, pid {}): {} of {} bytes{}, waiting {:.1} s{}",
                c["pid"],
                f["collective"].as_str().unwrap_or("?"),
                f["bytes"],
                f["algorithm"]
                    .as_str()
                    .map(|a| format!(" ({a})"))
                    .unwrap_or_default(),
                f["waiting_s"].as_f64().unwrap_or(0.0),
                if peers.is_empty() {
                    String::new()
                } else {
                    format!(", waiting on rank(s) {peers:?}")
                }
            );
        }
        for (p, by) in &waited {
            let what = match ranks.get(p) {
                None => "did not answer (dead, stopped, or its endpoint was not given)".to_string(),
                Some((_, c)) if c["in_flight"].is_null() => {
                    "is in no call of this communicator (it has not called it yet, or called something else)".to_string()
                }
                Some((_, c)) => format!(
                    "is itself in {}",
                    c["in_flight"]["collective"].as_str().unwrap_or("a call")
                ),
            };
            let _ = writeln!(
                out,
                "  => rank {p} is waited on by rank(s) {:?} and {what}",
                by.iter().collect::<Vec<_>>()
            );
        }
        if waited.is_empty() {
            let _ = writeln!(out, "  => no rank waits on another");
        }
    }
    if by_comm.is_empty() {
        let _ = writeln!(out, "no communicator answered");
    }
    out
}

/// The links between hosts a communicator measured at init (`/status`'s `measured_links`)
/// and the networks it chose by size (`network_by_size`), on one line; `None` when it
/// measured none.
pub(crate) fn measured_links(status: &Value) -> Option<String> {
    let links = status["measured_links"].as_array()?;
    if links.is_empty() {
        return None;
    }
    let mut parts: Vec<String> = links
        .iter()
        .map(|l| {
            let gbs = l["bandwidth_GBps"].as_f64().unwrap_or(0.0);
            let bandwidth = if gbs >= 1.0 {
                format!("{gbs:.2} GB/s")
            } else {
                format!("{:.1} MB/s", gbs * 1e3)
            };
            let net = l["network"]
                .as_str()
                .map_or(String::new(), |n| format!(" {n}"));
            format!(
                "hosts {}↔{}{net} {:.1} us {bandwidth}",
                l["hosts"][0],
                l["hosts"][1],
                l["latency_us"].as_f64().unwrap_or(f64::NAN),
            )
        })
        .collect();
    for c in status["network_by_size"].as_array().into_iter().flatten() {
        let steps: Vec<(usize, &str)> = c["from_bytes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| Some((s[0].as_u64()? as usize, s[1].as_str()?)))
            .collect();
        parts.push(format!(
            "hosts {}↔{} carry {}",
            c["hosts"][0],
            c["hosts"][1],
            crate::comm::describe_steps(&steps)
        ));
    }
    Some(parts.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_measured_links_show_on_one_line() {
        let status = serde_json::json!({
            "measured_links": [
                {"hosts": [0, 1], "ranks": [0, 2], "latency_us": 12.34, "bandwidth_GBps": 1.5},
                {"hosts": [0, 2], "ranks": [0, 4], "latency_us": 40.0, "bandwidth_GBps": 0.125},
            ]
        });
        assert_eq!(
            measured_links(&status).unwrap(),
            "hosts 0↔1 12.3 us 1.50 GB/s; hosts 0↔2 40.0 us 125.0 MB/s"
        );
        let status = serde_json::json!({
            "measured_links": [
                {"hosts": [0, 1], "ranks": [0, 2], "network": "tcp", "latency_us": 12.34, "bandwidth_GBps": 0.1},
                {"hosts": [0, 1], "ranks": [0, 2], "network": "rocev2", "latency_us": 30.0, "bandwidth_GBps": 2.5},
            ],
            "network_by_size": [{"hosts": [0, 1], "from_bytes": [[0, "tcp"], [49152, "rocev2"]]}],
        });
        assert_eq!(
            measured_links(&status).unwrap(),
            "hosts 0↔1 tcp 12.3 us 100.0 MB/s; hosts 0↔1 rocev2 30.0 us 2.50 GB/s; hosts 0↔1 carry tcp below 48 KiB, rocev2 from 48 KiB"
        );
        assert_eq!(
            measured_links(&serde_json::json!({"measured_links": []})),
            None
        );
        assert_eq!(measured_links(&serde_json::json!({})), None);
    }
}
