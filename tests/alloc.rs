//! No allocation on the hot path: once a communicator has run a collective of a given shape
//! (connections made, staging sized), running it again allocates nothing on the calling
//! thread. A counting global allocator counts the allocations of the threads that opted in;
//! `ROCCL_ALLOC_TRACE=1` prints where each one came from.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use common::*;
use roccl::algo::model::Tuning;
use roccl::net::NetKind;
use roccl::{Algo, CallOpts, Collective, Communicator, DataType, RedOp};

struct Counting;

/// `ROCCL_ALLOC_TRACE` is set (read before counting starts: reading it allocates).
static TRACE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<usize> = const { Cell::new(0) };
    /// Backtrace of the first allocation counted.
    static FIRST: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

fn note() {
    // `try_with`: the allocator also runs while thread locals are torn down.
    let _ = COUNTING.try_with(|c| {
        if c.get() {
            let first = COUNT.try_with(|n| {
                n.set(n.get() + 1);
                n.get() == 1
            });
            if first == Ok(true) || TRACE.load(std::sync::atomic::Ordering::Relaxed) {
                // Where it came from (the capture allocates: stop counting meanwhile).
                c.set(false);
                let bt = std::backtrace::Backtrace::force_capture().to_string();
                if TRACE.load(std::sync::atomic::Ordering::Relaxed) {
                    eprintln!("allocation at:\n{bt}");
                }
                let _ = FIRST.try_with(|f| *f.borrow_mut() = bt);
                c.set(true);
            }
        }
    });
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note();
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note();
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        note();
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, n) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations made by this thread while `f` runs.
fn count_allocs(f: impl FnOnce()) -> usize {
    let trace = std::env::var_os("ROCCL_ALLOC_TRACE").is_some();
    TRACE.store(trace, std::sync::atomic::Ordering::Relaxed);
    COUNT.with(|n| n.set(0));
    COUNTING.with(|c| c.set(true));
    f();
    COUNTING.with(|c| c.set(false));
    COUNT.with(|n| n.get())
}

/// One collective call as the benchmark makes it (out of place, f32 sum).
fn call(c: &Communicator, coll: Collective, algo: Algo, send: &[u8], recv: &mut [u8]) {
    let opts = CallOpts {
        algo: Some(algo),
        ..Default::default()
    };
    let send = match coll {
        Collective::Broadcast { .. } => None,
        _ => Some(send),
    };
    c.run_raw(coll, DataType::F32, send, recv, &opts)
        .unwrap_or_else(|e| panic!("{coll:?} {algo}: {e}"));
}

/// (collective, algorithm, send bytes, recv bytes) for `b` bytes per rank: every collective
/// with every algorithm it has (`common::algos`, as the correctness matrix).
fn shapes(n: usize, b: usize) -> Vec<(Collective, Algo, usize, usize)> {
    let mut v = Vec::new();
    for k in KINDS {
        let (coll, sb, rb) = match k {
            Kind::AllReduce => (Collective::AllReduce(RedOp::Sum), b, b),
            Kind::Broadcast => (Collective::Broadcast { root: 0 }, b, b),
            Kind::Reduce => (
                Collective::Reduce {
                    op: RedOp::Sum,
                    root: n - 1,
                },
                b,
                b,
            ),
            Kind::AllGather => (Collective::AllGather, b, n * b),
            Kind::ReduceScatter => (Collective::ReduceScatter(RedOp::Sum), n * b, b),
            Kind::AllToAll => (Collective::AllToAll, n * b, n * b),
        };
        for &algo in algos(k) {
            v.push((coll, algo, sb, rb));
        }
    }
    v
}

/// Make this thread wait on a contended `parking_lot` lock once: its first wait sets up
/// the process's (and this thread's) parking tables, a one-time allocation that would
/// otherwise land in whichever call first meets contention on a roccl lock.
fn park_once() {
    let m = parking_lot::Mutex::new(());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| {
            let _g = m.lock();
            tx.send(()).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
        });
        rx.recv().unwrap();
        drop(m.lock());
    });
}

/// Run every shape a few times to warm up, then count the allocations of 10 more calls:
/// small calls (one message) and large ones (many pipelined slices on two channels).
fn no_allocs(net: NetKind, n: usize) {
    let mut cfg = config(Tuning {
        channels: Some(2),
        ..Default::default()
    });
    cfg.net = net;
    let failures = std::sync::Mutex::new(Vec::new());
    run_ranks(n, cfg, |c| {
        park_once();
        let all = shapes(n, 256).into_iter().chain(shapes(n, 1 << 20));
        for (coll, algo, sb, rb) in all {
            if is_flat(algo) && !c.shm_collectives() {
                continue;
            }
            let send = vec![1u8; sb];
            let mut recv = vec![0u8; rb];
            for _ in 0..3 {
                call(&c, coll, algo, &send, &mut recv);
            }
            // Every rank warmed up before any counts, and counts before any moves on (a
            // peer opening the next shape's connections is not this shape's cost).
            c.barrier().unwrap();
            let allocs = count_allocs(|| {
                for _ in 0..10 {
                    call(&c, coll, algo, &send, &mut recv);
                }
            });
            c.barrier().unwrap();
            if allocs > 0 {
                let first = FIRST.with(|f| f.borrow().clone());
                // The frames of roccl only, to keep the message short.
                let frames: Vec<&str> = first
                    .lines()
                    .filter(|l| !l.trim_start().starts_with("at "))
                    .skip(6)
                    .take(24)
                    .collect();
                failures.lock().unwrap().push(format!(
                    "rank {} over {net:?}: {coll:?} {algo} {sb} bytes: {allocs} allocations in 10 calls; the first from:\n{}",
                    c.rank(),
                    frames.join("\n")
                ));
            }
        }
        c.barrier().unwrap();
    });
    let f = failures.into_inner().unwrap();
    assert!(
        f.is_empty(),
        "allocations on the hot path:\n{}",
        f.join("\n")
    );
}

#[test]
fn no_allocation_per_call_tcp() {
    no_allocs(NetKind::Tcp, 3);
}

#[test]
fn no_allocation_per_call_shm() {
    no_allocs(NetKind::Shm, 4);
}

#[test]
fn no_allocation_per_call_rocev2() {
    no_allocs(NetKind::RoceV2, 2);
}

/// The counter counts: an allocation inside the window is seen.
#[test]
fn the_counter_sees_allocations() {
    let n = count_allocs(|| {
        let v: Vec<u64> = std::hint::black_box(vec![1, 2, 3]);
        drop(v);
    });
    assert_eq!(n, 1);
}

/// The path of the C ABI and `libroccl-nccl.so` for host memory
/// (`comm::stream::ops::run_now`: a blocking call on raw buffers) allocates nothing per call
/// either: small all-reduces and a send/receive pair, over shared memory (the default between
/// local ranks) and TCP.
#[test]
fn no_allocation_per_call_on_raw_buffers() {
    use roccl::comm::stream::ops::{run_now, Op};
    for net in [NetKind::Auto, NetKind::Tcp] {
        let mut cfg = config(Tuning::default());
        cfg.net = net;
        let failures = std::sync::Mutex::new(Vec::new());
        run_ranks(2, cfg, |c| {
            park_once();
            let (me, n) = (c.rank(), c.nranks());
            let send = vec![1u8; 4096];
            let mut recv = vec![0u8; 4096];
            let mut inbox = vec![0u8; 64];
            let ops = [
                Op::Coll {
                    coll: Collective::AllReduce(RedOp::Sum),
                    dt: DataType::F32,
                    send: Some(raw(&send)),
                    recv: raw_mut(&mut recv),
                    premul: None,
                },
                Op::Send {
                    peer: (me + 1) % n,
                    buf: raw(&send[..64]),
                },
                Op::Recv {
                    peer: (me + n - 1) % n,
                    buf: raw_mut(&mut inbox),
                },
            ];
            let call = || {
                // SAFETY: host buffers valid and not otherwise used during the call; the
                // receive does not overlap the send (different vectors).
                unsafe { run_now(&c, &ops) }.unwrap();
            };
            for _ in 0..3 {
                call();
            }
            c.barrier().unwrap();
            let allocs = count_allocs(|| {
                for _ in 0..10 {
                    call();
                }
            });
            c.barrier().unwrap();
            if allocs > 0 {
                let first = FIRST.with(|f| f.borrow().clone());
                failures.lock().unwrap().push(format!(
                    "rank {} over {net:?}: {allocs} allocations in 10 calls; the first from:\n{first}",
                    c.rank()
                ));
            }
        });
        let f = failures.into_inner().unwrap();
        assert!(
            f.is_empty(),
            "allocations on the raw-buffer path:\n{}",
            f.join("\n")
        );
    }
}
