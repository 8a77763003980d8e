//! The C ABI's stream calls on device memory the CPU cannot access, over an RDMA network
//! that takes GPU memory (the userspace RoCE v2 engine with `ROCCL_ROCEV2_SIM_GPU=1`):
//! broadcast, all-gather and a grouped send/receive move the memory GPU-direct (nothing is
//! staged), an all-reduce still stages. The simulated device's device-only memory is a
//! PROT_NONE reservation, so a CPU touch would crash the test.

mod common;

use std::ffi::c_void;
use std::sync::{Arc, Barrier};

use common::*;
use roccl_capi_core::*;
use roccl_core::comm::stream::ops::staged_bytes;

const FLOAT: i32 = 7;
const SUM: i32 = 0;

#[test]
fn c_stream_calls_move_device_memory_gpu_direct() {
    std::env::set_var("ROCCL_DEVICE", "sim");
    std::env::set_var("ROCCL_NET", "rocev2");
    std::env::set_var("ROCCL_ROCEV2_SIM_GPU", "1");
    std::env::set_var("ROCCL_GPU_DIRECT_MIN", "0");
    let sim = sim_device().expect("ROCCL_DEVICE=sim gives the simulated device");
    let mut id = rocclUniqueId { internal: [0; 128] };
    // SAFETY: valid storage for the id.
    assert_eq!(unsafe { rocclGetUniqueId(&mut id) }, 0);
    let (n, count) = (2usize, 3001usize);
    let gate = Barrier::new(n);
    std::thread::scope(|sc| {
        for rank in 0..n {
            let (sim, gate) = (Arc::clone(&sim), &gate);
            sc.spawn(move || {
                let mut comm: rocclComm_t = std::ptr::null_mut();
                // SAFETY: valid storage for the handle; the id is by value.
                assert_eq!(
                    unsafe { rocclCommInitRank(&mut comm, n as i32, id, rank as i32) },
                    0
                );
                let stream = sim.create_stream();
                let sp = stream as *mut c_void;
                let alloc = |elems: usize| sim.alloc_device_only(4 * elems);
                gate.wait();
                let before = staged_bytes();
                gate.wait();
                // Broadcast from rank 1, out of place there.
                let (bs, br) = (alloc(count), alloc(count));
                if rank == 1 {
                    produce(&sim, stream, &bs, |i| (3 * i) as f32);
                }
                let send = if rank == 1 {
                    ptr(&bs)
                } else {
                    std::ptr::null_mut()
                };
                // SAFETY: device buffers of `count` floats kept until the stream passed.
                assert_eq!(
                    unsafe { rocclBroadcast(send, ptr(&br), count, FLOAT, 1, comm, sp) },
                    0
                );
                let bsnap = consume(&sim, stream, &br, &[&br]);
                // All-gather.
                let (gs, gr) = (alloc(count), alloc(n * count));
                produce(&sim, stream, &gs, move |i| (rank * 10_000 + i) as f32);
                // SAFETY: as above.
                assert_eq!(
                    unsafe { rocclAllGather(ptr(&gs), ptr(&gr), count, FLOAT, comm, sp) },
                    0
                );
                let gsnap = consume(&sim, stream, &gr, &[&gr]);
                // A grouped exchange with the other rank.
                let (ps, pr) = (alloc(count), alloc(count));
                produce(&sim, stream, &ps, move |i| (rank * 7 + i) as f32);
                let peer = (1 - rank) as i32;
                assert_eq!(rocclGroupStart(), 0);
                // SAFETY: as above.
                unsafe {
                    assert_eq!(rocclSend(ptr(&ps), count, FLOAT, peer, comm, sp), 0);
                    assert_eq!(rocclRecv(ptr(&pr), count, FLOAT, peer, comm, sp), 0);
                }
                assert_eq!(rocclGroupEnd(), 0);
                let psnap = consume(&sim, stream, &pr, &[&pr]);
                sim.synchronize(stream).unwrap();
                gate.wait();
                let staged = staged_bytes() - before;
                gate.wait();
                assert_eq!(staged, 0, "rank {rank}: GPU-direct calls were staged");
                let want =
                    |s: &Arc<parking_lot::Mutex<Vec<u8>>>, f: &dyn Fn(usize) -> f32, what: &str| {
                        let got = floats(&s.lock());
                        assert_eq!(
                            got.len() % count,
                            0,
                            "rank {rank} {what}: consumer never ran"
                        );
                        for (i, v) in got.iter().enumerate() {
                            assert_eq!(*v, f(i), "rank {rank} {what}: element {i}");
                        }
                    };
                want(&bsnap, &|i| (3 * i) as f32, "broadcast");
                want(
                    &gsnap,
                    &|i| ((i / count) * 10_000 + i % count) as f32,
                    "all_gather",
                );
                want(&psnap, &|i| ((1 - rank) * 7 + i) as f32, "receive");
                // An all-reduce is staged (reductions run on host copies).
                let (rs, rr) = (alloc(count), alloc(count));
                produce(&sim, stream, &rs, move |i| (rank + i) as f32);
                let before = staged_bytes();
                // SAFETY: as above.
                assert_eq!(
                    unsafe { rocclAllReduce(ptr(&rs), ptr(&rr), count, FLOAT, SUM, comm, sp) },
                    0
                );
                assert!(
                    staged_bytes() > before,
                    "rank {rank}: the all-reduce was not staged"
                );
                let rsnap = consume(&sim, stream, &rr, &[&rr]);
                sim.synchronize(stream).unwrap();
                want(&rsnap, &|i| (1 + 2 * i) as f32, "all_reduce");
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
