//! Graph capture through the C ABI on the simulated device: each rank (a thread with its own
//! stream) captures a producer copy, an all-reduce (big enough to run as a pipeline of staged
//! steps), a kernel that derives the broadcast's input, an in-place broadcast and a consumer
//! into one graph, then replays it 100 times with new inputs written on the stream before
//! each replay; every replay's results are checked. Work that cannot be captured is refused
//! with a message and invalidates the capture, as CUDA does.

mod common;

use std::sync::Arc;

use common::*;
use roccl_capi_core::*;
use roccl_core::device::Device;

const FLOAT: i32 = 7;
const SUM: i32 = 0;
const REPLAYS: usize = 100;

/// Rank `r`'s input element `i` at replay `k` (sums stay exact in f32).
fn input(r: usize, k: usize, i: usize) -> f32 {
    (1000 * r + 7 * k + i % 13) as f32
}

#[test]
fn captured_collectives_replay_with_each_replays_inputs() {
    std::env::set_var("ROCCL_DEVICE", "sim");
    std::env::set_var("ROCCL_SIM_DELAY_US", "20");
    // The all-reduce of 12 KB runs as 3 steps of 4 KiB.
    std::env::set_var("ROCCL_STREAM_CHUNK", "4K");
    let sim = sim_device().expect("ROCCL_DEVICE=sim gives the simulated device");
    let mut id = rocclUniqueId { internal: [0; 128] };
    // SAFETY: valid storage for the id.
    assert_eq!(unsafe { rocclGetUniqueId(&mut id) }, 0);
    let (n, m) = (3000usize, 100usize);
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
                let sp = stream as *mut std::ffi::c_void;
                let inp = sim.alloc_device_only(4 * n);
                let (send, recv) = (sim.alloc_device_only(4 * n), sim.alloc_device_only(4 * n));
                let bc = sim.alloc(4 * m);
                let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
                sim.begin_capture(stream).unwrap();
                // Producer: the input buffer into the all-reduce's send buffer.
                // SAFETY: device buffers of 4n bytes, alive as long as the graph.
                unsafe { sim.copy_async(stream, send.addr(), inp.addr(), 4 * n) }.unwrap();
                // SAFETY: device buffers of 4n bytes, alive as long as the graph.
                let rc = unsafe { rocclAllReduce(ptr(&send), ptr(&recv), n, FLOAT, SUM, comm, sp) };
                assert_eq!(rc, 0, "capturing an all-reduce");
                // A kernel: the root broadcasts the first m sums plus one; the others' input
                // must not show.
                let (r2, b2) = (Arc::clone(&recv), Arc::clone(&bc));
                sim.launch(stream, move || {
                    let sums = r2.with(|x| floats(&x[..4 * m]));
                    put(&b2, |i| if rank == 0 { sums[i] + 1.0 } else { -5.0 });
                })
                .unwrap();
                // SAFETY: a buffer of 4m bytes, alive as long as the graph; in place.
                let rc = unsafe { rocclBroadcast(ptr(&bc), ptr(&bc), m, FLOAT, 0, comm, sp) };
                assert_eq!(rc, 0, "capturing a broadcast");
                // Consumer: snapshot both results, then scribble over them.
                let (r3, b3, out) = (Arc::clone(&recv), Arc::clone(&bc), Arc::clone(&seen));
                sim.launch(stream, move || {
                    out.lock()
                        .push((r3.with(|x| floats(x)), b3.with(|x| floats(x))));
                    r3.with(|x| x.fill(0xee));
                    b3.with(|x| x.fill(0xee));
                })
                .unwrap();
                let graph = sim.end_capture(stream).unwrap();
                assert!(seen.lock().is_empty(), "capture runs nothing");
                for k in 0..REPLAYS {
                    produce(&sim, stream, &inp, move |i| input(rank, k, i));
                    sim.graph_launch(&graph, stream).unwrap();
                }
                sim.synchronize(stream).unwrap();
                let seen = seen.lock();
                assert_eq!(seen.len(), REPLAYS, "rank {rank}: one result per replay");
                for (k, (sums, bcast)) in seen.iter().enumerate() {
                    let want = |i: usize| input(0, k, i) + input(1, k, i);
                    assert!(
                        sums.iter().enumerate().all(|(i, v)| *v == want(i)),
                        "rank {rank} replay {k}: all-reduce {:?}",
                        &sums[..4]
                    );
                    assert!(
                        bcast.iter().enumerate().all(|(i, v)| *v == want(i) + 1.0),
                        "rank {rank} replay {k}: broadcast {:?}",
                        &bcast[..4]
                    );
                }
                // SAFETY: made above, destroyed once.
                assert_eq!(unsafe { rocclCommDestroy(comm) }, 0);
            });
        }
    });
}

/// What a captured stream cannot do is refused with a message, and the capture is then
/// invalid; a roccl group spanning a captured stream and another is refused by name.
#[test]
fn non_capturable_work_is_refused() {
    std::env::set_var("ROCCL_DEVICE", "sim");
    let sim = sim_device().expect("ROCCL_DEVICE=sim gives the simulated device");
    let s = sim.create_stream();
    sim.begin_capture(s).unwrap();
    let e = sim.synchronize(s).unwrap_err().to_string();
    assert!(e.contains("not capturable"), "{e}");
    let e = sim.query(s).unwrap_err().to_string();
    assert!(e.contains("not capturable"), "{e}");
    let e = sim.end_capture(s).err().expect("invalidated").to_string();
    assert!(e.contains("invalidated") && e.contains("synchroniz"), "{e}");
    // A group on a captured stream and another one.
    let mut comm: rocclComm_t = std::ptr::null_mut();
    // SAFETY: storage for one handle.
    assert_eq!(
        unsafe { rocclCommInitAll(&mut comm, 1, std::ptr::null()) },
        0
    );
    let (a, b) = (sim.create_stream(), sim.create_stream());
    let (x, y) = (sim.alloc_device_only(64), sim.alloc_device_only(64));
    sim.begin_capture(a).unwrap();
    assert_eq!(rocclGroupStart(), 0);
    // SAFETY: device buffers of 64 bytes, alive until the group fails.
    unsafe {
        assert_eq!(
            rocclAllReduce(ptr(&x), ptr(&x), 16, FLOAT, SUM, comm, a as _),
            0
        );
        assert_eq!(
            rocclAllReduce(ptr(&y), ptr(&y), 16, FLOAT, SUM, comm, b as _),
            0
        );
    }
    let rc = rocclGroupEnd();
    // SAFETY: the library's NUL-terminated message.
    let msg = unsafe { std::ffi::CStr::from_ptr(rocclGetLastError(std::ptr::null_mut())) }
        .to_string_lossy()
        .into_owned();
    assert_ne!(rc, 0, "{msg}");
    assert!(msg.contains("captured"), "{msg}");
    let g = sim.end_capture(a).unwrap();
    assert!(g.is_empty(), "the refused group recorded nothing");
    // SAFETY: made above, destroyed once.
    assert_eq!(unsafe { rocclCommDestroy(comm) }, 0);
}
