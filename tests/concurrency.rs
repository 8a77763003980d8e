//! Several threads calling one communicator at once: blocking, non-blocking and
//! stream-ordered calls interleave in any order on each rank, and as every call is the same
//! all-reduce, any order pairs correctly across ranks. Each test runs under a watchdog, so
//! a deadlock fails it instead of hanging the suite.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use common::*;
use roccl::algo::model::Tuning;
use roccl::comm::stream::{enqueue, Part};
use roccl::device::fake_gpu::FakeGpu;
use roccl::device::Device;
use roccl::{CallOpts, Collective, Communicator, DataType, RedOp};

/// Run `f` on another thread; fail if it has not finished within `limit`.
fn watchdog(limit: Duration, what: &str, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        let _ = tx.send(r);
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(())) => {}
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => panic!("{what}: still running after {limit:?} (deadlocked)"),
    }
}

/// The one call every thread makes: an 8-byte sum of ones.
fn all_reduce_part(n: usize, done: Arc<AtomicUsize>) -> Part {
    Arc::new(move |turn| {
        let mut x = 1i64.to_le_bytes();
        turn.run_raw(
            Collective::AllReduce(RedOp::Sum),
            DataType::I64,
            None,
            &mut x,
            &CallOpts::default(),
        )?;
        assert_eq!(i64::from_le_bytes(x), n as i64, "stream-ordered all-reduce");
        done.fetch_add(1, Ordering::Relaxed);
        Ok(())
    })
}

#[test]
fn many_threads_share_one_communicator() {
    const RANKS: usize = 3;
    const THREADS: usize = 6;
    const CALLS: usize = 1500;
    watchdog(Duration::from_secs(120), "3 ranks x 6 threads", || {
        let dev = FakeGpu::new(Duration::ZERO);
        run_ranks(RANKS, config(Tuning::default()), |c| {
            let c = Arc::new(c);
            let streamed = Arc::new(AtomicUsize::new(0));
            let as_dev: Arc<dyn Device> = dev.clone();
            std::thread::scope(|s| {
                for t in 0..THREADS {
                    let (c, streamed, as_dev, dev) = (&c, &streamed, &as_dev, &dev);
                    s.spawn(move || {
                        // A stream per thread: the calls of one stream are issued in its
                        // order (threads sharing a stream would race for it).
                        let stream = dev.create_stream();
                        let mut pending = Vec::new();
                        for k in 0..CALLS {
                            match (t + k) % 4 {
                                // Blocking, on this thread.
                                0 => {
                                    let mut x = [1i64];
                                    c.all_reduce_in_place(&mut x, RedOp::Sum).unwrap();
                                    assert_eq!(x[0], RANKS as i64);
                                }
                                // Non-blocking, waited for later.
                                1 => pending.push(c.all_reduce_async(vec![1i64], RedOp::Sum)),
                                // A job on the worker thread.
                                2 => {
                                    let part = all_reduce_part(RANKS, Arc::clone(streamed));
                                    c.enqueue(Box::new(move |turn| {
                                        if let Err(e) = part(turn) {
                                            turn.fail(&e);
                                        }
                                    }));
                                }
                                // Stream-ordered, on the simulated device's stream.
                                _ => enqueue(
                                    as_dev,
                                    &[stream],
                                    vec![(
                                        Arc::clone(c),
                                        all_reduce_part(RANKS, Arc::clone(streamed)),
                                    )],
                                    Duration::from_secs(60),
                                )
                                .unwrap(),
                            }
                            if pending.len() > 16 {
                                for h in pending.drain(..) {
                                    assert_eq!(h.wait().unwrap(), vec![RANKS as i64]);
                                }
                            }
                        }
                        for h in pending {
                            assert_eq!(h.wait().unwrap(), vec![RANKS as i64]);
                        }
                        dev.synchronize(stream).unwrap();
                    });
                }
            });
            // A last blocking call runs after every job queued before it.
            c.barrier().unwrap();
            assert!(c.async_error().is_none(), "{:?}", c.async_error());
            assert_eq!(streamed.load(Ordering::Relaxed), THREADS * CALLS / 2);
        });
    });
}

/// Non-blocking calls only, from many threads: each ticket is queued in order.
#[test]
fn many_threads_of_non_blocking_calls() {
    watchdog(
        Duration::from_secs(120),
        "non-blocking from 6 threads",
        || {
            run_ranks(3, config(Tuning::default()), |c| {
                std::thread::scope(|s| {
                    for _ in 0..6 {
                        let c = &c;
                        s.spawn(move || {
                            let hs: Vec<_> = (0..1500)
                                .map(|_| c.all_reduce_async(vec![2u32], RedOp::Sum))
                                .collect();
                            for h in hs {
                                assert_eq!(h.wait().unwrap(), vec![6u32]);
                            }
                        });
                    }
                });
            });
        },
    );
}

/// A job that panics breaks the communicator with the panic's text; later calls, queued or
/// blocking, fail at once instead of waiting for a turn that never comes.
#[test]
fn a_panicking_job_breaks_the_communicator_and_later_calls_fail() {
    watchdog(Duration::from_secs(60), "after a panic", || {
        run_ranks(1, config(Tuning::default()), |c| {
            c.enqueue(Box::new(|_| panic!("injected failure in a job")));
            let h = c.all_reduce_async(vec![1i32], RedOp::Sum);
            let e = h.wait().unwrap_err().to_string();
            assert!(e.contains("injected failure in a job"), "{e}");
            let mut x = [1i32];
            let e = c.all_reduce_in_place(&mut x, RedOp::Sum).unwrap_err();
            assert!(e.to_string().contains("panicked"), "{e}");
            let why = c.async_error().expect("broken");
            assert_eq!(why.kind, roccl::error::ErrorKind::Internal, "{why}");
            assert!(why.message.contains("injected failure in a job"), "{why}");
        });
    });
}

/// `async_error` never waits for the call in progress: a watchdog thread polls it while
/// another rank is missing and this rank's call waits for it.
#[test]
fn async_error_does_not_wait_for_the_running_call() {
    watchdog(Duration::from_secs(60), "async_error during a call", || {
        let id = roccl::UniqueId::new().unwrap();
        let mut cfg = config(Tuning::default());
        cfg.waiter.timeout = Duration::from_secs(30);
        let ready = Arc::new(std::sync::Barrier::new(2));
        let other = {
            let (id, cfg, ready) = (id, cfg.clone(), Arc::clone(&ready));
            std::thread::spawn(move || {
                let c = Communicator::init_with(&id, 2, 1, cfg).unwrap();
                // Joins, then makes no call until rank 0's watchdog has looked.
                ready.wait();
                let mut x = [1i32];
                c.all_reduce_in_place(&mut x, RedOp::Sum).unwrap();
            })
        };
        let c = Arc::new(Communicator::init_with(&id, 2, 0, cfg).unwrap());
        let busy = {
            let c = Arc::clone(&c);
            std::thread::spawn(move || {
                let mut x = [1i32];
                c.all_reduce_in_place(&mut x, RedOp::Sum).unwrap();
                assert_eq!(x[0], 2);
            })
        };
        std::thread::sleep(Duration::from_millis(300));
        let t0 = std::time::Instant::now();
        for _ in 0..100 {
            assert!(c.async_error().is_none());
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "async_error waited {:?} for the running call",
            t0.elapsed()
        );
        ready.wait();
        busy.join().unwrap();
        other.join().unwrap();
    });
}

/// A stream-ordered call whose stream never reaches it fails after the communicator's
/// timeout (the worker does not wait forever), and the next call says why.
#[test]
fn a_stream_that_never_arrives_times_out() {
    watchdog(Duration::from_secs(60), "stream wait", || {
        let dev = FakeGpu::new(Duration::ZERO);
        let mut cfg = config(Tuning::default());
        cfg.waiter.timeout = Duration::from_secs(1);
        run_ranks(1, cfg, |c| {
            let c = Arc::new(c);
            let stream = dev.create_stream();
            let (release, blocked) = mpsc::channel::<()>();
            let blocked = parking_lot::Mutex::new(blocked);
            // Work before the call that does not end (until the test releases it).
            dev.launch(stream, move || {
                let _ = blocked.lock().recv_timeout(Duration::from_secs(30));
            })
            .unwrap();
            let as_dev: Arc<dyn Device> = dev.clone();
            let n = Arc::new(AtomicUsize::new(0));
            enqueue(
                &as_dev,
                &[stream],
                vec![(Arc::clone(&c), all_reduce_part(1, Arc::clone(&n)))],
                Duration::from_secs(1),
            )
            .unwrap();
            let t0 = std::time::Instant::now();
            let why = loop {
                if let Some(e) = c.async_error() {
                    break e;
                }
                assert!(t0.elapsed() < Duration::from_secs(20), "no timeout");
                std::thread::sleep(Duration::from_millis(20));
            };
            assert!(
                why.message.contains("ROCCL_TIMEOUT") && why.message.contains("stream"),
                "{why}"
            );
            assert_eq!(n.load(Ordering::Relaxed), 0, "the call did not run");
            release.send(()).unwrap();
            dev.synchronize(stream).unwrap();
        });
    });
}

/// A stream-ordered call that timed out waiting for its stream gives its flags up only once
/// that stream has passed them: the stream still writes its "ready" flag when it gets there,
/// and a later call that reused the flags would see that late write lower its own and wait
/// until it times out (the hang CI once met when this test's neighbour ran beside
/// `many_threads_share_one_communicator`).
#[test]
fn a_timed_out_calls_flags_are_not_reused_while_its_stream_may_write_them() {
    watchdog(Duration::from_secs(60), "late stream write", || {
        let dev = FakeGpu::new(Duration::ZERO);
        let as_dev: Arc<dyn Device> = dev.clone();
        let mut cfg = config(Tuning::default());
        cfg.waiter.timeout = Duration::from_secs(1);
        let one = |cfg: &roccl::Config| {
            let id = roccl::UniqueId::new().unwrap();
            Arc::new(Communicator::init_with(&id, 1, 0, cfg.clone()).unwrap())
        };
        let (late, stuck) = (one(&cfg), one(&cfg));
        // The first call's stream is held up until the test lets it go; the call times out.
        let held = dev.create_stream();
        let (release, blocked) = mpsc::channel::<()>();
        let blocked = parking_lot::Mutex::new(blocked);
        dev.launch(held, move || {
            let _ = blocked.lock().recv_timeout(Duration::from_secs(30));
        })
        .unwrap();
        let n = Arc::new(AtomicUsize::new(0));
        let part = all_reduce_part(1, Arc::clone(&n));
        enqueue(
            &as_dev,
            &[held],
            vec![(Arc::clone(&late), part)],
            cfg.waiter.timeout,
        )
        .unwrap();
        let t0 = std::time::Instant::now();
        while late.async_error().is_none() {
            assert!(t0.elapsed() < Duration::from_secs(20), "no timeout");
            std::thread::sleep(Duration::from_millis(20));
        }
        // The next call (likely on the same flags, were they free) reaches its stream while
        // its communicator's worker is busy; then the first stream goes on and writes.
        let (open, gate) = mpsc::channel::<()>();
        let gate = parking_lot::Mutex::new(gate);
        stuck.enqueue(Box::new(move |_| {
            let _ = gate.lock().recv_timeout(Duration::from_secs(30));
        }));
        let other = dev.create_stream();
        let part = all_reduce_part(1, Arc::clone(&n));
        enqueue(
            &as_dev,
            &[other],
            vec![(Arc::clone(&stuck), part)],
            cfg.waiter.timeout,
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(100));
        release.send(()).unwrap();
        dev.synchronize(held).unwrap();
        open.send(()).unwrap();
        dev.synchronize(other).unwrap();
        assert!(stuck.async_error().is_none(), "{:?}", stuck.async_error());
        assert_eq!(
            n.load(Ordering::Relaxed),
            1,
            "the second call ran, the first did not"
        );
    });
}
