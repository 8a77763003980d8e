//! Stream-ordered collectives on device buffers through the C ABI, ranks as threads sharing
//! one GPU: every result checked, a short nccl-tests style table. `scripts/gpu-check.sh` runs
//! it built with `--features cuda` (or `hip`); with `ROCCL_DEVICE=sim` it runs on the
//! simulated device's device-only memory (as CI does).
//!
//!     gpu_check [RANKS] [MAX_BYTES]

use std::ffi::c_void;
use std::sync::{Arc, Barrier};
use std::time::Instant;

use roccl_capi_core::*;
use roccl_core::comm::stream::ops::{download, upload};

const FLOAT: i32 = 7;
const SUM: i32 = 0;

fn floats(v: impl Iterator<Item = f32>) -> Vec<u8> {
    v.flat_map(|x| x.to_le_bytes()).collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let ranks: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(2);
    let max: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(16 << 20);
    let dev = match runtime() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gpu_check: {e}");
            std::process::exit(2);
        }
    };
    let mut id = rocclUniqueId { internal: [0; 128] };
    // SAFETY: valid storage for the id.
    assert_eq!(unsafe { rocclGetUniqueId(&mut id) }, 0);
    println!("# gpu_check: {ranks} ranks as threads on one {} device; stream-ordered calls, results checked", dev.name());
    // What a NIC would need to read and write this GPU's memory without staging (NCCL and
    // RCCL over roccl's network plugin register it with regMrDmaBuf).
    match dev
        .alloc_device(1 << 20)
        .and_then(|b| dev.dmabuf_export(b.addr() + 4096, 8192))
    {
        Ok((fd, off)) => println!("# dmabuf export of device memory: ok (fd {fd:?}, offset {off})"),
        Err(e) => println!("# dmabuf export of device memory: no ({e})"),
    }
    // Whether the CPU could use device memory in place (an APU): what the runtime says, and
    // whether the CPU can read it at all (a probe that gets EFAULT, not a crash, when not).
    // Readable is not enough to use it (coherence with the GPU's caches is not checked here).
    match dev.alloc_device(1 << 20).and_then(|b| {
        let info = dev.classify(b.addr())?;
        Ok((info, roccl_core::os::cpu_readable(b.addr(), 4096)))
    }) {
        Ok((info, readable)) => println!(
            "# device memory: {:?}, host-accessible per the runtime: {}, CPU read probe: {}",
            info.kind,
            info.host_accessible,
            if readable {
                "readable"
            } else {
                "EFAULT (not mapped for the CPU)"
            }
        ),
        Err(e) => println!("# device memory: could not classify ({e})"),
    }
    println!(
        "#{:>13} {:>12} {:>10} {:>9} {:>7}",
        "op", "bytes", "time (us)", "busbw", "#wrong"
    );
    let barrier = Barrier::new(ranks);
    let wrong_total = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|sc| {
        for rank in 0..ranks {
            let (dev, barrier, wrong_total) = (Arc::clone(&dev), &barrier, &wrong_total);
            sc.spawn(move || {
                dev.bind_thread()
                    .expect("binding the runtime to this thread");
                let mut comm: rocclComm_t = std::ptr::null_mut();
                // SAFETY: valid storage; the id by value.
                assert_eq!(
                    unsafe { rocclCommInitRank(&mut comm, ranks as i32, id, rank as i32) },
                    0
                );
                let stream = dev.create_stream().expect("creating a stream");
                let sp = stream as *mut c_void;
                let mut bytes = 1024usize;
                while bytes <= max {
                    let n = bytes / 4;
                    for op in ["all_reduce", "all_gather", "broadcast"] {
                        let out_len = if op == "all_gather" {
                            bytes * ranks
                        } else {
                            bytes
                        };
                        let send = dev.alloc_device(bytes).expect("device memory");
                        let recv = dev.alloc_device(out_len).expect("device memory");
                        upload(
                            &dev,
                            stream,
                            send.as_ref(),
                            &floats((0..n).map(|i| (rank * 3 + i % 97) as f32)),
                        )
                        .unwrap();
                        let (s, r) = (send.addr() as *mut c_void, recv.addr() as *mut c_void);
                        let call = || -> i32 {
                            // SAFETY: device buffers of the sizes given, alive until synchronize.
                            unsafe {
                                match op {
                                    "all_reduce" => rocclAllReduce(s, r, n, FLOAT, SUM, comm, sp),
                                    "all_gather" => rocclAllGather(s, r, n, FLOAT, comm, sp),
                                    _ => rocclBroadcast(s, r, n, FLOAT, 0, comm, sp),
                                }
                            }
                        };
                        let mut times = Vec::new();
                        for it in 0..25 {
                            barrier.wait();
                            let t0 = Instant::now();
                            assert_eq!(call(), 0, "{op}");
                            dev.synchronize(stream).unwrap();
                            if it >= 5 {
                                times.push(t0.elapsed().as_secs_f64() * 1e6);
                            }
                        }
                        let got = download(&dev, stream, recv.as_ref(), out_len).unwrap();
                        let got: Vec<f32> = got
                            .chunks(4)
                            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                            .collect();
                        let want = |j: usize| -> f32 {
                            match op {
                                "all_reduce" => (0..ranks).map(|r| (r * 3 + j % 97) as f32).sum(),
                                "all_gather" => ((j / n) * 3 + (j % n) % 97) as f32,
                                _ => (j % 97) as f32,
                            }
                        };
                        let wrong = got
                            .iter()
                            .enumerate()
                            .filter(|(j, v)| **v != want(*j))
                            .count() as u64;
                        wrong_total.fetch_add(wrong, std::sync::atomic::Ordering::Relaxed);
                        times.sort_by(|a, b| a.total_cmp(b));
                        let med = times[times.len() / 2];
                        let nf = ranks as f64;
                        let factor = match op {
                            "all_reduce" => 2.0 * (nf - 1.0) / nf,
                            "all_gather" => (nf - 1.0) / nf * nf,
                            _ => 1.0,
                        };
                        if rank == 0 {
                            println!(
                                " {op:>13} {bytes:>12} {med:>10.2} {:>9.3} {wrong:>7}",
                                bytes as f64 * factor / med / 1e3
                            );
                        }
                    }
                    bytes *= 16;
                }
                let mut err = 0;
                // SAFETY: valid storage; a live handle.
                unsafe {
                    assert_eq!(rocclCommGetAsyncError(comm, &mut err), 0);
                    assert_eq!(err, 0, "async error");
                    assert_eq!(rocclCommDestroy(comm), 0);
                }
            });
        }
    });
    let w = wrong_total.load(std::sync::atomic::Ordering::Relaxed);
    println!("# wrong results: {w}");
    std::process::exit(if w == 0 { 0 } else { 1 });
}
