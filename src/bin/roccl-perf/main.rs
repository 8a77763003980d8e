//! roccl-perf: nccl-tests style benchmark with correctness checking.
//!
//! `roccl-perf --op all_reduce --ranks 4` spawns 4 local rank processes; launched by
//! torchrun/srun/mpirun (or with ROCCL_RANK/ROCCL_NRANKS/ROCCL_ROOT) it joins as one rank.
//! Short flags mean what they mean in nccl-tests (`-n` iterations, `-w` warm-up, ...: see
//! `args`). Sizes are total buffer bytes as in nccl-tests; each size runs out of place and
//! in place, printed side by side. `time` is the median over iterations of the slowest
//! rank's time (`-a` picks another rank statistic; the JSON has the mean, min, p99 and
//! max too); busbw uses nccl-tests' factors. `--plot OUT.svg RUN.json...` draws runs.

mod args;
mod bench;
mod plot;
mod report;

use std::process::{Command, ExitCode};
use std::sync::Arc;

use clap::Parser;
use roccl::comm::stream::ops;
use roccl::device::fake_gpu::FakeGpu;
use roccl::device::{self, Device};
use roccl::tool::launch::{self, Outcome};
use roccl::{CallOpts, Communicator, DataType, RedOp, UniqueId};

use args::{check_args, Args, Op, Plan};
use bench::{Bench, DevStream};
use report::{Doc, Header, Row, Stats, Table};

/// Set in the environment of the ranks `--ranks N` starts.
const LAUNCHED: &str = "ROCCL_PERF_LAUNCHED";

/// A line on standard output; a closed standard output ends the program quietly.
macro_rules! outln {
    ($($t:tt)*) => {
        roccl::tool::print_line(format_args!($($t)*))
    };
}

/// A line on standard error, in one write (the ranks of a job share it).
macro_rules! errln {
    ($($t:tt)*) => {
        roccl::tool::print_error(format_args!($($t)*))
    };
}

/// `--device`: the runtime (bound to this thread) and a new stream.
fn open_device(a: &Args) -> Result<Option<DevStream>, String> {
    let name = match (&a.device, a.stream) {
        (Some(d), _) => d.as_str(),
        (None, true) => "sim-apu",
        (None, false) => return Ok(None),
    };
    let dev: Arc<dyn Device> = match name {
        "sim" | "sim-apu" => {
            let d = FakeGpu::new(std::time::Duration::ZERO);
            d.set_integrated(name == "sim-apu");
            d
        }
        rt => device::open_runtime(rt).map_err(|e| format!("--device {rt}: {e}"))?,
    };
    dev.bind_thread().map_err(|e| e.to_string())?;
    let s = dev.create_stream().map_err(|e| e.to_string())?;
    Ok(Some((dev, s)))
}

/// One rank's whole run: check the arguments, set up the benchmark on the communicator,
/// print the preamble, sweep every size of every asked collective, then report. Returns
/// whether every checked result was right.
fn rank_main(c: Communicator, a: &Args) -> Result<bool, String> {
    let local = if std::env::var_os(LAUNCHED).is_some() {
        c.nranks()
    } else {
        1
    };
    let plan = check_args(a, c.nranks(), local)?;
    let c = Arc::new(c);
    let base = Bench {
        c: &c,
        a,
        dt: plan.dts[0],
        op: plan.redops[0],
        opts: CallOpts {
            algo: plan.algo,
            ..Default::default()
        },
        dev: open_device(a)?,
        inplace: false,
    };
    let lead = c.rank() == 0;
    let table = Table { stats: a.stats };
    let header = run_header(&base, &plan);
    if lead {
        print_preamble(&base, &header, &table)?;
    }
    let (rows, ok) = sweep(&base, &plan, &table, lead)?;
    if a.counters {
        print_counters(&c);
    }
    if lead {
        report_results(a, header, rows)?;
    }
    Ok(ok)
}

/// The run's settings as the JSON report records them, gathered once so that the printed
/// preamble and the written file agree.
fn run_header(base: &Bench, plan: &Plan) -> Header {
    let (c, a) = (base.c, base.a);
    Header {
        ranks: c.nranks(),
        net: c.net_name().into(),
        device: base.dev.as_ref().map(|(d, _)| d.name().to_string()),
        ops: plan.ops.iter().map(|o| o.name().to_string()).collect(),
        dtypes: plan.dts.iter().map(|d| d.name().to_string()).collect(),
        redops: plan.redops.iter().map(|r| r.name().to_string()).collect(),
        algo: a.algo.clone(),
        minbytes: a.minbytes.clone(),
        maxbytes: a.maxbytes.clone(),
        step: a.step_text(),
        iters: a.iters,
        warmup: a.warmup,
        check: a.check,
        blocking: a.blocking == 1,
        average: a.average,
        timeout_s: roccl::comm::timeout().as_secs_f64(),
        cycles: a.cycles,
    }
}

/// Rank 0's lines before the results: roccl's own summary of the run, the line in
/// nccl-tests' format that tools parsing its output expect, and the table's header.
fn print_preamble(base: &Bench, header: &Header, table: &Table) -> Result<(), String> {
    let (c, a) = (base.c, base.a);
    outln!(
        "# roccl-perf: version {}, {} ranks, net {}{}, dtype {}, redop {}, iters {}, warmup {}, {}, check {}, {}",
        env!("CARGO_PKG_VERSION"),
        c.nranks(),
        c.net_name(),
        match &base.dev {
            Some((d, _)) => format!(
                ", {} device buffers, stream-ordered (chunk {})",
                d.name(),
                ops::stream_chunk().map_err(|e| e.to_string())?
            ),
            None => String::new(),
        },
        header.dtypes.join(","),
        header.redops.join(","),
        a.iters,
        a.warmup,
        match a.placements() {
            (true, true) => "out of place and in place",
            (true, false) => "out of place",
            _ => "in place",
        },
        match a.check {
            0 => "off".to_string(),
            1 => "on".to_string(),
            k => format!("on ({k} calls)"),
        },
        if a.blocking == 1 { "blocking" } else { "non-blocking" }
    );
    outln!(
        "# nThread 1 nGpus 1 minBytes {} maxBytes {} step: {} warmup iters: {} iters: {} agg iters: 1 validation: {} graph: 0 blocking: {} average: {} timeout: {}s",
        args::sizes(a)?.first().copied().unwrap_or(0),
        args::sizes(a)?.last().copied().unwrap_or(0),
        header.step,
        a.warmup,
        a.iters,
        a.check.min(1),
        a.blocking,
        a.average,
        header.timeout_s
    );
    outln!("#");
    for l in table.header() {
        outln!("{l}");
    }
    Ok(())
}

/// Every cycle over every collective, data type, reduction and size, rank 0 printing a
/// table row per size as it goes. Returns the results and whether all were right.
fn sweep(base: &Bench, plan: &Plan, table: &Table, lead: bool) -> Result<(Vec<Row>, bool), String> {
    let a = base.a;
    let mut rows = Vec::new();
    let mut ok = true;
    let mut cycle = 0;
    while a.cycles == 0 || cycle < a.cycles {
        cycle += 1;
        for &o in &plan.ops {
            let list: Vec<usize> = if o == Op::Barrier {
                vec![0]
            } else {
                plan.sizes.clone()
            };
            for &dt in &plan.dts {
                // A reduction matters only to collectives that reduce.
                let reds = if o.reduces() {
                    &plan.redops[..]
                } else {
                    &plan.redops[..1]
                };
                for &red in reds {
                    for &s in &list {
                        let got = measure_size(base, o, dt, red, s)?;
                        ok &= got.iter().flatten().all(|row| row.wrong.unwrap_or(0) == 0);
                        if lead {
                            outln!("{}", table.row(got[0].as_ref(), got[1].as_ref()));
                        }
                        rows.extend(got.into_iter().flatten());
                    }
                }
            }
        }
    }
    Ok((rows, ok))
}

/// One size of one collective, out of place then in place as the arguments ask (a
/// collective without an in-place form runs in place only when out of place is not asked
/// for): the two halves of one table row.
fn measure_size(
    base: &Bench,
    o: Op,
    dt: DataType,
    red: RedOp,
    s: usize,
) -> Result<[Option<Row>; 2], String> {
    let (do_out, do_in) = base.a.placements();
    let mut got = [None, None];
    for (k, inplace) in [false, true].into_iter().enumerate() {
        let wanted = if inplace { do_in } else { do_out };
        if !wanted || (inplace && !o.has_inplace() && do_out) {
            continue;
        }
        let b = Bench {
            dt,
            op: red,
            inplace,
            ..base.clone()
        };
        let m = b.run(o, s).map_err(|e| {
            format!(
                "{} {} at {s} bytes: {e}",
                o.name(),
                if inplace { "in place" } else { "out of place" }
            )
        })?;
        got[k] = Some(make_row(&b, o, m));
    }
    Ok(got)
}

/// Rank 0's closing lines (errors found, average bus bandwidth, bytes staged when device
/// buffers were used), and `--json`: the whole run written to a file.
fn report_results(a: &Args, header: Header, rows: Vec<Row>) -> Result<(), String> {
    for l in report::closing(&rows, a.check > 0) {
        outln!("{l}");
    }
    if a.device.is_some() || a.stream {
        // Device memory the CPU cannot reach is staged, except what went GPU-direct.
        outln!(
            "# bytes staged through pinned host buffers (rank 0, in and out): {}",
            roccl::comm::stream::ops::staged_bytes()
        );
    }
    if let Some(path) = &a.json {
        let doc = Doc {
            tool: "roccl-perf",
            version: env!("CARGO_PKG_VERSION"),
            header,
            wrong_total: (a.check > 0).then(|| rows.iter().filter_map(|r| r.wrong).sum()),
            avg_busbw_gbs: report::avg_busbw(&rows),
            results: rows,
        };
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("writing {path}: {e}"))?;
    }
    Ok(())
}

/// The result of one measurement, as printed and written.
fn make_row(b: &Bench, o: Op, m: bench::Measured) -> Row {
    let n = b.c.nranks();
    let stats = Stats::of(&m.times);
    let algbw = m.bytes as f64 / stats.time_us / 1e3;
    Row {
        op: o.name(),
        bytes: m.bytes,
        count: m.count,
        dtype: b.dt.name().into(),
        redop: if o.reduces() {
            b.op.name().into()
        } else {
            "none".into()
        },
        root: if o.rooted() { b.a.root as i64 } else { -1 },
        algo: m.algo,
        net: b.c.net_name().into(),
        ranks: n,
        inplace: b.inplace,
        blocking: b.a.blocking == 1,
        iters: m.times.len(),
        stats,
        algbw_gbs: algbw,
        busbw_gbs: algbw * o.bus_factor(n),
        wrong: m.wrong,
    }
}

/// `--counters`: this rank's network counters that are not zero, a line per network.
fn print_counters(c: &Communicator) {
    for (net, counters) in c.net_counters() {
        let moved: Vec<String> = counters
            .iter()
            .filter(|(_, n)| *n != 0)
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        outln!(
            "# network counters, rank {} ({net}): {}",
            c.rank(),
            moved.join(", ")
        );
    }
}

fn launched_by_env() -> bool {
    [
        "ROCCL_RANK",
        "RANK",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
    ]
    .iter()
    .any(|k| std::env::var_os(k).is_some())
}

fn main() -> ExitCode {
    let a = Args::parse();
    if let Some(out) = &a.plot {
        return match plot::plot(out, &a.files) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                errln!("roccl-perf: error: {e}");
                ExitCode::from(2)
            }
        };
    }
    if let Some(t) = a.timeout.filter(|t| *t > 0.0 && t.is_finite()) {
        // The communicator's timeout; the ranks `--ranks` starts inherit it.
        std::env::set_var("ROCCL_TIMEOUT", t.to_string());
    }
    if let Ok(cpu) = std::env::var("ROCCL_PERF_CPU") {
        // Set by our own launcher: stay on one CPU so that the kernel does not pull
        // communicating ranks onto the same core when they sleep.
        if let Err(e) = cpu
            .parse::<usize>()
            .map_err(|e| e.to_string())
            .and_then(|c| roccl::os::bind_to_cpu(c).map_err(|e| e.to_string()))
        {
            errln!("roccl-perf: warning: could not bind to CPU {cpu}: {e}");
        }
    }
    if a.net == "sim" {
        errln!("roccl-perf: error: --net sim: the simulated network runs every rank as a thread of one process, which roccl-sim does (same flags: roccl-sim --ranks {} --op ... -b ... -e ...; --sim for the cluster)", a.ranks);
        return ExitCode::from(2);
    }
    if a.net != "auto" {
        std::env::set_var("ROCCL_NET", &a.net);
    }
    if let Some(t) = &a.trace {
        // Every rank (those --ranks starts inherit it) writes its own file.
        std::env::set_var("ROCCL_TRACE", t);
    }
    if std::env::var_os(LAUNCHED).is_some() {
        // Our launcher ends the job quietly when rank 0 finds standard output closed.
        roccl::tool::set_closed_stdout_status(roccl::tool::EXIT_STDOUT_CLOSED);
    }
    // Errors of a rank of several name it: the ranks of a job share standard error.
    let res = if launched_by_env() {
        match Communicator::from_env() {
            Ok(c) => {
                let who = format!("rank {} of {}: ", c.rank(), c.nranks());
                rank_main(c, &a).map_err(|e| format!("{who}{e}"))
            }
            Err(e) => Err(match std::env::var("ROCCL_RANK") {
                Ok(r) => format!("rank {r}: {e}"),
                Err(_) => e.to_string(),
            }),
        }
    } else if a.ranks == 0 {
        Err("--ranks 0: a job needs at least one rank".into())
    } else if a.ranks == 1 {
        UniqueId::new()
            .and_then(|id| Communicator::init(&id, 1, 0))
            .map_err(|e| e.to_string())
            .and_then(|c| rank_main(c, &a))
    } else {
        launch(&a)
    };
    match res {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            errln!("roccl-perf: error: {e}");
            ExitCode::from(2)
        }
    }
}

/// Spawn `--ranks` copies of this program as the ranks of one communicator whose root runs
/// here; rank 0 prints. The job ends as soon as one rank fails (`roccl::tool::launch`).
fn launch(a: &Args) -> Result<bool, String> {
    check_args(a, a.ranks, a.ranks)?;
    roccl::comm::settings::check_with(&roccl::envvar::from_process).map_err(|e| e.to_string())?;
    let id = UniqueId::new().map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| format!("finding roccl-perf's own path: {e}"))?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cpus = roccl::os::allowed_cpus().unwrap_or_default();
    let bind = match a.bind.as_str() {
        "auto" => a.ranks <= cpus.len(),
        "none" => false,
        other => return Err(format!("--bind {other}: expected auto or none")),
    };
    if let Some(h) = a.hosts {
        if h == 0 || h > a.ranks {
            return Err(format!(
                "--hosts {h}: expected 1 to {} (the number of ranks)",
                a.ranks
            ));
        }
    }
    let mut cmds = Vec::new();
    for r in 0..a.ranks {
        let mut cmd = Command::new(&exe);
        if let Some(h) = a.hosts {
            // Consecutive ranks share a host, as evenly as the counts allow.
            let host = r * h / a.ranks;
            cmd.env("ROCCL_HOSTID", format!("perf-host-{host}"));
        }
        if let Some(cpu) = cpus.get(r).filter(|_| bind) {
            cmd.env("ROCCL_PERF_CPU", cpu.to_string());
        }
        cmd.args(&args)
            .env(LAUNCHED, "1")
            .env("ROCCL_UNIQUE_ID", id.to_hex())
            .env("ROCCL_RANK", r.to_string())
            .env("ROCCL_NRANKS", a.ranks.to_string())
            .stdout(if r == 0 {
                std::process::Stdio::inherit()
            } else {
                std::process::Stdio::null()
            });
        cmds.push(cmd);
    }
    match launch::run(cmds)? {
        Outcome::Done { all_ok } => Ok(all_ok),
        Outcome::StdoutClosed => std::process::exit(0),
        Outcome::Failed(e) => Err(e),
        Outcome::Signalled(sig) => std::process::exit(128 + sig),
    }
}
