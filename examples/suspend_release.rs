//! What a suspend gives back and what resuming costs: ranks (threads of this process) run
//! all-reduces, then all suspend as `ncclCommSuspend(…, NCCL_SUSPEND_MEM)` does
//! (`release_memory`, then `close_idle_connections`), and the first call after resume is
//! timed against the steady state.
//!
//! ```text
//! cargo run --release --example suspend_release -- [--net tcp|rocev2] [--ranks N] [--bytes B]
//! ```
//!
//! Prints the process's resident memory before and after the suspend, the connections
//! closed, the suspend's time, and the first and the median later all-reduce.

use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use roccl::net::NetKind;
use roccl::{Communicator, Config, RedOp, UniqueId};

#[derive(Parser)]
struct Args {
    /// Network between the ranks.
    #[arg(long, default_value = "rocev2")]
    net: NetKind,
    /// Ranks (threads).
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    /// Bytes per all-reduce (f32 elements × 4).
    #[arg(long, default_value_t = 1 << 20)]
    bytes: usize,
    /// Milliseconds to wait after the suspend before reading the resident memory.
    #[arg(long, default_value_t = 0)]
    settle_ms: u64,
}

/// This process's resident memory, in KiB (`VmRSS`).
fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn main() {
    let a = Args::parse();
    let id = UniqueId::new().expect("unique id");
    let met = Barrier::new(a.ranks);
    let rss = Mutex::new((0u64, 0u64));
    let times = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for r in 0..a.ranks {
            let (id, met, rss, times, a) = (&id, &met, &rss, &times, &a);
            s.spawn(move || {
                let mut cfg = Config::from_env().expect("settings");
                cfg.net = a.net;
                let c = Communicator::init_with(id, a.ranks, r, cfg).expect("init");
                let mut x = vec![1f32; a.bytes / 4];
                let call = |x: &mut [f32]| {
                    let t = Instant::now();
                    c.all_reduce_in_place(x, RedOp::Sum).expect("all-reduce");
                    t.elapsed()
                };
                for _ in 0..20 {
                    call(&mut x);
                }
                met.wait();
                if r == 0 {
                    rss.lock().unwrap().0 = rss_kib();
                }
                let (open_s, open_r) = c.open_connections();
                met.wait();
                let t = Instant::now();
                let released = c.release_memory();
                let k = c
                    .close_idle_connections(Duration::from_secs(1))
                    .expect("suspend");
                let took = t.elapsed();
                met.wait();
                if r == 0 {
                    std::thread::sleep(Duration::from_millis(a.settle_ms));
                    roccl::os::mem::trim_heap();
                    rss.lock().unwrap().1 = rss_kib();
                }
                met.wait();
                let first = call(&mut x);
                let mut later: Vec<Duration> = (0..20).map(|_| call(&mut x)).collect();
                later.sort();
                times.lock().unwrap().push((
                    r,
                    open_s + open_r,
                    k.closed,
                    released.bytes,
                    took,
                    first,
                    later[later.len() / 2],
                ));
            });
        }
    });
    let (before, after) = *rss.lock().unwrap();
    println!(
        "{} ranks over {:?}, {} B all-reduces: resident memory {} MiB before the suspend, {} MiB after ({} MiB given back)",
        a.ranks,
        a.net,
        a.bytes,
        before / 1024,
        after / 1024,
        (before.saturating_sub(after)) / 1024
    );
    let mut t = times.into_inner().unwrap();
    t.sort_by_key(|x| x.0);
    for (r, open, closed, bytes, took, first, median) in t {
        println!(
            "rank {r}: closed {closed} of {open} connections, freed {bytes} B of buffers, suspend took {took:.1?}; first all-reduce after {first:.1?}, then median {median:.1?}"
        );
    }
}
