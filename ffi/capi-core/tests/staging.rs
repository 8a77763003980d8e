//! C ABI calls with streams on device memory the CPU cannot access (the simulated device's
//! `alloc_device_only`): the buffers go through staging copies on the stream. A producer
//! writes the input late on the stream and a consumer snapshots the output and scribbles
//! over the buffers right after the call; staging copies out of order would show in the
//! snapshots.

mod common;

use std::ffi::c_void;
use std::sync::Arc;

use common::*;
use roccl_capi_core::*;
use roccl_core::device::{Device, MemKind};

const FLOAT: i32 = 7;
const SUM: i32 = 0;

#[test]
fn device_only_buffers_are_staged_in_stream_order() {
    std::env::set_var("ROCCL_DEVICE", "sim");
    std::env::set_var("ROCCL_SIM_DELAY_US", "200");
    // Element-wise calls of at least 8 KiB run as a pipeline of ~4 KiB steps.
    std::env::set_var("ROCCL_STREAM_CHUNK", "4K");
    let sim = sim_device().expect("ROCCL_DEVICE=sim gives the simulated device");
    let probe = sim.alloc_device_only(8);
    let info = sim.classify(probe.addr()).unwrap();
    assert!(info.kind == MemKind::Device && !info.host_accessible);
    let mut id = rocclUniqueId { internal: [0; 128] };
    // SAFETY: valid storage for the id.
    assert_eq!(unsafe { rocclGetUniqueId(&mut id) }, 0);
    let n = 5003usize;
    std::thread::scope(|sc| {
        for rank in 0..2usize {
            let sim = Arc::clone(&sim);
            sc.spawn(move || {
                let mut comm: rocclComm_t = std::ptr::null_mut();
                // SAFETY: valid storage for the handle; the id is by value.
                assert_eq!(
                    unsafe { rocclCommInitRank(&mut comm, 2, id, rank as i32) },
                    0
                );
                let stream = sim.create_stream();
                let sp = stream as *mut c_void;
                for round in 0..3usize {
                    // Device memory the CPU cannot access, except rank 1's in round 1 (as on
                    // an APU): the pipeline's steps must not depend on the kind of memory.
                    let alloc = |b: usize| {
                        if rank == 1 && round == 1 {
                            sim.alloc(b)
                        } else {
                            sim.alloc_device_only(b)
                        }
                    };
                    // Out-of-place all-reduce.
                    let (sb, rb) = (alloc(4 * n), alloc(4 * n));
                    produce(&sim, stream, &sb, move |i| (rank * 10 + i + round) as f32);
                    // SAFETY: device buffers of 4n bytes, kept alive until the stream passed.
                    assert_eq!(
                        unsafe { rocclAllReduce(ptr(&sb), ptr(&rb), n, FLOAT, SUM, comm, sp) },
                        0
                    );
                    let snap = consume(&sim, stream, &rb, &[&sb, &rb]);
                    // In-place all-reduce.
                    let ib = alloc(4 * n);
                    produce(&sim, stream, &ib, move |i| (rank + 2 * i) as f32);
                    // SAFETY: as above.
                    assert_eq!(
                        unsafe { rocclAllReduce(ptr(&ib), ptr(&ib), n, FLOAT, SUM, comm, sp) },
                        0
                    );
                    let isnap = consume(&sim, stream, &ib, &[&ib]);
                    // Reduce to rank 1: rank 0's output buffer must stay as it was.
                    let (qs, qr) = (alloc(4 * n), alloc(4 * n));
                    put(&qr, |_| -3.0);
                    produce(&sim, stream, &qs, move |i| (rank + i) as f32);
                    // SAFETY: as above.
                    assert_eq!(
                        unsafe { rocclReduce(ptr(&qs), ptr(&qr), n, FLOAT, SUM, 1, comm, sp) },
                        0
                    );
                    let qsnap = consume(&sim, stream, &qr, &[&qs]);
                    // Broadcast from rank 0 (rank 1 passes no send buffer).
                    let bb = alloc(4 * n);
                    if rank == 0 {
                        produce(&sim, stream, &bb, move |i| (7 * i + round) as f32);
                    }
                    let send = if rank == 0 {
                        ptr(&bb)
                    } else {
                        std::ptr::null_mut()
                    };
                    // SAFETY: as above.
                    assert_eq!(
                        unsafe { rocclBroadcast(send, ptr(&bb), n, FLOAT, 0, comm, sp) },
                        0
                    );
                    let bsnap = consume(&sim, stream, &bb, &[&bb]);
                    // Send/receive pair in a group.
                    let (ps, pr) = (alloc(4 * n), alloc(4 * n));
                    produce(&sim, stream, &ps, move |i| (100 * rank + i) as f32);
                    assert_eq!(rocclGroupStart(), 0);
                    // SAFETY: as above.
                    unsafe {
                        assert_eq!(
                            rocclSend(ptr(&ps), n, FLOAT, (1 - rank) as i32, comm, sp),
                            0
                        );
                        assert_eq!(
                            rocclRecv(ptr(&pr), n, FLOAT, (1 - rank) as i32, comm, sp),
                            0
                        );
                    }
                    assert_eq!(rocclGroupEnd(), 0);
                    let psnap = consume(&sim, stream, &pr, &[&ps, &pr]);
                    sim.synchronize(stream).unwrap();
                    let what = format!("rank {rank} round {round}");
                    let got = floats(&snap.lock());
                    assert!(
                        got.iter()
                            .enumerate()
                            .all(|(i, v)| *v == (10 + 2 * i + 2 * round) as f32),
                        "{what}: all_reduce {:?}",
                        &got[..4]
                    );
                    let got = floats(&isnap.lock());
                    assert!(
                        got.iter()
                            .enumerate()
                            .all(|(i, v)| *v == (1 + 4 * i) as f32),
                        "{what}: in place {:?}",
                        &got[..4]
                    );
                    let got = floats(&qsnap.lock());
                    if rank == 1 {
                        assert!(
                            got.iter()
                                .enumerate()
                                .all(|(i, v)| *v == (1 + 2 * i) as f32),
                            "{what}: reduce {:?}",
                            &got[..4]
                        );
                    } else {
                        assert!(
                            got.iter().all(|v| *v == -3.0),
                            "{what}: non-root reduce output written: {:?}",
                            &got[..4]
                        );
                    }
                    let got = floats(&bsnap.lock());
                    assert!(
                        got.iter()
                            .enumerate()
                            .all(|(i, v)| *v == (7 * i + round) as f32),
                        "{what}: broadcast {:?}",
                        &got[..4]
                    );
                    let got = floats(&psnap.lock());
                    assert!(
                        got.iter()
                            .enumerate()
                            .all(|(i, v)| *v == (100 * (1 - rank) + i) as f32),
                        "{what}: send/recv {:?}",
                        &got[..4]
                    );
                }
                let mut err = 0;
                // SAFETY: valid storage for the result.
                assert_eq!(unsafe { rocclCommGetAsyncError(comm, &mut err) }, 0);
                assert_eq!(err, 0);
                // SAFETY: a live handle.
                assert_eq!(unsafe { rocclCommDestroy(comm) }, 0);
            });
        }
    });
}

/// Ranks may mix a blocking call on host memory with a stream call on device memory: a big
/// all-reduce runs as the same parts on both (the blocking path runs them one after the
/// other, the stream path pipelines them).
#[test]
fn blocking_and_pipelined_stream_calls_agree() {
    std::env::set_var("ROCCL_DEVICE", "sim");
    std::env::set_var("ROCCL_SIM_DELAY_US", "200");
    std::env::set_var("ROCCL_STREAM_CHUNK", "4K");
    let sim = sim_device().expect("ROCCL_DEVICE=sim gives the simulated device");
    let mut id = rocclUniqueId { internal: [0; 128] };
    // SAFETY: valid storage for the id.
    assert_eq!(unsafe { rocclGetUniqueId(&mut id) }, 0);
    let n = 6007usize;
    std::thread::scope(|sc| {
        for rank in 0..2usize {
            let sim = Arc::clone(&sim);
            sc.spawn(move || {
                let mut comm: rocclComm_t = std::ptr::null_mut();
                // SAFETY: valid storage for the handle; the id is by value.
                assert_eq!(
                    unsafe { rocclCommInitRank(&mut comm, 2, id, rank as i32) },
                    0
                );
                for round in 0..3usize {
                    let want = |i: usize| (1 + 2 * (i + round)) as f32;
                    let got = if rank == 0 {
                        // Blocking, host memory.
                        let mut b: Vec<f32> = (0..n).map(|i| (i + round) as f32).collect();
                        let p = b.as_mut_ptr() as *mut c_void;
                        // SAFETY: a host buffer of n floats, alive for the blocking call.
                        assert_eq!(
                            unsafe {
                                rocclAllReduce(p, p, n, FLOAT, SUM, comm, std::ptr::null_mut())
                            },
                            0
                        );
                        b
                    } else {
                        // On a stream, device memory the CPU cannot access, written late.
                        let stream = sim.create_stream();
                        let b = sim.alloc_device_only(4 * n);
                        produce(&sim, stream, &b, move |i| (1 + i + round) as f32);
                        // SAFETY: a device buffer of n floats, alive until the stream passed.
                        assert_eq!(
                            unsafe {
                                rocclAllReduce(
                                    ptr(&b),
                                    ptr(&b),
                                    n,
                                    FLOAT,
                                    SUM,
                                    comm,
                                    stream as *mut c_void,
                                )
                            },
                            0
                        );
                        let snap = consume(&sim, stream, &b, &[&b]);
                        sim.synchronize(stream).unwrap();
                        let v = floats(&snap.lock());
                        v
                    };
                    assert!(
                        got.iter().enumerate().all(|(i, v)| *v == want(i)),
                        "rank {rank} round {round}: {:?}",
                        &got[..4]
                    );
                }
                // SAFETY: a live handle.
                assert_eq!(unsafe { rocclCommDestroy(comm) }, 0);
            });
        }
    });
}
