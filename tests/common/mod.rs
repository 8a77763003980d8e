//! Shared helpers for the integration tests: ranks as threads, an independent reference
//! for every collective, and value encoding per data type.
#![allow(dead_code)]

use std::time::Duration;

pub mod strangers;

use roccl::algo::model::Tuning;
use roccl::comm::Waiter;
use roccl::net::NetKind;
use roccl::{Algo, CallOpts, Collective, Communicator, Config, DataType, RedOp, UniqueId};

/// Test settings: short spin so 8 threads on 2 cores share them well, a timeout that fails
/// a hung test quickly, and the given pipeline tuning.
pub fn config(tuning: Tuning) -> Config {
    // What a test sets in the environment before it builds its config still counts for
    // the settings not fixed here (the networks', metrics, tracing).
    let mut c = Config::from_env().expect("valid ROCCL_* settings");
    c.net = NetKind::Tcp;
    c.algo = None;
    c.tuning = tuning;
    c.waiter = Waiter {
        spin: Duration::from_micros(5),
        yield_for: Duration::from_micros(50),
        timeout: Duration::from_secs(60),
        nap: Duration::from_millis(10),
        fixed: true,
    };
    c.shm_slot = None;
    c.connect_all = false;
    c.gpu_direct = roccl::comm::GpuDirect::Auto;
    c.gpu_direct_min = 0;
    c.ring_window = roccl::comm::RING_WINDOW;
    c.host = None;
    c.hier = roccl::comm::Hier::Auto;
    c.sim = Default::default();
    c
}

/// Run `f(comm)` on `n` ranks, each a thread with its own communicator.
pub fn run_ranks<F>(n: usize, cfg: Config, f: F)
where
    F: Fn(Communicator) + Send + Sync,
{
    run_ranks_of(UniqueId::new().expect("unique id"), n, cfg, f)
}

/// [`run_ranks`] with the communicator of `id`.
pub fn run_ranks_of<F>(id: UniqueId, n: usize, cfg: Config, f: F)
where
    F: Fn(Communicator) + Send + Sync,
{
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let (f, cfg) = (&f, cfg.clone());
                s.spawn(move || {
                    let c = Communicator::init_with(&id, n, r, cfg).expect("init");
                    f(c)
                })
            })
            .collect();
        for (r, h) in hs.into_iter().enumerate() {
            if let Err(e) = h.join() {
                std::panic::resume_unwind(Box::new(format!(
                    "rank {r} failed: {:?}",
                    e.downcast_ref::<String>()
                )));
            }
        }
    });
}

/// A host buffer as the C ABI passes it (read by roccl).
pub fn raw(b: &[u8]) -> roccl::comm::stream::ops::RawBuf {
    roccl::comm::stream::ops::RawBuf {
        addr: b.as_ptr() as usize,
        len: b.len(),
    }
}

/// A host buffer roccl writes, by a pointer from a mutable borrow.
pub fn raw_mut(b: &mut [u8]) -> roccl::comm::stream::ops::RawBuf {
    roccl::comm::stream::ops::RawBuf {
        addr: b.as_mut_ptr() as usize,
        len: b.len(),
    }
}

pub fn signed(dt: DataType) -> bool {
    matches!(dt, DataType::I8 | DataType::I32 | DataType::I64) || dt.is_float()
}

/// Input element `i` of `rank`: small integers, exact in every type, so sums and
/// products of up to 16 ranks are exact.
pub fn val(dt: DataType, op: RedOp, rank: usize, i: usize) -> f64 {
    if op == RedOp::Prod {
        return (1 + (rank + i) % 2) as f64;
    }
    let v = ((rank * 7 + i * 3) % 5) as f64;
    if signed(dt) {
        v - 1.0
    } else {
        v
    }
}

/// Reference reduction over `n` ranks of element `i`, computed in f64.
pub fn reduce_ref(dt: DataType, op: RedOp, n: usize, i: usize) -> f64 {
    let vals = (0..n).map(|r| val(dt, op, r, i));
    match op {
        RedOp::Sum => vals.sum(),
        RedOp::Prod => vals.product(),
        RedOp::Max => vals.fold(f64::MIN, f64::max),
        RedOp::Min => vals.fold(f64::MAX, f64::min),
        RedOp::Avg => {
            let s: f64 = vals.sum();
            if dt.is_float() {
                s / n as f64
            } else {
                (s / n as f64).trunc()
            }
        }
    }
}

pub fn put(dt: DataType, v: f64, b: &mut [u8]) {
    match dt {
        DataType::I8 => b[0] = (v as i8) as u8,
        DataType::U8 => b[0] = v as u8,
        DataType::I32 => b.copy_from_slice(&(v as i32).to_le_bytes()),
        DataType::U32 => b.copy_from_slice(&(v as u32).to_le_bytes()),
        DataType::I64 => b.copy_from_slice(&(v as i64).to_le_bytes()),
        DataType::U64 => b.copy_from_slice(&(v as u64).to_le_bytes()),
        DataType::F16 => b.copy_from_slice(&half::f16::from_f64(v).to_le_bytes()),
        DataType::Bf16 => b.copy_from_slice(&half::bf16::from_f64(v).to_le_bytes()),
        DataType::F32 => b.copy_from_slice(&(v as f32).to_le_bytes()),
        DataType::F64 => b.copy_from_slice(&v.to_le_bytes()),
        DataType::F8E4M3 => b[0] = roccl::F8E4M3::from_f32(v as f32).0,
        DataType::F8E5M2 => b[0] = roccl::F8E5M2::from_f32(v as f32).0,
    }
}

pub fn get(dt: DataType, b: &[u8]) -> f64 {
    match dt {
        DataType::I8 => b[0] as i8 as f64,
        DataType::U8 => b[0] as f64,
        DataType::I32 => i32::from_le_bytes(b.try_into().unwrap()) as f64,
        DataType::U32 => u32::from_le_bytes(b.try_into().unwrap()) as f64,
        DataType::I64 => i64::from_le_bytes(b.try_into().unwrap()) as f64,
        DataType::U64 => u64::from_le_bytes(b.try_into().unwrap()) as f64,
        DataType::F16 => half::f16::from_le_bytes(b.try_into().unwrap()).to_f64(),
        DataType::Bf16 => half::bf16::from_le_bytes(b.try_into().unwrap()).to_f64(),
        DataType::F32 => f32::from_le_bytes(b.try_into().unwrap()) as f64,
        DataType::F64 => f64::from_le_bytes(b.try_into().unwrap()),
        DataType::F8E4M3 => roccl::F8E4M3(b[0]).to_f32() as f64,
        DataType::F8E5M2 => roccl::F8E5M2(b[0]).to_f32() as f64,
    }
}

/// Buffer of `count` elements with element `i` = `f(i)`.
pub fn fill(dt: DataType, count: usize, f: impl Fn(usize) -> f64) -> Vec<u8> {
    let es = dt.size();
    let mut b = vec![0u8; count * es];
    for i in 0..count {
        put(dt, f(i), &mut b[i * es..(i + 1) * es]);
    }
    b
}

pub fn close(dt: DataType, got: f64, want: f64) -> bool {
    let tol = match dt {
        DataType::F16 | DataType::Bf16 => 1e-2 * want.abs() + 1e-3,
        DataType::F32 => 1e-6 * want.abs(),
        // 3 and 2 mantissa bits: one rounding unit at the result's magnitude (2^-3 and 2^-2
        // of it) and a quarter or half of 1, for partial sums rounded above 16 (e4m3) or 8
        // (e5m2) whose later terms cancel. (3 for 2 fails either.)
        DataType::F8E4M3 => 0.125 * want.abs() + 0.25,
        DataType::F8E5M2 => 0.25 * want.abs() + 0.5,
        _ => 0.0,
    };
    (got - want).abs() <= tol
}

/// Compare `buf` with `want(i)`; panics with the first mismatch.
pub fn check(what: &str, dt: DataType, buf: &[u8], want: impl Fn(usize) -> f64) {
    let es = dt.size();
    for i in 0..buf.len() / es {
        let g = get(dt, &buf[i * es..(i + 1) * es]);
        let w = want(i);
        assert!(close(dt, g, w), "{what}: element {i}: got {g}, want {w}");
    }
}

/// The collectives the matrix tests run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    AllToAll,
}

pub const KINDS: [Kind; 6] = [
    Kind::AllReduce,
    Kind::Broadcast,
    Kind::Reduce,
    Kind::AllGather,
    Kind::ReduceScatter,
    Kind::AllToAll,
];

/// Every algorithm of `k`; the shared-memory ones run only on communicators that have them
/// (`one` skips them elsewhere, and checks that a forced algorithm really ran).
pub fn algos(k: Kind) -> &'static [Algo] {
    match k {
        Kind::AllReduce => &[
            Algo::Direct,
            Algo::Doubling,
            Algo::TwoShot,
            Algo::Ring,
            Algo::Tree,
            Algo::ShmOneShot,
            Algo::ShmTwoShot,
            Algo::Bruck,
        ],
        Kind::Broadcast | Kind::Reduce => &[Algo::Ring, Algo::Tree, Algo::ShmOneShot],
        Kind::AllToAll => &[Algo::Direct, Algo::ShmOneShot],
        _ => &[Algo::Ring, Algo::ShmOneShot, Algo::Bruck],
    }
}

/// The algorithms of `k` that `c` can run: the shared-memory ones only where every rank is
/// on shared memory (elsewhere they do not exist, and a test asking for one fails).
pub fn algos_on(c: &Communicator, k: Kind) -> Vec<Algo> {
    algos(k)
        .iter()
        .copied()
        .filter(|&a| !is_flat(a) || c.shm_collectives())
        .collect()
}

/// Whether `algo` is one of the shared-memory algorithms.
pub fn is_flat(algo: Algo) -> bool {
    matches!(algo, Algo::ShmOneShot | Algo::ShmTwoShot)
}

/// Run one collective and check this rank's result. `count` is the per-rank element count
/// (the block size for all-gather, reduce-scatter and all-to-all).
#[allow(clippy::too_many_arguments)]
pub fn one(
    c: &Communicator,
    k: Kind,
    dt: DataType,
    op: RedOp,
    count: usize,
    algo: Algo,
    in_place: bool,
    root: usize,
) {
    let (n, me) = (c.nranks(), c.rank());
    assert!(
        !is_flat(algo) || c.shm_collectives(),
        "{algo} asked of a communicator without shared-memory collectives: iterate algos_on()"
    );
    let es = dt.size();
    let opts = CallOpts {
        algo: Some(algo),
        ..Default::default()
    };
    let what = format!(
        "{k:?} {dt} {op} count={count} algo={algo} in_place={in_place} n={n} rank={me} root={root}"
    );
    let run = |coll: Collective, send: &[u8], out: &mut Vec<u8>| {
        let r = if in_place {
            out.copy_from_slice(send);
            c.run_raw(coll, dt, None, out, &opts)
        } else {
            c.run_raw(coll, dt, Some(send), out, &opts)
        };
        let info = r.unwrap_or_else(|e| panic!("{what}: {e}"));
        ran(&what, n, algo, info.algo);
    };
    match k {
        Kind::AllReduce => {
            let send = fill(dt, count, |i| val(dt, op, me, i));
            let mut out = vec![0xa5u8; count * es];
            run(Collective::AllReduce(op), &send, &mut out);
            check(&what, dt, &out, |i| reduce_ref(dt, op, n, i));
        }
        Kind::Broadcast => {
            let send = fill(dt, count, |i| {
                // Non-roots' inputs are never read: a value no input has (`val` stays in
                // -1..3), so a non-root that kept its own buffer fails the check.
                if me == root {
                    val(dt, op, root, i)
                } else {
                    99.0
                }
            });
            let mut out = vec![0xa5u8; count * es];
            run(Collective::Broadcast { root }, &send, &mut out);
            check(&what, dt, &out, |i| val(dt, op, root, i));
        }
        Kind::Reduce => {
            let send = fill(dt, count, |i| val(dt, op, me, i));
            let mut out = vec![0xa5u8; count * es];
            run(Collective::Reduce { op, root }, &send, &mut out);
            if me == root {
                check(&what, dt, &out, |i| reduce_ref(dt, op, n, i));
            } else if !in_place {
                assert!(
                    out.iter().all(|b| *b == 0xa5),
                    "{what}: non-root receive buffer was written"
                );
            }
        }
        Kind::AllGather => {
            let mine = fill(dt, count, |i| val(dt, op, me, i));
            let mut out = vec![0xa5u8; n * count * es];
            let r = if in_place {
                out[me * count * es..(me + 1) * count * es].copy_from_slice(&mine);
                c.run_raw(Collective::AllGather, dt, None, &mut out, &opts)
            } else {
                c.run_raw(Collective::AllGather, dt, Some(&mine), &mut out, &opts)
            };
            ran(
                &what,
                n,
                algo,
                r.unwrap_or_else(|e| panic!("{what}: {e}")).algo,
            );
            check(&what, dt, &out, |j| {
                val(dt, op, j / count.max(1), j % count.max(1))
            });
        }
        Kind::ReduceScatter => {
            let send = fill(dt, n * count, |j| val(dt, op, me, j));
            let mut out = vec![0xa5u8; if in_place { n * count * es } else { count * es }];
            let r = if in_place {
                out.copy_from_slice(&send);
                c.run_raw(Collective::ReduceScatter(op), dt, None, &mut out, &opts)
            } else {
                c.run_raw(
                    Collective::ReduceScatter(op),
                    dt,
                    Some(&send),
                    &mut out,
                    &opts,
                )
            };
            ran(
                &what,
                n,
                algo,
                r.unwrap_or_else(|e| panic!("{what}: {e}")).algo,
            );
            let mine = if in_place {
                &out[me * count * es..(me + 1) * count * es]
            } else {
                &out[..]
            };
            check(&what, dt, mine, |i| reduce_ref(dt, op, n, me * count + i));
        }
        Kind::AllToAll => {
            let send = fill(dt, n * count, |j| {
                val(dt, op, me, j) + (j / count.max(1)) as f64
            });
            let mut out = vec![0xa5u8; n * count * es];
            run(Collective::AllToAll, &send, &mut out);
            // Block s of the output is block `me` of rank s's input.
            check(&what, dt, &out, |j| {
                let (s, i) = (j / count.max(1), j % count.max(1));
                val(dt, op, s, me * count + i) + me as f64
            });
        }
    }
}

/// A forced shared-memory or Bruck algorithm must have run (`algos` lists them only for
/// collectives that have them; network algorithms a collective lacks fall back to the
/// model; one rank needs no algorithm).
fn ran(what: &str, n: usize, forced: Algo, used: Option<Algo>) {
    if (is_flat(forced) || forced == Algo::Bruck) && n > 1 {
        assert_eq!(used, Some(forced), "{what}: a different algorithm ran");
    }
}

/// Every collective × algorithm × some dtypes/ops × counts 0, 1, 7, 1000, 70001 × in and out
/// of place on `n` ranks (threads) over network `net`, whose name must be `name`.
pub fn net_matrix(net: NetKind, name: &str, n: usize, tuning: Tuning) {
    let mut cfg = config(tuning);
    cfg.net = net;
    net_matrix_cfg(cfg, name, n);
}

/// [`net_matrix`] with a whole configuration. Communicators whose every rank is on shared
/// memory must have the shared-memory collectives, and no other may.
pub fn net_matrix_cfg(cfg: Config, name: &str, n: usize) {
    net_matrix_of(UniqueId::new().expect("unique id"), cfg, name, n)
}

/// [`net_matrix_cfg`] on the communicator of `id`.
pub fn net_matrix_of(id: UniqueId, cfg: Config, name: &str, n: usize) {
    run_ranks_of(id, n, cfg, |c| {
        assert_eq!(c.net_name(), name);
        assert_eq!(c.shm_collectives(), name == "shm" && n > 1, "{name}");
        for k in KINDS {
            for algo in algos_on(&c, k) {
                for (dt, op) in [
                    (DataType::F32, RedOp::Sum),
                    (DataType::Bf16, RedOp::Max),
                    (DataType::I64, RedOp::Avg),
                    (DataType::U8, RedOp::Prod),
                ] {
                    let reducing =
                        matches!(k, Kind::AllReduce | Kind::Reduce | Kind::ReduceScatter);
                    if !reducing && op != RedOp::Sum {
                        continue;
                    }
                    for count in [0usize, 1, 7, 1000, 70_001] {
                        for in_place in [false, true] {
                            one(&c, k, dt, op, count, algo, in_place, (count + 1) % n);
                        }
                    }
                }
            }
        }
        c.barrier().unwrap();
    });
}

/// Item 11 of issue 19: `rounds` times, `n` ranks join, run one all-reduce (eager-sized and
/// rendezvous-sized in turn), check it and destroy their communicators at once: a send
/// reported done must still reach its peer, so every rank of every round succeeds.
pub fn collective_then_destroy(net: NetKind, n: usize, rounds: usize) {
    let mut cfg = config(Tuning::default());
    cfg.net = net;
    cfg.waiter.timeout = Duration::from_secs(30);
    for round in 0..rounds {
        let count = if round % 2 == 0 { 1000 } else { 50_000 };
        run_ranks(n, cfg.clone(), |c| {
            let r = c.rank();
            let send: Vec<f32> = (0..count).map(|i| (r + i % 7) as f32).collect();
            let mut recv = vec![0f32; count];
            c.all_reduce(&send, &mut recv, RedOp::Sum)
                .unwrap_or_else(|e| panic!("round {round} rank {r}: {e}"));
            for (i, v) in recv.iter().enumerate() {
                let want = (0..n).map(|k| (k + i % 7) as f32).sum::<f32>();
                assert_eq!(*v, want, "round {round} rank {r} element {i}");
            }
            drop(c);
        });
    }
}
