//! Jobs on the simulated network (`ROCCL_NET=sim`): every rank a thread of this process,
//! each collective timed in virtual time and every rank's output checked against values
//! worked out independently. Used by `roccl-sim` and tests/sim.rs.
//!
//! Per case: `warmup` calls (they also open the connections), then every rank's clock is set
//! to the latest of them (what a barrier before timing does on a cluster), then `iters`
//! calls; a rank's time is its clock's advance over them divided by `iters`, and the case's
//! predicted time the slowest rank's. The output of the last call is checked.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::comm::{CallOpts, Collective, Communicator, Config};
use crate::error::{Error, Result};
use crate::net::sim::SimSpec;
use crate::net::NetKind;
use crate::os::wait::Waiter;
use crate::types::{DataType, RedOp};
use crate::{Algo, UniqueId};

/// The collectives a simulated job runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimOp {
    /// All-reduce (sum).
    AllReduce,
    /// All-gather.
    AllGather,
    /// Reduce-scatter (sum).
    ReduceScatter,
    /// Broadcast from rank 0.
    Broadcast,
    /// Reduce (sum) to rank 0.
    Reduce,
    /// All-to-all.
    AllToAll,
    /// Barrier.
    Barrier,
}

impl SimOp {
    /// Every collective.
    pub const ALL: [SimOp; 7] = [
        SimOp::AllReduce,
        SimOp::AllGather,
        SimOp::ReduceScatter,
        SimOp::Broadcast,
        SimOp::Reduce,
        SimOp::AllToAll,
        SimOp::Barrier,
    ];

    /// Its name, as nccl-tests' binaries name it.
    pub fn name(self) -> &'static str {
        match self {
            SimOp::AllReduce => "all_reduce",
            SimOp::AllGather => "all_gather",
            SimOp::ReduceScatter => "reduce_scatter",
            SimOp::Broadcast => "broadcast",
            SimOp::Reduce => "reduce",
            SimOp::AllToAll => "all_to_all",
            SimOp::Barrier => "barrier",
        }
    }

    /// The collective of this name.
    pub fn parse(s: &str) -> Option<SimOp> {
        SimOp::ALL.into_iter().find(|o| o.name() == s)
    }

    /// nccl-tests' bus bandwidth factor for `n` ranks.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            SimOp::AllReduce => 2.0 * (n - 1.0) / n,
            SimOp::AllGather | SimOp::ReduceScatter | SimOp::AllToAll => (n - 1.0) / n,
            SimOp::Broadcast | SimOp::Reduce => 1.0,
            SimOp::Barrier => 0.0,
        }
    }
}

/// One measurement: a collective, an algorithm (`None`: the cost model's choice) and the
/// buffer size in bytes as nccl-tests counts it (the larger of input and output).
#[derive(Clone, Copy, Debug)]
pub struct SimCase {
    /// The collective.
    pub op: SimOp,
    /// Forced algorithm.
    pub algo: Option<Algo>,
    /// Bytes (rounded down to whole f32 elements, a multiple of the rank count where the
    /// collective cuts the buffer in blocks).
    pub bytes: usize,
    /// Untimed calls first.
    pub warmup: usize,
    /// Timed calls.
    pub iters: usize,
    /// In place: one buffer per rank holds the input and receives the output, as the
    /// communicator's in-place calls take it (all-reduce, all-gather, reduce-scatter,
    /// reduce; broadcast always is; all-to-all and barrier ignore it). Halves the memory.
    pub in_place: bool,
}

/// What a case gave.
#[derive(Clone, Debug)]
pub struct SimResult {
    /// The case.
    pub case: SimCase,
    /// Bytes actually used.
    pub bytes: usize,
    /// Predicted time per call: the slowest rank's.
    pub time: Duration,
    /// The fastest rank's.
    pub fastest: Duration,
    /// The algorithm that ran (rank 0's answer).
    pub algo: Option<Algo>,
    /// Output elements that differ from the reference, over every rank; `None` when the
    /// network moved no data (`data=0`) and nothing was checked.
    pub wrong: Option<usize>,
}

/// Settings of a simulated job.
#[derive(Clone, Debug)]
pub struct SimJob {
    /// Ranks (threads).
    pub ranks: usize,
    /// The cluster.
    pub spec: SimSpec,
    /// The communicators' timeout.
    pub timeout: Duration,
}

/// A barrier that a failing rank breaks, so that the others return instead of waiting.
struct Meet {
    n: usize,
    state: Mutex<(usize, u64, bool)>,
    cv: Condvar,
}

impl Meet {
    fn new(n: usize) -> Meet {
        Meet {
            n,
            state: Mutex::new((0, 0, false)),
            cv: Condvar::new(),
        }
    }

    fn wait(&self) -> Result<()> {
        let mut g = self.state.lock();
        if g.2 {
            return Err(Error::InvalidUsage("another rank failed".into()));
        }
        let gen = g.1;
        g.0 += 1;
        if g.0 == self.n {
            g.0 = 0;
            g.1 += 1;
            self.cv.notify_all();
            return Ok(());
        }
        while g.1 == gen && !g.2 {
            self.cv.wait(&mut g);
        }
        if g.2 {
            return Err(Error::InvalidUsage("another rank failed".into()));
        }
        Ok(())
    }

    fn break_all(&self) {
        self.state.lock().2 = true;
        self.cv.notify_all();
    }
}

/// The value rank `r` puts at element `i` of its input: small integers, so that sums over
/// 1024 ranks are exact in f32 and do not depend on the order of the reduction.
fn value(r: usize, i: usize) -> f32 {
    ((3 * r + i) % 7) as f32
}

/// `sums[k]` = the sum over `n` ranks of `value(r, i)` for `i % 7 == k`.
fn sums(n: usize) -> [f32; 7] {
    let mut s = [0f32; 7];
    for (k, x) in s.iter_mut().enumerate() {
        *x = (0..n).map(|r| value(r, k)).sum();
    }
    s
}

/// Elements of input and output per rank for `bytes` of `op` on `n` ranks.
fn counts(op: SimOp, bytes: usize, n: usize) -> (usize, usize) {
    let e = bytes / 4;
    let block = (e / n).max(1);
    match op {
        SimOp::AllReduce | SimOp::Broadcast | SimOp::Reduce => (e.max(1), e.max(1)),
        SimOp::AllGather => (block, block * n),
        SimOp::ReduceScatter => (block * n, block),
        SimOp::AllToAll => (block * n, block * n),
        SimOp::Barrier => (0, 0),
    }
}

/// The expected output element `i` on rank `r` (None: not checked).
fn expected(op: SimOp, r: usize, n: usize, i: usize, out: usize, s: &[f32; 7]) -> Option<f32> {
    match op {
        SimOp::AllReduce => Some(s[i % 7]),
        SimOp::Broadcast => Some(value(0, i)),
        SimOp::Reduce => (r == 0).then(|| s[i % 7]),
        SimOp::AllGather => {
            let block = out / n;
            Some(value(i / block, i % block))
        }
        SimOp::ReduceScatter => Some(s[(r * out + i) % 7]),
        SimOp::AllToAll => {
            let block = out / n;
            Some(value(i / block, r * block + i % block))
        }
        SimOp::Barrier => None,
    }
}

fn collective(op: SimOp) -> Collective {
    match op {
        SimOp::AllReduce => Collective::AllReduce(RedOp::Sum),
        SimOp::AllGather => Collective::AllGather,
        SimOp::ReduceScatter => Collective::ReduceScatter(RedOp::Sum),
        SimOp::Broadcast => Collective::Broadcast { root: 0 },
        SimOp::Reduce => Collective::Reduce {
            op: RedOp::Sum,
            root: 0,
        },
        SimOp::AllToAll => Collective::AllToAll,
        SimOp::Barrier => Collective::Barrier,
    }
}

/// File descriptors a simulated rank takes (its eventfd, its spare rendezvous listener, its
/// connection to the rendezvous root and the root's end of it), with room for the rest.
const FDS_PER_RANK: u64 = 4;

/// Raise this process's soft limit of open files to what `ranks` simulated ranks need
/// (up to the hard limit); an error says what to raise when the hard limit is too low.
pub fn raise_fd_limit(ranks: usize) -> Result<()> {
    let need = ranks as u64 * FDS_PER_RANK + 256;
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit for getrlimit(2) to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(Error::sys(
            "getrlimit(RLIMIT_NOFILE)",
            std::io::Error::last_os_error(),
        ));
    }
    if lim.rlim_cur >= need {
        return Ok(());
    }
    if lim.rlim_max < need {
        return Err(Error::arg(format!(
            "{ranks} simulated ranks need about {need} open files but the hard limit is {}: raise it (ulimit -Hn {need}, or LimitNOFILE= / nofile in limits.conf)",
            lim.rlim_max
        )));
    }
    lim.rlim_cur = need;
    // SAFETY: `lim` is a valid rlimit; raising the soft limit up to the hard one is allowed.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(Error::sys(
            format!("setrlimit(RLIMIT_NOFILE) to {need}"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Run `cases` in order on a job of `job.ranks` threads over the simulated network.
pub fn run(job: &SimJob, cases: &[SimCase]) -> Result<Vec<SimResult>> {
    run_timed(job, cases).map(|(r, _)| r)
}

/// [`run`], and the real time every rank took to make its communicator (threads started,
/// rendezvous with the root over loopback TCP, the table received, checks agreed), up to
/// the moment the last one had it.
pub fn run_timed(job: &SimJob, cases: &[SimCase]) -> Result<(Vec<SimResult>, Duration)> {
    let n = job.ranks;
    if n == 0 {
        return Err(Error::arg("a simulated job needs at least one rank"));
    }
    raise_fd_limit(n)?;
    let mut cfg = Config::from_env()?;
    cfg.net = NetKind::Sim;
    cfg.sim = job.spec.clone();
    // Thousands of threads on a few cores: sleep on the eventfd as soon as nothing moves.
    cfg.waiter = Waiter {
        spin: Duration::ZERO,
        yield_for: Duration::ZERO,
        timeout: job.timeout,
        nap: Duration::from_millis(10),
        fixed: true,
    };
    let id = UniqueId::new()?;
    let meet = Meet::new(n);
    let sums = sums(n);
    let start_clock = AtomicU64::new(0);
    let slowest = AtomicU64::new(0);
    let fastest = AtomicU64::new(u64::MAX);
    let wrong = AtomicUsize::new(0);
    let check = job.spec.data;
    let results = Mutex::new(Vec::new());
    let started = std::time::Instant::now();
    let init_time = Mutex::new(Duration::ZERO);
    let first_error: Mutex<Option<(usize, Error)>> = Mutex::new(None);
    std::thread::scope(|s| {
        for r in 0..n {
            let (cfg, id, meet) = (cfg.clone(), &id, &meet);
            let (start_clock, slowest, fastest, wrong) = (&start_clock, &slowest, &fastest, &wrong);
            let (results, first_error, sums) = (&results, &first_error, &sums);
            let init_time = &init_time;
            let body = move || {
                let res = (|| -> Result<()> {
                    let c = Communicator::init_with(id, n, r, cfg)?;
                    meet.wait()?;
                    if r == 0 {
                        *init_time.lock() = started.elapsed();
                    }
                    for case in cases {
                        let algo = rank_case(&c, case, meet, start_clock, check, |t| {
                            let ns = t.as_nanos() as u64;
                            slowest.fetch_max(ns, Ordering::Relaxed);
                            fastest.fetch_min(ns, Ordering::Relaxed);
                        })
                        .map(|(algo, out)| {
                            if check {
                                let bad = out
                                    .iter()
                                    .enumerate()
                                    .filter(|&(i, &x)| {
                                        expected(case.op, r, n, i, out.len(), sums)
                                            .is_some_and(|e| e != x)
                                    })
                                    .count();
                                wrong.fetch_add(bad, Ordering::Relaxed);
                            }
                            algo
                        })?;
                        meet.wait()?;
                        if r == 0 {
                            let (ein, eout) = counts(case.op, case.bytes, n);
                            results.lock().push(SimResult {
                                case: *case,
                                bytes: 4 * ein.max(eout) * usize::from(case.op != SimOp::Barrier),
                                time: Duration::from_nanos(slowest.swap(0, Ordering::Relaxed)),
                                fastest: Duration::from_nanos(
                                    fastest.swap(u64::MAX, Ordering::Relaxed),
                                ),
                                algo,
                                wrong: check.then(|| wrong.swap(0, Ordering::Relaxed)),
                            });
                            start_clock.store(0, Ordering::Relaxed);
                        }
                        meet.wait()?;
                    }
                    Ok(())
                })();
                if let Err(e) = res {
                    let mut g = first_error.lock();
                    let other = matches!(&e, Error::InvalidUsage(m) if m == "another rank failed");
                    if g.is_none() && !other {
                        *g = Some((r, e));
                    }
                    meet.break_all();
                }
            };
            let spawned = std::thread::Builder::new()
                .name(format!("sim-rank-{r}"))
                .spawn_scoped(s, body);
            if let Err(e) = spawned {
                *first_error.lock() = Some((r, Error::sys("starting a rank's thread", e)));
                meet.break_all();
                break;
            }
        }
    });
    if let Some((r, e)) = first_error.into_inner() {
        return Err(Error::Remote {
            rank: r,
            cause: crate::error::PeerCause::Failed,
            msg: format!("simulated rank {r} of {n}: {e}"),
        });
    }
    Ok((results.into_inner(), init_time.into_inner()))
}

/// One case on one rank: its algorithm and the output of the last call; `time` gets the
/// rank's predicted time per call. `check`: the output will be checked (the network moves
/// data), so an in-place buffer gets its input again before every call.
fn rank_case(
    c: &Communicator,
    case: &SimCase,
    meet: &Meet,
    start_clock: &AtomicU64,
    check: bool,
    time: impl Fn(Duration),
) -> Result<(Option<Algo>, Vec<f32>)> {
    let (r, n) = (c.rank(), c.nranks());
    let (ein, eout) = counts(case.op, case.bytes, n);
    let in_place = case.in_place
        && matches!(
            case.op,
            SimOp::AllReduce | SimOp::AllGather | SimOp::ReduceScatter | SimOp::Reduce
        );
    // Where this rank's input sits in its in-place buffer: block `r` for an all-gather.
    let at = if case.op == SimOp::AllGather {
        r * ein
    } else {
        0
    };
    let input: Vec<f32> = if in_place {
        Vec::new()
    } else {
        (0..ein).map(|i| value(r, i)).collect()
    };
    let mut out = vec![f32::NAN; if in_place { ein.max(eout) } else { eout }];
    let opts = CallOpts {
        algo: case.algo,
        ..Default::default()
    };
    let coll = collective(case.op);
    let mut filled = false;
    let mut call = |out: &mut Vec<f32>| -> Result<Option<Algo>> {
        let info = match case.op {
            SimOp::Barrier => c.run_raw(coll, DataType::U8, None, &mut [], &opts)?,
            // In place: broadcast from the root's buffer (its input, as rank 0 holds it), the
            // others from this rank's part of the one buffer.
            _ if case.op == SimOp::Broadcast || in_place => {
                if case.op == SimOp::Broadcast {
                    if r == 0 {
                        out.copy_from_slice(&input);
                    }
                } else if check || !filled {
                    for (i, x) in out[at..at + ein].iter_mut().enumerate() {
                        *x = value(r, i);
                    }
                    filled = true;
                }
                c.run_raw(
                    coll,
                    DataType::F32,
                    None,
                    bytemuck::cast_slice_mut(out),
                    &opts,
                )?
            }
            _ => c.run_raw(
                coll,
                DataType::F32,
                Some(bytemuck::cast_slice(&input)),
                bytemuck::cast_slice_mut(out),
                &opts,
            )?,
        };
        Ok(info.algo)
    };
    for _ in 0..case.warmup {
        call(&mut out)?;
    }
    let own = c.virtual_clock().unwrap_or_default();
    start_clock.fetch_max(own.as_nanos() as u64, Ordering::Relaxed);
    meet.wait()?;
    let t0 = Duration::from_nanos(start_clock.load(Ordering::Relaxed));
    c.set_virtual_clock(t0);
    meet.wait()?;
    let mut algo = None;
    if check {
        out.fill(f32::NAN);
    }
    for _ in 0..case.iters.max(1) {
        algo = call(&mut out)?;
    }
    let end = c.virtual_clock().unwrap_or_default();
    time(end.saturating_sub(t0) / case.iters.max(1) as u32);
    if in_place && case.op == SimOp::ReduceScatter {
        // The result is block `r` of the buffer.
        out = out[r * eout..(r + 1) * eout].to_vec();
    }
    Ok((algo, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_match_the_definition() {
        let n = 5;
        let s = sums(n);
        for i in 0..20 {
            let direct: f32 = (0..n).map(|r| value(r, i)).sum();
            assert_eq!(s[i % 7], direct);
        }
        // All-to-all on 3 ranks, blocks of 2: rank 1 gets block 1 of every rank.
        let got: Vec<f32> = (0..6)
            .map(|i| expected(SimOp::AllToAll, 1, 3, i, 6, &s).unwrap())
            .collect();
        let want: Vec<f32> = (0..3).flat_map(|q| [value(q, 2), value(q, 3)]).collect();
        assert_eq!(got, want);
    }
}
