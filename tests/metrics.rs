//! The counters and the metrics endpoint (issue 24), scraped over HTTP while jobs run:
//! exact bytes for a fixed sequence of sends, call counts by collective, bytes conserved
//! between ranks, the RoCE v2 retransmission counter under injected loss and zero without,
//! and `/status` naming the peer a waiting call waits on.
//!
//! One test: it sets `ROCCL_METRICS_ADDR` and `ROCCL_ROCEV2_FAULTS` for the process, which
//! no other test of this file may see changing.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::*;
use roccl::algo::model::Tuning;
use roccl::bootstrap::UniqueId;
use roccl::net::NetKind;
use roccl::{Communicator, RedOp};

/// GET `path` from the endpoint; the body.
fn get(addr: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    let (head, body) = r.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

/// The samples of family `name` for communicator `comm`: labels → value.
fn samples(text: &str, name: &str, comm: &str) -> Vec<(HashMap<String, String>, f64)> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter_map(|l| {
            let (labels, value) = l[name.len() + 1..].split_once("} ")?;
            let map: HashMap<String, String> = labels
                .split(',')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.trim_matches('"').to_string()))
                .collect();
            (map["comm"] == comm).then(|| (map, value.parse().unwrap()))
        })
        .collect()
}

fn sum(s: &[(HashMap<String, String>, f64)], want: &[(&str, &str)]) -> f64 {
    s.iter()
        .filter(|(m, _)| {
            want.iter()
                .all(|(k, v)| m.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, v)| v)
        .sum()
}

fn cfg(net: NetKind) -> roccl::Config {
    let mut c = config(Tuning::default());
    c.net = net;
    c.waiter.timeout = Duration::from_secs(30);
    c
}

/// This process's `/status` entry of communicator `hex`'s rank `rank`.
fn own_status(hex: &str, rank: u64) -> serde_json::Value {
    let status: serde_json::Value =
        serde_json::from_str(&get(roccl::metrics::http::address().unwrap(), "/status")).unwrap();
    status["communicators"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["comm"] == hex && x["rank"] == rank)
        .cloned()
        .unwrap_or_else(|| panic!("no communicator {hex} rank {rank} in {status}"))
}

/// Every rank's communicator hash (equal on all).
fn comm_hex(c: &Communicator) -> String {
    format!("{:016x}", c.id_hash())
}

#[test]
fn metrics_count_what_jobs_do_and_status_names_whom_a_call_waits_on() {
    std::env::set_var("ROCCL_METRICS_ADDR", "127.0.0.1:0");
    std::env::set_var("ROCCL_STUCK_WARN", "0.3");

    // 1. A fixed sequence over TCP: exact point-to-point bytes, call counts, conservation.
    let id = UniqueId::new().unwrap();
    let hex = std::sync::Mutex::new(String::new());
    run_ranks_of(id, 3, cfg(NetKind::Tcp), |c| {
        *hex.lock().unwrap() = comm_hex(&c);
        for _ in 0..10 {
            let mut v = vec![1f32; 1000];
            c.all_reduce_in_place(&mut v, RedOp::Sum).unwrap();
        }
        for _ in 0..3 {
            let mut g = vec![0f32; 3 * 500];
            c.all_gather(&vec![c.rank() as f32; 500], &mut g).unwrap();
        }
        // Rank 0 sends rank 1 four messages of 4000 bytes.
        for _ in 0..4 {
            match c.rank() {
                0 => c.send(&[7u8; 4000], 1).unwrap(),
                1 => c.recv(&mut [0u8; 4000], 0).unwrap(),
                _ => {}
            }
        }
        c.barrier().unwrap();
        if c.rank() == 0 {
            let addr = roccl::metrics::http::address().expect("the endpoint serves");
            let t = get(addr, "/metrics");
            let comm = hex.lock().unwrap().clone();
            let calls = samples(&t, "roccl_calls_total", &comm);
            for r in ["0", "1", "2"] {
                assert_eq!(
                    sum(&calls, &[("rank", r), ("collective", "all_reduce")]),
                    10.0,
                    "rank {r}\n{t}"
                );
                assert_eq!(
                    sum(&calls, &[("rank", r), ("collective", "all_gather")]),
                    3.0
                );
            }
            assert_eq!(sum(&calls, &[("rank", "0"), ("collective", "p2p")]), 4.0);
            assert_eq!(sum(&calls, &[("rank", "2"), ("collective", "p2p")]), 0.0);
            let bytes = samples(&t, "roccl_call_bytes_total", &comm);
            assert_eq!(
                sum(&bytes, &[("rank", "1"), ("collective", "all_reduce")]),
                40_000.0
            );
            let sent = samples(&t, "roccl_peer_bytes_sent_total", &comm);
            let recv = samples(&t, "roccl_peer_bytes_received_total", &comm);
            // Every byte sent from a to b was received by b from a.
            for a in ["0", "1", "2"] {
                for b in ["0", "1", "2"].into_iter().filter(|b| *b != a) {
                    let s = sum(&sent, &[("rank", a), ("peer", b)]);
                    let r = sum(&recv, &[("rank", b), ("peer", a)]);
                    assert_eq!(s, r, "{a} -> {b}");
                    assert!(s > 0.0, "{a} -> {b} moved nothing");
                }
            }
            // The TCP network's own counters: every rank set up connections.
            let conns = samples(&t, "roccl_net_connections_total", &comm);
            for r in ["0", "1", "2"] {
                assert!(
                    sum(&conns, &[("rank", r), ("network", "tcp")]) >= 2.0,
                    "rank {r}\n{t}"
                );
            }
            assert!(t.contains("roccl_net_short_writes_total{"), "{t}");
            let status: serde_json::Value = serde_json::from_str(&get(addr, "/status")).unwrap();
            let mine: Vec<_> = status["communicators"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|x| x["comm"] == comm.as_str())
                .collect();
            assert_eq!(mine.len(), 3, "{status}");
        }
        c.barrier().unwrap();
    });

    // 1b. Idle connections by the hundred at the endpoint: before, each took a thread of
    // the process (tiny_http) and kept it; now one thread serves at most 16 connections,
    // the oldest giving way, and a scrape still gets its answer.
    let addr = roccl::metrics::http::address().unwrap();
    assert!(addr.ip().is_loopback(), "{addr}");
    let threads = || {
        std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find_map(|l| {
                l.strip_prefix("Threads:")
                    .map(|v| v.trim().parse::<usize>().unwrap())
            })
            .unwrap()
    };
    let before = threads();
    let idle: Vec<TcpStream> = (0..200)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        threads() <= before + 2,
        "{before} threads before, {} with 200 idle connections",
        threads()
    );
    assert!(get(addr, "/metrics").contains("roccl_calls_total"));
    drop(idle);

    // 2. Sends alone: the byte counters are exact.
    let id = UniqueId::new().unwrap();
    run_ranks_of(id, 2, cfg(NetKind::Tcp), |c| {
        for k in 0..5 {
            let n = 1000 * (k + 1);
            match c.rank() {
                0 => c.send(&vec![1u8; n], 1).unwrap(),
                _ => c.recv(&mut vec![0u8; n], 0).unwrap(),
            }
        }
        let hex = comm_hex(&c);
        let mut token = [0u8; 1];
        // Rank 1 scrapes once everything arrived (its last receive completed).
        if c.rank() == 1 {
            let t = get(roccl::metrics::http::address().unwrap(), "/metrics");
            let sent = samples(&t, "roccl_peer_bytes_sent_total", &hex);
            let recv = samples(&t, "roccl_peer_bytes_received_total", &hex);
            let msgs = samples(&t, "roccl_peer_messages_received_total", &hex);
            assert_eq!(sum(&sent, &[("rank", "0"), ("peer", "1")]), 15_000.0, "{t}");
            assert_eq!(sum(&recv, &[("rank", "1"), ("peer", "0")]), 15_000.0);
            assert_eq!(sum(&msgs, &[("rank", "1"), ("peer", "0")]), 5.0);
            assert_eq!(sum(&sent, &[("rank", "1"), ("peer", "0")]), 0.0);
            c.send(&token, 0).unwrap();
        } else {
            c.recv(&mut token, 1).unwrap();
        }
    });

    // 2b. The live view (roccl-info --watch): per-peer round-trip time (TCP's, read from
    // the socket), a send throughput estimate from the big sends, rates between two looks.
    let id = UniqueId::new().unwrap();
    run_ranks_of(id, 2, cfg(NetKind::Tcp), |c| {
        let hex = comm_hex(&c);
        let burst = |c: &Communicator| {
            for _ in 0..20 {
                match c.rank() {
                    0 => c.send(&vec![1u8; 1 << 20], 1).unwrap(),
                    _ => c.recv(&mut vec![0u8; 1 << 20], 0).unwrap(),
                }
            }
        };
        burst(&c);
        c.barrier().unwrap();
        let addr = roccl::metrics::http::address().unwrap().to_string();
        let before =
            (c.rank() == 0).then(|| roccl::tool::watch::snapshot(std::slice::from_ref(&addr)));
        burst(&c);
        c.barrier().unwrap();
        if let Some(before) = before {
            let after = roccl::tool::watch::snapshot(&[addr]);
            let view = roccl::tool::watch::render(Some(&before), &after);
            let block: String = view
                .split("communicator ")
                .find(|b| b.starts_with(&hex))
                .unwrap_or_else(|| panic!("{view}"))
                .to_string();
            let row = block
                .lines()
                .find(|l| l.split_whitespace().take(2).eq(["0", "1"]))
                .unwrap_or_else(|| panic!("no row of rank 0 to peer 1:\n{view}"));
            let cols: Vec<&str> = row.split_whitespace().collect();
            assert!(row.contains(" us ") && row.contains("B/s"), "{row}\n{view}");
            // 20 MiB moved between the two looks.
            assert!(
                cols.iter()
                    .any(|c| c.starts_with("MB") || c.starts_with("GB")),
                "{row}"
            );
            let me = own_status(&hex, 0);
            let peer = &me["peers"][0];
            assert_eq!(peer["rank"], 1, "{me}");
            assert_eq!(peer["bytes_sent"], 40u64 << 20, "{me}");
            let rtt = peer["rtt_s"].as_f64().expect("an RTT from the TCP socket");
            assert!(rtt > 0.0 && rtt < 1.0, "{me}");
            let bps = peer["send_throughput_Bps"]
                .as_f64()
                .expect("a throughput estimate");
            assert!(bps > 1e7, "{me}");
        }
        c.barrier().unwrap();
    });

    // 2c. Shared memory's own counters: a receiver that waits long enough sleeps and its
    // sender rings its doorbell; a collective through the shared segments that waits sleeps
    // on a futex and the late rank wakes it.
    let id = UniqueId::new().unwrap();
    run_ranks_of(id, 2, cfg(NetKind::Shm), |c| {
        let hex = comm_hex(&c);
        let mut b = [0u8; 64];
        // Connections open on first use: one exchange first, so the receiver's wait below is
        // spent on the ring (where it sleeps) and not in accepting the connection.
        if c.rank() == 1 {
            c.send(&b, 0).unwrap();
        } else {
            c.recv(&mut b, 1).unwrap();
        }
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(300));
            c.send(&b, 0).unwrap();
            std::thread::sleep(Duration::from_millis(300));
        } else {
            c.recv(&mut b, 1).unwrap();
        }
        let mut v = [1f32; 16];
        c.all_reduce_in_place(&mut v, RedOp::Sum).unwrap();
        assert_eq!(v, [2f32; 16]);
        c.barrier().unwrap();
        if c.rank() == 0 {
            let t = get(roccl::metrics::http::address().unwrap(), "/metrics");
            let n = |name: &str, r: &str| {
                sum(&samples(&t, name, &hex), &[("rank", r), ("network", "shm")])
            };
            assert!(n("roccl_net_sleeps_total", "0") >= 1.0, "{t}");
            assert!(n("roccl_net_wakeups_total", "1") >= 1.0, "{t}");
            assert!(c.shm_collectives(), "no shared segments");
            assert!(n("roccl_net_node_sleeps_total", "0") >= 1.0, "{t}");
            assert!(n("roccl_net_node_wakeups_total", "1") >= 1.0, "{t}");
        }
        c.barrier().unwrap();
    });

    // 3. A call that waits: /status names the peer it waits on, and the stuck warning
    // fires (ROCCL_STUCK_WARN=0.3).
    let id = UniqueId::new().unwrap();
    run_ranks_of(id, 2, cfg(NetKind::Tcp), |c| {
        let hex = comm_hex(&c);
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1500));
        } else {
            let watcher = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(900));
                let addr = roccl::metrics::http::address().unwrap();
                let s = get(addr, "/status");
                // What roccl-info --status prints from it.
                let report = roccl::tool::status::report(&[addr.to_string()]);
                assert!(
                    report.contains("rank 1 is waited on by rank(s) [0]"),
                    "{report}"
                );
                let v: serde_json::Value = serde_json::from_str(&s).unwrap();
                v["communicators"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|x| x["comm"] == hex.as_str() && x["rank"] == 0)
                    .cloned()
                    .unwrap()
            });
            let mut v = vec![1f32; 100];
            c.all_reduce_in_place(&mut v, RedOp::Sum).unwrap();
            let me = watcher.join().unwrap();
            let f = &me["in_flight"];
            assert_eq!(f["collective"], "all_reduce", "{me}");
            assert_eq!(f["waiting_on"], serde_json::json!([1]), "{me}");
            assert!(f["waiting_s"].as_f64().unwrap() > 0.5, "{me}");
        }
        if c.rank() == 1 {
            let mut v = vec![1f32; 100];
            c.all_reduce_in_place(&mut v, RedOp::Sum).unwrap();
        }
    });

    // An endpoint that does not answer is named, not an error of the report.
    let r = roccl::tool::status::report(&["127.0.0.1:1".to_string()]);
    assert!(r.contains("127.0.0.1:1: no answer"), "{r}");

    // 4. RoCE v2: no packet lost on a clean link, some under injected loss.
    // (retransmissions, out-of-sequence packets, sequence NAKs sent, received, spurious
    // retransmissions) of a job.
    let retransmits = |faults: Option<&str>| -> (f64, f64, f64, f64, f64) {
        match faults {
            Some(f) => std::env::set_var("ROCCL_ROCEV2_FAULTS", f),
            None => std::env::remove_var("ROCCL_ROCEV2_FAULTS"),
        }
        let id = UniqueId::new().unwrap();
        let total = std::sync::Mutex::new((0.0, 0.0, 0.0, 0.0, 0.0));
        run_ranks_of(id, 2, cfg(NetKind::RoceV2), |c| {
            let addr = roccl::metrics::http::address().unwrap().to_string();
            let watch = || roccl::tool::watch::snapshot(std::slice::from_ref(&addr));
            c.barrier().unwrap();
            let before = (faults.is_some() && c.rank() == 0).then(watch);
            // Small calls: a clean loopback link drops none of their few packets.
            for _ in 0..20 {
                let mut v = vec![1f32; 2048];
                c.all_reduce_in_place(&mut v, RedOp::Sum).unwrap();
            }
            c.barrier().unwrap();
            // The live view shows the rates of the network's counters that moved.
            if let Some(before) = before {
                let view = roccl::tool::watch::render(Some(&before), &watch());
                let line = view
                    .lines()
                    .find(|l| l.contains("rank 0 network counters: rocev2: "))
                    .unwrap_or_else(|| panic!("no network counters:\n{view}"));
                assert!(line.contains(" retransmits "), "{line}");
                let me = own_status(&comm_hex(&c), 0);
                let n = &me["net_counters"]["rocev2"];
                assert!(n["retransmits"].as_u64() > Some(0), "{me}");
                assert!(n["spurious_retransmits"].is_u64(), "{me}");
            }
            let me = c.rank().to_string();
            // A late resend at the very end is reported spurious a moment later (the
            // peer's duplicate report is on its way): on the clean link, read again until
            // the counts agree or 2 s pass.
            let t0 = std::time::Instant::now();
            let t = loop {
                let t = get(roccl::metrics::http::address().unwrap(), "/metrics");
                let n = |name| sum(&samples(&t, name, &comm_hex(&c)), &[("rank", &me)]);
                let settled =
                    n("roccl_net_retransmits_total") == n("roccl_net_spurious_retransmits_total");
                if faults.is_some() || settled || t0.elapsed() > Duration::from_secs(2) {
                    break t;
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            let s = samples(&t, "roccl_net_retransmits_total", &comm_hex(&c));
            let o = samples(&t, "roccl_net_out_of_sequence_total", &comm_hex(&c));
            let ns = samples(&t, "roccl_net_seq_naks_sent_total", &comm_hex(&c));
            let nr = samples(&t, "roccl_net_seq_naks_received_total", &comm_hex(&c));
            let sp = samples(&t, "roccl_net_spurious_retransmits_total", &comm_hex(&c));
            assert!(
                !s.is_empty() && !o.is_empty() && !ns.is_empty() && !sp.is_empty(),
                "no RoCE counters: {t}"
            );
            {
                let mut tot = total.lock().unwrap();
                tot.0 += sum(&s, &[("rank", &me)]);
                tot.1 += sum(&o, &[("rank", &me)]);
                tot.2 += sum(&ns, &[("rank", &me)]);
                tot.3 += sum(&nr, &[("rank", &me)]);
                tot.4 += sum(&sp, &[("rank", &me)]);
            }
            c.barrier().unwrap();
        });
        std::env::remove_var("ROCCL_ROCEV2_FAULTS");
        total.into_inner().unwrap()
    };
    // A clean loopback link loses nothing, so no packet arrives out of sequence and every
    // retransmission there is one the peer reports it already had (on loaded cores an
    // acknowledgement can come later than the tail-loss probe): retransmissions less
    // spurious ones are zero. Lost packets are retransmitted, leave gaps, and are not
    // spurious.
    let clean = retransmits(None);
    let lossy = retransmits(Some("drop=0.2,seed=7"));
    eprintln!("(retransmissions, out of sequence, sequence NAKs sent, received, spurious retransmissions): clean link {clean:?}, 20 % loss {lossy:?}");
    assert_eq!(
        (clean.0 - clean.4, clean.1, clean.2),
        (0.0, 0.0, 0.0),
        "lost packets, out-of-sequence packets or NAKs on a clean link: {clean:?}"
    );
    assert!(lossy.0 - lossy.4 > 0.0, "no lost packet resent: {lossy:?}");
    // Gaps are NAKed, and the NAKs reach the sender (a NAK may itself be lost).
    assert!(
        lossy.0 > 0.0 && lossy.1 > 0.0 && lossy.2 > 0.0 && lossy.3 > 0.0,
        "{lossy:?}"
    );
}
