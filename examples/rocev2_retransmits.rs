//! How often the userspace RoCE v2 engine retransmits on a clean loopback link: two ranks
//! (threads) run many small all-reduces over `rocev2`, optionally beside busy threads that
//! load the cores, and the engines' counters are printed at the end.
//!
//! ```text
//! cargo run --release --example rocev2_retransmits -- [--iters N] [--bytes B] [--busy K]
//! ```
//!
//! A clean link loses nothing, so every retransmission it shows is spurious: an
//! acknowledgement that came later than the sender's timer (a descheduled peer). The line
//! printed sums each counter over both ranks' `roccl_net_*_total` rows.

use std::sync::atomic::{AtomicBool, Ordering};

use clap::Parser;
use roccl::net::NetKind;
use roccl::{Communicator, Config, RedOp, UniqueId};

#[derive(Parser)]
struct Args {
    /// All-reduces to run.
    #[arg(long, default_value_t = 2000)]
    iters: usize,
    /// Bytes per all-reduce (f32 elements × 4).
    #[arg(long, default_value_t = 8)]
    bytes: usize,
    /// Busy-looping threads to run beside the ranks (load on the cores).
    #[arg(long, default_value_t = 0)]
    busy: usize,
}

const COUNTERS: [&str; 6] = [
    "retransmits",
    "spurious_retransmits",
    "timeouts",
    "tail_probes",
    "duplicates",
    "out_of_sequence",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    let mut cfg = Config::from_env()?;
    cfg.net = NetKind::RoceV2;
    let id = UniqueId::new()?;
    let stop = AtomicBool::new(false);
    let text = std::sync::Mutex::new(String::new());
    let start = std::time::Instant::now();
    std::thread::scope(|s| {
        for _ in 0..a.busy {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            });
        }
        let ranks: Vec<_> = (0..2)
            .map(|r| {
                let (cfg, text, a) = (cfg.clone(), &text, &a);
                s.spawn(move || -> roccl::Result<()> {
                    let c = Communicator::init_with(&id, 2, r, cfg)?;
                    let mut v = vec![1f32; (a.bytes / 4).max(1)];
                    for _ in 0..a.iters {
                        c.all_reduce_in_place(&mut v, RedOp::Sum)?;
                    }
                    c.barrier()?;
                    if r == 0 {
                        *text.lock().unwrap() = roccl::metrics::prometheus();
                    }
                    c.barrier()
                })
            })
            .collect();
        let results: Vec<_> = ranks.into_iter().map(|h| h.join()).collect();
        stop.store(true, Ordering::Relaxed);
        for (r, res) in results.into_iter().enumerate() {
            match res {
                Ok(Ok(())) => {}
                Ok(Err(e)) => eprintln!("rank {r}: {e}"),
                Err(_) => eprintln!("rank {r} panicked"),
            }
        }
    });
    let text = text.into_inner().unwrap();
    let mut line = format!(
        "iters={} bytes={} busy={} time={:.2}s",
        a.iters,
        a.bytes,
        a.busy,
        start.elapsed().as_secs_f64()
    );
    for name in COUNTERS {
        let prefix = format!("roccl_net_{name}_total{{");
        let total: f64 = text
            .lines()
            .filter(|l| l.starts_with(&prefix) && l.contains("network=\"rocev2\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
            + 0.0;
        line.push_str(&format!(" {name}={total}"));
    }
    println!("{line}");
    Ok(())
}
