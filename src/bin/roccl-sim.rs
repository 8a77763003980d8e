//! roccl-sim: the real communicator, executor and algorithms at up to thousands of ranks,
//! every rank a thread of this process, over the simulated network (`ROCCL_NET=sim`). Each
//! collective's time is predicted by the link model (`--sim`, as `ROCCL_SIM`), not
//! measured; every rank's output is checked. Prints an nccl-tests style table.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use roccl::net::sim::{SimSpec, SIM_KEYS};
use roccl::tool::thread_job::{self, SimCase, SimJob, SimOp};
use roccl::Algo;

#[derive(Parser, Debug)]
#[command(
    name = "roccl-sim",
    version,
    about = "Predict roccl collectives on a simulated cluster: every rank a thread, virtual time from a link model, every result checked",
    after_help = "Times are the link model's predictions (virtual time), not measurements. \
The cluster: --sim or ROCCL_SIM, comma-separated name=value (hosts, ranks_per_host, nics, nic_gbps, \
nic_us, local_gbps, local_us, msg_us, reduce_gbs, data); data=0 moves no bytes (lengths and times only), \
for sizes whose buffers would not fit in memory, and leaves results unchecked (N/A); ranks sit on hosts in rank order, and each \
rank's host is its host for the topology (ring orders, hierarchical calls), as ROCCL_HOSTID."
)]
struct Args {
    /// Ranks (threads of this process).
    #[arg(long, default_value_t = 64)]
    ranks: usize,
    /// The simulated cluster (as ROCCL_SIM), e.g.
    /// hosts=128,ranks_per_host=8,nic_gbps=100,nic_us=2,local_gbps=200,local_us=0.5.
    #[arg(long)]
    sim: Option<String>,
    /// Collectives, comma-separated: all_reduce, all_gather, reduce_scatter, broadcast,
    /// reduce, all_to_all, barrier (all: every one).
    #[arg(long, default_value = "all_reduce", value_delimiter = ',')]
    op: Vec<String>,
    /// Algorithms, comma-separated: auto (the cost model's choice), ring, tree, direct,
    /// doubling, twoshot, hier (by host), bruck; one a collective does not have is skipped.
    #[arg(long, default_value = "auto", value_delimiter = ',')]
    algo: Vec<String>,
    /// Smallest size in bytes (K/M/G suffixes).
    #[arg(long, short = 'b', default_value = "8")]
    minbytes: String,
    /// Largest size in bytes.
    #[arg(long, short = 'e', default_value = "1M")]
    maxbytes: String,
    /// Size multiplication factor.
    #[arg(long, short = 'f', default_value_t = 4)]
    stepfactor: usize,
    /// Timed calls per size.
    #[arg(long, short = 'n', default_value_t = 3)]
    iters: usize,
    /// Untimed calls per size (they open the connections).
    #[arg(long, short = 'w', default_value_t = 1)]
    warmup: usize,
    /// Run in place (one buffer per rank for input and output; all-reduce, all-gather,
    /// reduce-scatter, reduce): half the memory, for the largest sizes.
    #[arg(long)]
    in_place: bool,
    /// Time limit of every wait, in seconds.
    #[arg(long, short = 'T', default_value_t = 300.0)]
    timeout: f64,
}

/// The algorithms each collective has over the network (forcing another one makes the
/// communicator fall back to its model, with a warning: not a case worth printing).
fn has(op: SimOp, a: Algo) -> bool {
    match op {
        SimOp::AllReduce => matches!(
            a,
            Algo::Ring
                | Algo::Tree
                | Algo::Direct
                | Algo::Doubling
                | Algo::TwoShot
                | Algo::Hier
                | Algo::Bruck
        ),
        SimOp::Broadcast | SimOp::Reduce => matches!(a, Algo::Ring | Algo::Tree | Algo::Hier),
        SimOp::AllGather | SimOp::ReduceScatter => {
            matches!(a, Algo::Ring | Algo::Hier | Algo::Bruck)
        }
        SimOp::AllToAll | SimOp::Barrier => false,
    }
}

fn main() -> ExitCode {
    let a = Args::parse();
    match run(&a) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            roccl::tool::print_error(format_args!("roccl-sim: error: {e}"));
            ExitCode::from(2)
        }
    }
}

fn run(a: &Args) -> Result<bool, String> {
    let spec: SimSpec = match a.sim.clone().or_else(|| std::env::var("ROCCL_SIM").ok()) {
        Some(s) => s
            .parse()
            .map_err(|e| format!("--sim {s}: {e} (names: {SIM_KEYS})"))?,
        None => SimSpec::default(),
    };
    let bytes = |s: &str| {
        roccl::envvar::parse_bytes(s)
            .ok_or_else(|| format!("'{s}': expected bytes such as 8, 64K or 1M"))
    };
    let (lo, hi) = (bytes(&a.minbytes)?, bytes(&a.maxbytes)?);
    if a.stepfactor < 2 {
        return Err("-f: the factor must be at least 2".into());
    }
    let mut ops = Vec::new();
    for o in &a.op {
        if o == "all" {
            ops.extend(SimOp::ALL);
        } else {
            ops.push(SimOp::parse(o).ok_or_else(|| format!("--op {o}: unknown collective"))?);
        }
    }
    let mut algos = Vec::new();
    for s in &a.algo {
        algos.push(match s.as_str() {
            "auto" => None,
            other => Some(
                other
                    .parse::<Algo>()
                    .map_err(|e| format!("--algo {other}: {e}"))?,
            ),
        });
    }
    let mut sizes = Vec::new();
    let mut s = lo.max(4);
    while s <= hi {
        sizes.push(s);
        s *= a.stepfactor;
    }
    let mut cases = Vec::new();
    for &op in &ops {
        let sz: &[usize] = if op == SimOp::Barrier { &[0] } else { &sizes };
        for &algo in &algos {
            if algo.is_some_and(|x| !has(op, x)) {
                continue;
            }
            for &bytes in sz {
                cases.push(SimCase {
                    op,
                    algo,
                    bytes,
                    warmup: a.warmup,
                    iters: a.iters.max(1),
                    in_place: a.in_place,
                });
            }
        }
    }
    let job = SimJob {
        ranks: a.ranks,
        spec: spec.clone(),
        timeout: Duration::from_secs_f64(a.timeout.max(1.0)),
    };
    let out = |s: String| roccl::tool::print_line(format_args!("{s}"));
    out(format!(
        "# roccl-sim: version {}, {} ranks as threads, simulated cluster {spec} ({} host(s)); times are the link model's predictions, not measurements",
        env!("CARGO_PKG_VERSION"),
        a.ranks,
        a.ranks.div_ceil(spec.ranks_per_host)
    ));
    out(format!(
        "# {:>14} {:>12} {:>9} {:>12} {:>12} {:>9} {:>9} {:>7}",
        "op", "size(B)", "algo", "time(us)", "fastest(us)", "algbw", "busbw", "#wrong"
    ));
    let started = std::time::Instant::now();
    let (results, init) = thread_job::run_timed(&job, &cases).map_err(|e| e.to_string())?;
    out(format!(
        "# {} communicators made in {:.2} s of real time (threads started, rendezvous over loopback TCP, table received)",
        a.ranks,
        init.as_secs_f64()
    ));
    let mut ok = true;
    for r in &results {
        let us = r.time.as_secs_f64() * 1e6;
        let algbw = if us > 0.0 {
            r.bytes as f64 / us / 1e3
        } else {
            0.0
        };
        ok &= r.wrong.unwrap_or(0) == 0;
        out(format!(
            "  {:>14} {:>12} {:>9} {:>12.2} {:>12.2} {:>9.2} {:>9.2} {:>7}",
            r.case.op.name(),
            r.bytes,
            r.algo.map_or("-", Algo::name),
            us,
            r.fastest.as_secs_f64() * 1e6,
            algbw,
            algbw * r.case.op.bus_factor(a.ranks),
            r.wrong.map_or("N/A".into(), |w| w.to_string())
        ));
    }
    let checked = if spec.data {
        format!(
            "{} wrong element(s) over all ranks",
            results.iter().filter_map(|r| r.wrong).sum::<usize>()
        )
    } else {
        "nothing checked (data=0: no bytes moved)".into()
    };
    out(format!(
        "# {} case(s), {checked}; simulated in {:.1} s of real time",
        results.len(),
        started.elapsed().as_secs_f64()
    ));
    Ok(ok)
}
