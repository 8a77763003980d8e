//! roccl-perf's command line: nccl-tests' short flags with their meaning there, roccl's own
//! long ones, and the checks made before any rank starts.

use clap::builder::{PossibleValue, PossibleValuesParser};
use clap::Parser;
use roccl::algo::model::CollKind;
use roccl::net::NetKind;
use roccl::{Algo, DataType, RedOp};

#[derive(Parser, Debug, Clone)]
#[command(
    name = "roccl-perf",
    version,
    about = "Benchmark and check roccl collectives (nccl-tests style)",
    after_help = "Short flags mean what they mean in nccl-tests (-n iterations, -w warm-up, \
-c check, -o reduction, -d data type, -r root, -b/-e/-i/-f sizes, -z blocking, -T timeout, \
-a average, -N cycles, -J JSON); the rank count is --ranks. \
`roccl-perf --plot OUT.svg RUN.json...` draws runs' --json files."
)]
pub struct Args {
    /// Collectives to run, comma-separated (all: every one).
    #[arg(long, default_value = "all_reduce", value_delimiter = ',', value_parser = PossibleValuesParser::new(op_names()))]
    pub op: Vec<String>,
    /// Local rank processes to spawn (ignored when launched by torchrun/srun/mpirun).
    #[arg(long, default_value_t = 1)]
    pub ranks: usize,
    /// Network (as ROCCL_NET): auto (shared memory between ranks of one host, to other hosts
    /// verbs where a usable NIC exists, else tcp), tcp, rocev2 (the userspace RoCE v2 engine
    /// over UDP), verbs (RoCE v2 NIC; built with --features verbs), shm (one host), sim
    /// (the simulated network: run by `roccl-sim`, its ranks threads of one process).
    #[arg(long, default_value = "auto", value_parser = PossibleValuesParser::new(NETS.map(net_name)))]
    pub net: String,
    /// Algorithm (as ROCCL_ALGO); one a collective does not have is replaced by the cost
    /// model's choice, with a warning.
    #[arg(long, default_value = "auto", value_parser = PossibleValuesParser::new(algo_names()))]
    pub algo: String,
    /// Data types, comma-separated: roccl's names or nccl-tests' (float, half, double,
    /// bfloat16, int8, ...); all: every one.
    #[arg(long, short = 'd', visible_alias = "datatype", default_value = "f32", value_delimiter = ',', value_parser = PossibleValuesParser::new(dtype_values()))]
    pub dtype: Vec<String>,
    /// Reductions, comma-separated (sum, prod, min, max, avg); all: every one.
    #[arg(long, short = 'o', default_value = "sum", value_delimiter = ',', value_parser = PossibleValuesParser::new(RedOp::ALL.map(RedOp::name).into_iter().chain(["all"])))]
    pub redop: Vec<String>,
    /// Root of broadcast and reduce.
    #[arg(long, short = 'r', default_value_t = 0)]
    pub root: usize,
    /// Smallest size in bytes (K/M/G suffixes).
    #[arg(long, short = 'b', default_value = "8")]
    pub minbytes: String,
    /// Largest size in bytes.
    #[arg(long, short = 'e', default_value = "64M")]
    pub maxbytes: String,
    /// Size increment (used when -f is 1 or not given with -i).
    #[arg(long, short = 'i')]
    pub stepbytes: Option<String>,
    /// Size multiplication factor (4 unless -i is given).
    #[arg(long, short = 'f')]
    pub stepfactor: Option<usize>,
    /// Timed iterations per size.
    #[arg(long, short = 'n', default_value_t = 20)]
    pub iters: usize,
    /// Untimed iterations per size.
    #[arg(long, short = 'w', visible_alias = "warmup_iters", default_value_t = 5)]
    pub warmup: usize,
    /// Only in place (default: out of place and in place, side by side).
    #[arg(long, conflicts_with = "out_of_place")]
    pub inplace: bool,
    /// Only out of place.
    #[arg(long)]
    pub out_of_place: bool,
    /// Checked calls per size and placement: 0 skips checking (#wrong is N/A), N checks N
    /// calls after the timed ones (--check alone: 1; true/false as 1/0).
    #[arg(long, short = 'c', default_value = "1", num_args = 0..=1, default_missing_value = "1", value_parser = parse_check)]
    pub check: u32,
    /// Also check the result of every warm-up and timed call (its output poisoned before
    /// it, so a call that wrote nothing is seen too), not only one call after them: for
    /// tests of faults during traffic (slower; host buffers only, not with --device).
    #[arg(long)]
    pub check_iters: bool,
    /// 1: each timed call returns once done (roccl's host calls); 0: the iterations are
    /// issued without waiting and waited for together (nccl-tests' default), each timed to
    /// its completion.
    #[arg(long, short = 'z', default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub blocking: u8,
    /// Time limit in seconds of every wait (the communicator's timeout: ROCCL_TIMEOUT).
    #[arg(long, short = 'T')]
    pub timeout: Option<f64>,
    /// The time of an iteration across ranks: 0 rank 0's, 1 the mean, 2 the fastest rank's,
    /// 3 the slowest rank's (default; nccl-tests' default is 1).
    #[arg(long, short = 'a', default_value_t = 3, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub average: u8,
    /// Run every size this many times (0: until stopped).
    #[arg(long, short = 'N', visible_alias = "run_cycles", default_value_t = 1)]
    pub cycles: usize,
    /// Also print each placement's per-iteration statistics: min, median, p99 and max (us).
    #[arg(long)]
    pub stats: bool,
    /// At the end, print each rank's network counters that are not zero (RoCE v2:
    /// packets, retransmissions, NAKs, ICRC errors...).
    #[arg(long)]
    pub counters: bool,
    /// Write the header, every result and the summary as JSON to FILE.
    #[arg(long, short = 'J', visible_alias = "output_file")]
    pub json: Option<String>,
    /// Write a Chrome trace (Perfetto, chrome://tracing) per rank to this path, `%r` replaced
    /// by the rank (sets ROCCL_TRACE; join the files with scripts/trace-merge.py).
    #[arg(long, value_name = "PATH")]
    pub trace: Option<String>,
    /// Bind spawned ranks to CPUs: auto (one CPU each when there are enough), none.
    #[arg(long, default_value = "auto")]
    pub bind: String,
    /// Pretend the spawned ranks are on this many hosts (consecutive ranks share one; each
    /// rank gets ROCCL_HOSTID=perf-host-H): shared memory inside a host, the network between
    /// hosts, hierarchical calls and host-ordered rings, all on this machine.
    #[arg(long, value_name = "N")]
    pub hosts: Option<usize>,
    /// Buffers in GPU memory and stream-ordered calls, timed from the call until the stream
    /// has passed it: hip, cuda, sim (the simulated device, memory the CPU cannot access:
    /// staged through pinned buffers) or sim-apu (simulated integrated GPU: used in place).
    #[arg(long)]
    pub device: Option<String>,
    /// Same as --device sim-apu.
    #[arg(long)]
    pub stream: bool,
    /// Draw the --json files given after it (latency and bus bandwidth against size, one
    /// line per run) into this SVG file, and run nothing.
    #[arg(long, value_name = "OUT.svg")]
    pub plot: Option<String>,
    /// With --plot: the runs' JSON files (a label for each may follow as FILE=LABEL).
    #[arg(requires = "plot")]
    pub files: Vec<String>,
    /// nccl-tests' threads per process: roccl runs one rank per process (1 only).
    #[arg(long, short = 't', visible_alias = "nthreads", default_value_t = 1)]
    pub nthreads: u32,
    /// nccl-tests' GPUs per thread: 1 only (--ranks N for local ranks).
    #[arg(long, short = 'g', visible_alias = "ngpus", default_value_t = 1)]
    pub ngpus: u32,
    /// nccl-tests' calls aggregated per iteration: 1 only.
    #[arg(long, short = 'm', visible_alias = "agg_iters", default_value_t = 1)]
    pub agg_iters: u32,
    /// nccl-tests' parallel init: ranks here always start in parallel (0 and 1 accepted).
    #[arg(
        long,
        short = 'p',
        visible_alias = "parallel_init",
        default_value_t = 0
    )]
    pub parallel_init: u32,
    /// nccl-tests' CUDA graphs: 0 only (roccl has no graphs).
    #[arg(long, short = 'G', visible_alias = "cudagraph", default_value_t = 0)]
    pub cudagraph: u32,
    /// nccl-tests' CPU-time report: 0 only (times here are wall-clock times of the calls).
    #[arg(
        long,
        short = 'C',
        visible_alias = "report_cputime",
        default_value_t = 0
    )]
    pub report_cputime: u32,
    /// nccl-tests' null stream: 0 only (--device creates its stream).
    #[arg(long, short = 'y', visible_alias = "stream_null", default_value_t = 0)]
    pub stream_null: u32,
    /// nccl-tests' buffer registration: 0 only (roccl registers nothing ahead).
    #[arg(
        long,
        short = 'R',
        visible_alias = "local_register",
        default_value_t = 0
    )]
    pub local_register: u32,
}

/// `-c`: a count of checked calls, or true/false.
fn parse_check(s: &str) -> Result<u32, String> {
    match s {
        "true" => Ok(1),
        "false" => Ok(0),
        _ => s
            .parse()
            .map_err(|_| format!("'{s}': expected 0 (no check), 1 or a count of checked calls")),
    }
}

/// Every network `--net` offers (a new kind of network fails to compile in [`NetKind::name`]).
pub const NETS: [NetKind; 6] = [
    NetKind::Auto,
    NetKind::Tcp,
    NetKind::RoceV2,
    NetKind::Verbs,
    NetKind::Shm,
    NetKind::Sim,
];

/// The name `--net` and ROCCL_NET give a network.
pub fn net_name(k: NetKind) -> &'static str {
    k.name()
}

/// `--algo`'s values: auto and every algorithm.
fn algo_names() -> Vec<&'static str> {
    std::iter::once("auto")
        .chain(Algo::ALL.iter().map(|a| a.name()))
        .collect()
}

/// `--op`'s values: every collective and all.
fn op_names() -> Vec<&'static str> {
    ALL_OPS.iter().map(|o| o.name()).chain(["all"]).collect()
}

fn parse_size(s: &str) -> Result<usize, String> {
    roccl::envvar::parse_bytes(s).ok_or_else(|| format!("bad size '{s}': use e.g. 8, 64K, 16M, 1G"))
}

/// nccl-tests' data type names and roccl's for the same type.
const NCCL_TYPES: [(&str, &str); 12] = [
    ("int8", "i8"),
    ("char", "i8"),
    ("uint8", "u8"),
    ("int32", "i32"),
    ("int", "i32"),
    ("uint32", "u32"),
    ("int64", "i64"),
    ("uint64", "u64"),
    ("half", "f16"),
    ("float", "f32"),
    ("double", "f64"),
    ("bfloat16", "bf16"),
];

/// `-d`'s values: every data type (nccl-tests' names as aliases) and all.
fn dtype_values() -> Vec<PossibleValue> {
    DataType::ALL
        .iter()
        .map(|d| {
            let aliases = NCCL_TYPES.iter().filter(|t| t.1 == d.name()).map(|t| t.0);
            PossibleValue::new(d.name()).aliases(aliases)
        })
        .chain([PossibleValue::new("all")])
        .collect()
}

fn parse_dtypes(list: &[String]) -> Result<Vec<DataType>, String> {
    if list.iter().any(|x| x == "all") {
        return Ok(DataType::ALL.to_vec());
    }
    list.iter()
        .map(|x| {
            let x = x.trim();
            let name = NCCL_TYPES
                .iter()
                .find(|(n, _)| *n == x)
                .map_or(x, |(_, r)| *r);
            name.parse::<DataType>().map_err(|_| {
                format!(
                    "-d {x}: expected all or one of {} (or nccl-tests' {})",
                    DataType::ALL.map(DataType::name).join(", "),
                    NCCL_TYPES.map(|t| t.0).join(", ")
                )
            })
        })
        .collect()
}

fn parse_redops(list: &[String]) -> Result<Vec<RedOp>, String> {
    if list.iter().any(|x| x == "all") {
        return Ok(RedOp::ALL.to_vec());
    }
    list.iter()
        .map(|x| {
            x.trim().parse::<RedOp>().map_err(|_| {
                format!(
                    "-o {x}: expected all or one of {}",
                    RedOp::ALL.map(RedOp::name).join(", ")
                )
            })
        })
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Op {
    AllReduce,
    AllGather,
    Broadcast,
    ReduceScatter,
    Reduce,
    AllToAll,
    SendRecv,
    Barrier,
}

pub const ALL_OPS: [Op; 8] = [
    Op::AllReduce,
    Op::AllGather,
    Op::Broadcast,
    Op::ReduceScatter,
    Op::Reduce,
    Op::AllToAll,
    Op::SendRecv,
    Op::Barrier,
];

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
            Op::ReduceScatter => "reduce_scatter",
            Op::Reduce => "reduce",
            Op::AllToAll => "all_to_all",
            Op::SendRecv => "sendrecv",
            Op::Barrier => "barrier",
        }
    }
    fn parse(list: &[String]) -> Result<Vec<Op>, String> {
        if list.iter().any(|x| x == "all") {
            return Ok(ALL_OPS.to_vec());
        }
        list.iter()
            .map(|x| {
                ALL_OPS
                    .iter()
                    .copied()
                    .find(|o| o.name() == x.trim())
                    .ok_or_else(|| {
                        format!(
                            "unknown op '{x}': expected one of {}",
                            op_names().join(", ")
                        )
                    })
            })
            .collect()
    }
    pub fn reduces(self) -> bool {
        matches!(self, Op::AllReduce | Op::ReduceScatter | Op::Reduce)
    }
    pub fn rooted(self) -> bool {
        matches!(self, Op::Broadcast | Op::Reduce)
    }
    /// Whether the collective has an in-place form (a send-receive pair and a barrier do not).
    pub fn has_inplace(self) -> bool {
        !matches!(self, Op::SendRecv | Op::Barrier)
    }
    /// nccl-tests bus bandwidth factor.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather | Op::ReduceScatter | Op::AllToAll => (n - 1.0) / n,
            _ => 1.0,
        }
    }
    pub fn kind(self) -> Option<CollKind> {
        Some(match self {
            Op::AllReduce => CollKind::AllReduce,
            Op::AllGather => CollKind::AllGather,
            Op::Broadcast => CollKind::Broadcast,
            Op::ReduceScatter => CollKind::ReduceScatter,
            Op::Reduce => CollKind::Reduce,
            Op::AllToAll => CollKind::AllToAll,
            _ => return None,
        })
    }
}

/// The sizes -b, -e and -f or -i ask for.
pub fn sizes(a: &Args) -> Result<Vec<usize>, String> {
    let (mut b, e) = (parse_size(&a.minbytes)?, parse_size(&a.maxbytes)?);
    if b > e {
        return Err(format!(
            "-b {} ({b} bytes) is larger than -e {} ({e} bytes): no size to run; swap them",
            a.minbytes, a.maxbytes
        ));
    }
    // As nccl-tests: a factor above 1 multiplies, else -i adds.
    let step = match (a.stepfactor, &a.stepbytes) {
        (Some(0), _) => return Err("-f 0: the factor must be at least 1".into()),
        (Some(f), _) if f > 1 => Step::Factor(f),
        (None, None) => Step::Factor(4),
        (_, Some(s)) => Step::Add(parse_size(s)?),
        (Some(_), None) => Step::Add(1 << 20),
    };
    if step == Step::Add(0) {
        return Err("-i 0: the size increment must be above 0".into());
    }
    let mut v = Vec::new();
    while b <= e {
        v.push(b);
        let next = match step {
            Step::Factor(f) => b.saturating_mul(f),
            Step::Add(i) => b.saturating_add(i),
        };
        if next == 0 || next == b {
            break;
        }
        b = next;
    }
    Ok(v)
}

#[derive(Clone, Copy, PartialEq)]
enum Step {
    Factor(usize),
    Add(usize),
}

impl Args {
    /// The step as the header shows it (nccl-tests': "4(factor)" or "1048576(bytes)").
    pub fn step_text(&self) -> String {
        match (self.stepfactor, &self.stepbytes) {
            (Some(f), _) if f > 1 => format!("{f}(factor)"),
            (None, None) => "4(factor)".into(),
            (_, s) => format!(
                "{}(bytes)",
                s.as_deref()
                    .and_then(|s| parse_size(s).ok())
                    .unwrap_or(1 << 20)
            ),
        }
    }
    /// Placements to run: (out of place, in place).
    pub fn placements(&self) -> (bool, bool) {
        (!self.inplace, !self.out_of_place)
    }
}

/// What the arguments ask for, checked.
pub struct Plan {
    pub dts: Vec<DataType>,
    pub redops: Vec<RedOp>,
    pub algo: Option<Algo>,
    pub ops: Vec<Op>,
    pub sizes: Vec<usize>,
}

/// nccl-tests' flags that roccl accepts with their default value only, and why.
fn refuse_unsupported(a: &Args) -> Result<(), String> {
    let fixed = [
        ("-t/--nthreads", a.nthreads, 1, "roccl-perf runs one rank per process: --ranks N starts N local ranks, or start it with a launcher (torchrun, srun, mpirun)"),
        ("-g/--ngpus", a.ngpus, 1, "each rank has one device: --ranks N starts N local ranks, or start it with a launcher"),
        ("-m/--agg_iters", a.agg_iters, 1, "roccl has no group calls to aggregate iterations in"),
        ("-G/--cudagraph", a.cudagraph, 0, "roccl has no graph capture"),
        ("-C/--report_cputime", a.report_cputime, 0, "the times reported are the wall-clock times of the calls"),
        ("-y/--stream_null", a.stream_null, 0, "--device creates its own stream"),
        ("-R/--local_register", a.local_register, 0, "roccl registers no buffer ahead of a call"),
    ];
    for (flag, v, want, why) in fixed {
        if v != want {
            return Err(format!("{flag} {v}: only {want} is supported: {why}"));
        }
    }
    if a.parallel_init > 1 {
        return Err(format!("-p/--parallel_init {}: 0 or 1", a.parallel_init));
    }
    if let Some(t) = a.timeout {
        if !(t > 0.0 && t.is_finite()) {
            return Err(format!(
                "-T {t}: the timeout is a number of seconds above 0"
            ));
        }
    }
    Ok(())
}

/// Check the arguments for a job of `nranks` ranks, `local` of them on this host (the
/// launcher checks them before it starts any rank, so that an error is printed once).
pub fn check_args(a: &Args, nranks: usize, local: usize) -> Result<Plan, String> {
    refuse_unsupported(a)?;
    let dts = parse_dtypes(&a.dtype)?;
    let redops = parse_redops(&a.redop)?;
    let algo = match a.algo.as_str() {
        "auto" => None,
        s => Some(s.parse::<Algo>().map_err(|e| e.to_string())?),
    };
    if a.root >= nranks {
        return Err(format!(
            "--root {} is out of range for {nranks} ranks (0 to {})",
            a.root,
            nranks - 1
        ));
    }
    if a.iters == 0 {
        return Err("--iters 0: at least one timed iteration is needed".into());
    }
    if a.check_iters && (a.device.is_some() || a.stream || a.check == 0) {
        return Err(
            "--check-iters checks host buffers between calls: not with --device, --stream or -c 0"
                .into(),
        );
    }
    if a.check_iters && a.blocking == 0 {
        return Err("--check-iters checks each call when it returns: not with -z 0".into());
    }
    let ops = Op::parse(&a.op)?;
    let sizes = sizes(a)?;
    let largest = sizes.iter().copied().max().unwrap_or(0) as u64;
    // run() and check() hold a send and a receive buffer of the largest size each, and an
    // in-place reduce-scatter one more.
    let need = largest.saturating_mul(5).saturating_mul(local as u64);
    if let Some(avail) = available_memory() {
        if need > avail {
            return Err(format!(
                "-e {} needs about {} of memory ({local} rank(s) on this host, up to 5 buffers of {} each) but {} is available: lower -e",
                a.maxbytes,
                gib(need),
                gib(largest),
                gib(avail)
            ));
        }
    }
    Ok(Plan {
        dts,
        redops,
        algo,
        ops,
        sizes,
    })
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

/// Memory this process can still get: MemAvailable, capped by the cgroup's limit.
fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let avail = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())?
        * 1024;
    let read = |f: &str| {
        std::fs::read_to_string(format!("/sys/fs/cgroup/{f}"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
    };
    let cgroup = match (read("memory.max"), read("memory.current")) {
        (Some(max), Some(cur)) => Some(max.saturating_sub(cur)),
        _ => None,
    };
    Some(cgroup.map_or(avail, |c| c.min(avail)))
}
