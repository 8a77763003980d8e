//! NCCL's NULL stream through the C ABI with a GPU runtime present (the simulated device):
//! a call on device memory the CPU cannot access is ordered on the runtime's default stream
//! (stream 0) and never touched by the CPU (the simulated device's memory faults on any CPU
//! access, so a call that ran on the CPU would crash the test); host memory still works,
//! blocking, after the work queued on the default stream.

mod common;

use std::ffi::c_void;

use common::*;
use roccl_capi_core::*;

const FLOAT: i32 = 7;
const SUM: i32 = 0;

#[test]
fn null_stream_is_the_default_stream_of_the_runtime() {
    std::env::set_var("ROCCL_DEVICE", "sim");
    std::env::set_var("ROCCL_SIM_DELAY_US", "200");
    let sim = sim_device().expect("ROCCL_DEVICE=sim gives the simulated device");
    sim.adopt_stream(0);
    let mut comms: [rocclComm_t; 2] = [std::ptr::null_mut(); 2];
    // SAFETY: storage for two handles; devlist may be NULL.
    assert_eq!(
        unsafe { rocclCommInitAll(comms.as_mut_ptr(), 2, std::ptr::null()) },
        0
    );
    let n = 3001usize;
    for round in 0..3usize {
        // Device memory the CPU cannot access, written late by a kernel on the default
        // stream; one thread drives both ranks in a group (they share the default stream, as
        // the ranks of one GPU do).
        let bufs: Vec<_> = (0..2)
            .map(|_| (sim.alloc_device_only(4 * n), sim.alloc_device_only(4 * n)))
            .collect();
        for (r, (s, _)) in bufs.iter().enumerate() {
            produce(&sim, 0, s, move |i| (100 * r + i + round) as f32);
        }
        assert_eq!(rocclGroupStart(), 0);
        for (r, (s, d)) in bufs.iter().enumerate() {
            // SAFETY: device buffers of 4n bytes, alive until the stream has passed the call;
            // NULL stream.
            let rc = unsafe {
                rocclAllReduce(
                    ptr(s),
                    ptr(d),
                    n,
                    FLOAT,
                    SUM,
                    comms[r],
                    std::ptr::null_mut(),
                )
            };
            assert_eq!(rc, 0);
        }
        assert_eq!(rocclGroupEnd(), 0);
        let snaps: Vec<_> = bufs
            .iter()
            .map(|(s, d)| consume(&sim, 0, d, &[s, d]))
            .collect();
        sim.synchronize(0).unwrap();
        for (r, snap) in snaps.iter().enumerate() {
            let got = floats(&snap.lock());
            assert!(
                got.iter()
                    .enumerate()
                    .all(|(i, v)| *v == (100 + 2 * i + 2 * round) as f32),
                "rank {r} round {round}: {:?}",
                &got[..4]
            );
        }
    }
    // Host memory with a NULL stream: blocking, as without a runtime (ranks as threads).
    std::thread::scope(|sc| {
        for (r, &c) in comms.iter().enumerate() {
            let c = c as usize;
            sc.spawn(move || {
                let send: Vec<f32> = (0..n).map(|i| (r + i) as f32).collect();
                let mut recv = vec![0f32; n];
                // SAFETY: host buffers of n floats, alive until this blocking call returns.
                let rc = unsafe {
                    rocclAllReduce(
                        send.as_ptr().cast::<c_void>(),
                        recv.as_mut_ptr().cast::<c_void>(),
                        n,
                        FLOAT,
                        SUM,
                        c as rocclComm_t,
                        std::ptr::null_mut(),
                    )
                };
                assert_eq!(rc, 0);
                assert!(recv
                    .iter()
                    .enumerate()
                    .all(|(i, v)| *v == (1 + 2 * i) as f32));
            });
        }
    });
    for c in comms {
        // SAFETY: handles made above, destroyed once.
        assert_eq!(unsafe { rocclCommDestroy(c) }, 0);
    }
}
