//! Graph capture and NCCL's NULL stream through the C ABI, on a GPU runtime (or the simulated
//! device): `scripts/gpu-check.sh` runs it after `gpu_check`.
//!
//! 1. Capture: each rank (a thread with its own stream) captures an all-reduce and an
//!    in-place broadcast into one graph (the runtime's stream capture, global mode as
//!    PyTorch's default), then for each of `REPLAYS` rounds uploads new inputs into the
//!    captured buffers, replays the graph, and checks both results.
//! 2. NULL stream: one thread drives every rank in a group with stream NULL on device
//!    buffers; the results are read after synchronizing the default stream.
//!
//! A watchdog ends the program with exit code 3 if it hangs (a blocking host node of one rank
//! holding up another's on a shared host-function thread: docs/GPU.md).
//!
//!     gpu_capture [RANKS] [ELEMENTS]

use std::ffi::{c_int, c_void, CStr};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use roccl_capi_core::*;
use roccl_core::comm::stream::ops::{download, upload};
use roccl_core::device::StreamId;

const FLOAT: i32 = 7;
const SUM: i32 = 0;
const REPLAYS: usize = 20;

fn bytes_of(v: impl Iterator<Item = f32>) -> Vec<u8> {
    v.flat_map(|x| x.to_le_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Rank `r`'s all-reduce input element `i` at replay `k` (sums exact in f32).
fn input(r: usize, k: usize, i: usize) -> f32 {
    (1000 * r + 7 * k + i % 13) as f32
}

/// A runtime's stream capture: begin, end (an executable graph), launch.
struct Graphs {
    begin: Box<dyn Fn(StreamId) -> Result<(), String> + Send + Sync>,
    end: Box<dyn Fn(StreamId) -> Result<usize, String> + Send + Sync>,
    launch: Box<dyn Fn(usize, StreamId) -> Result<(), String> + Send + Sync>,
}

/// A symbol of `lib` as `F`.
///
/// # Safety
/// `F` must be the symbol's function type.
unsafe fn sym<F: Copy>(lib: &CStr, name: &CStr) -> Result<F, String> {
    // SAFETY: dlopen/dlsym with NUL-terminated names; the handle is kept for the process.
    let p = unsafe {
        let h = libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL);
        if h.is_null() {
            return Err(format!("{lib:?} could not be loaded"));
        }
        libc::dlsym(h, name.as_ptr())
    };
    if p.is_null() {
        return Err(format!("{lib:?} has no {name:?}"));
    }
    // SAFETY: the caller's contract; a function pointer is pointer-sized.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

type Begin = unsafe extern "C" fn(*mut c_void, c_int) -> c_int;
type End = unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> c_int;
type Launch = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;

fn graphs(name: &str) -> Result<Graphs, String> {
    let check = |what: &'static str, r: c_int| {
        if r == 0 {
            Ok(())
        } else {
            Err(format!("{what} failed: error {r}"))
        }
    };
    match name {
        "sim" => {
            let sim = sim_device().ok_or("ROCCL_DEVICE=sim without the simulated device")?;
            let made = Arc::new(parking_lot::Mutex::new(Vec::new()));
            let (s1, s2, s3, m2, m3) = (
                Arc::clone(&sim),
                Arc::clone(&sim),
                sim,
                Arc::clone(&made),
                made,
            );
            Ok(Graphs {
                begin: Box::new(move |s| s1.begin_capture(s).map_err(|e| e.to_string())),
                end: Box::new(move |s| {
                    let g = s2.end_capture(s).map_err(|e| e.to_string())?;
                    let mut m = m2.lock();
                    m.push(Arc::new(g));
                    Ok(m.len() - 1)
                }),
                launch: Box::new(move |g, s| {
                    let g = Arc::clone(&m3.lock()[g]);
                    s3.graph_launch(&g, s).map_err(|e| e.to_string())
                }),
            })
        }
        "cuda" => {
            let lib = c"libcuda.so.1";
            type Inst = unsafe extern "C" fn(*mut *mut c_void, *mut c_void, u64) -> c_int;
            // SAFETY: the driver's signatures (cuda.h; CUstreamCaptureMode is an int).
            let (begin, end, inst, launch) = unsafe {
                (
                    sym::<Begin>(lib, c"cuStreamBeginCapture_v2")?,
                    sym::<End>(lib, c"cuStreamEndCapture")?,
                    sym::<Inst>(lib, c"cuGraphInstantiateWithFlags")?,
                    sym::<Launch>(lib, c"cuGraphLaunch")?,
                )
            };
            Ok(Graphs {
                // SAFETY: a stream of this runtime; mode 0 = CU_STREAM_CAPTURE_MODE_GLOBAL.
                begin: Box::new(move |s| {
                    check("cuStreamBeginCapture", unsafe { begin(s as _, 0) })
                }),
                end: Box::new(move |s| {
                    let (mut g, mut x) = (std::ptr::null_mut(), std::ptr::null_mut());
                    // SAFETY: valid storage for the graph and its executable.
                    unsafe {
                        check("cuStreamEndCapture", end(s as _, &mut g))?;
                        check("cuGraphInstantiateWithFlags", inst(&mut x, g, 0))?;
                    }
                    Ok(x as usize)
                }),
                // SAFETY: an executable graph made above, on a stream of this runtime.
                launch: Box::new(move |g, s| {
                    check("cuGraphLaunch", unsafe { launch(g as _, s as _) })
                }),
            })
        }
        "hip" => {
            let lib = c"libamdhip64.so";
            type Inst = unsafe extern "C" fn(
                *mut *mut c_void,
                *mut c_void,
                *mut *mut c_void,
                *mut i8,
                usize,
            ) -> c_int;
            // SAFETY: the runtime's signatures (hip_runtime_api.h; the mode is an int).
            let (begin, end, inst, launch) = unsafe {
                (
                    sym::<Begin>(lib, c"hipStreamBeginCapture")?,
                    sym::<End>(lib, c"hipStreamEndCapture")?,
                    sym::<Inst>(lib, c"hipGraphInstantiate")?,
                    sym::<Launch>(lib, c"hipGraphLaunch")?,
                )
            };
            Ok(Graphs {
                // SAFETY: a stream of this runtime; mode 0 = hipStreamCaptureModeGlobal.
                begin: Box::new(move |s| {
                    check("hipStreamBeginCapture", unsafe { begin(s as _, 0) })
                }),
                end: Box::new(move |s| {
                    let (mut g, mut x) = (std::ptr::null_mut(), std::ptr::null_mut());
                    // SAFETY: valid storage for the graph and its executable; no log.
                    unsafe {
                        check("hipStreamEndCapture", end(s as _, &mut g))?;
                        check(
                            "hipGraphInstantiate",
                            inst(&mut x, g, std::ptr::null_mut(), std::ptr::null_mut(), 0),
                        )?;
                    }
                    Ok(x as usize)
                }),
                // SAFETY: an executable graph made above, on a stream of this runtime.
                launch: Box::new(move |g, s| {
                    check("hipGraphLaunch", unsafe { launch(g as _, s as _) })
                }),
            })
        }
        other => Err(format!("no graph API for the {other} runtime")),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let ranks: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(2);
    let n: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(1 << 20);
    let m = n.min(4096);
    let dev = runtime().unwrap_or_else(|e| {
        eprintln!("gpu_capture: {e}");
        std::process::exit(2)
    });
    let g = graphs(dev.name()).unwrap_or_else(|e| {
        eprintln!("gpu_capture: {e}");
        std::process::exit(2)
    });
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(120));
        eprintln!("gpu_capture: no result within 120 s (a hang: see docs/GPU.md, graph capture)");
        std::process::exit(3);
    });
    let mut id = rocclUniqueId { internal: [0; 128] };
    // SAFETY: valid storage for the id.
    assert_eq!(unsafe { rocclGetUniqueId(&mut id) }, 0);
    let barrier = Barrier::new(ranks);
    let wrong = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|sc| {
        for rank in 0..ranks {
            let (dev, g, barrier, wrong) = (Arc::clone(&dev), &g, &barrier, &wrong);
            sc.spawn(move || {
                dev.bind_thread().expect("binding the runtime");
                let mut comm: rocclComm_t = std::ptr::null_mut();
                // SAFETY: valid storage; the id by value.
                let rc = unsafe { rocclCommInitRank(&mut comm, ranks as i32, id, rank as i32) };
                assert_eq!(rc, 0);
                let s = dev.create_stream().expect("a stream");
                let sp = s as *mut c_void;
                let send = dev.alloc_device(4 * n).expect("device memory");
                let recv = dev.alloc_device(4 * n).expect("device memory");
                let bc = dev.alloc_device(4 * m).expect("device memory");
                barrier.wait();
                (g.begin)(s).expect("begin capture");
                // SAFETY: device buffers of the sizes given, alive as long as the graph.
                unsafe {
                    let (sb, rb) = (send.addr() as *const c_void, recv.addr() as *mut c_void);
                    let b = bc.addr() as *mut c_void;
                    assert_eq!(
                        rocclAllReduce(sb, rb, n, FLOAT, SUM, comm, sp),
                        0,
                        "captured all-reduce"
                    );
                    assert_eq!(
                        rocclBroadcast(b, b, m, FLOAT, 0, comm, sp),
                        0,
                        "captured broadcast"
                    );
                }
                let graph = (g.end)(s).expect("end capture");
                barrier.wait();
                for k in 0..REPLAYS {
                    let up = |b: &dyn roccl_core::device::Alloc, v: Vec<u8>| {
                        upload(&dev, s, b, &v).expect("upload")
                    };
                    up(send.as_ref(), bytes_of((0..n).map(|i| input(rank, k, i))));
                    let root = |i: usize| if rank == 0 { (k + i) as f32 } else { -1.0 };
                    up(bc.as_ref(), bytes_of((0..m).map(root)));
                    (g.launch)(graph, s).expect("graph launch");
                    dev.synchronize(s).expect("synchronize");
                    let sums = floats(&download(&dev, s, recv.as_ref(), 4 * n).unwrap());
                    let b = floats(&download(&dev, s, bc.as_ref(), 4 * m).unwrap());
                    let want = |i: usize| (0..ranks).map(|r| input(r, k, i)).sum::<f32>();
                    let bad = sums
                        .iter()
                        .enumerate()
                        .filter(|(i, v)| **v != want(*i))
                        .count()
                        + b.iter()
                            .enumerate()
                            .filter(|(i, v)| **v != (k + i) as f32)
                            .count();
                    if bad > 0 {
                        eprintln!("rank {rank} replay {k}: {bad} wrong elements");
                    }
                    wrong.fetch_add(bad, std::sync::atomic::Ordering::Relaxed);
                }
                // SAFETY: made above, destroyed once.
                assert_eq!(unsafe { rocclCommDestroy(comm) }, 0);
            });
        }
    });
    let bad = wrong.load(std::sync::atomic::Ordering::Relaxed);
    println!(
        "# graph capture: all-reduce of {n} floats + broadcast of {m}, {ranks} ranks, {REPLAYS} replays with new inputs: {}",
        if bad == 0 { "ok".to_string() } else { format!("{bad} WRONG") }
    );
    // NULL stream: every rank from this thread, in a group, on device memory.
    dev.bind_thread().expect("binding the runtime");
    if let Some(sim) = sim_device() {
        sim.adopt_stream(0);
    }
    let mut comms = vec![std::ptr::null_mut(); ranks];
    // SAFETY: storage for `ranks` handles; no device list.
    let rc = unsafe { rocclCommInitAll(comms.as_mut_ptr(), ranks as c_int, std::ptr::null()) };
    assert_eq!(rc, 0);
    let bufs: Vec<_> = (0..ranks)
        .map(|r| {
            let (s, d) = (
                dev.alloc_device(4 * n).unwrap(),
                dev.alloc_device(4 * n).unwrap(),
            );
            upload(
                &dev,
                0,
                s.as_ref(),
                &bytes_of((0..n).map(|i| input(r, 0, i))),
            )
            .unwrap();
            (s, d)
        })
        .collect();
    assert_eq!(rocclGroupStart(), 0);
    for (r, (s, d)) in bufs.iter().enumerate() {
        // SAFETY: device buffers of 4n bytes, alive until the default stream is synchronized.
        let rc = unsafe {
            rocclAllReduce(
                s.addr() as _,
                d.addr() as _,
                n,
                FLOAT,
                SUM,
                comms[r],
                std::ptr::null_mut(),
            )
        };
        assert_eq!(rc, 0, "all-reduce on the NULL stream");
    }
    assert_eq!(rocclGroupEnd(), 0);
    dev.synchronize(0)
        .expect("synchronizing the default stream");
    let mut bad = 0;
    for (_, d) in &bufs {
        let got = floats(&download(&dev, 0, d.as_ref(), 4 * n).unwrap());
        let want = |i: usize| (0..ranks).map(|r| input(r, 0, i)).sum::<f32>();
        bad += got
            .iter()
            .enumerate()
            .filter(|(i, v)| **v != want(*i))
            .count();
    }
    for c in comms {
        // SAFETY: made above, destroyed once.
        assert_eq!(unsafe { rocclCommDestroy(c) }, 0);
    }
    println!(
        "# NULL stream: all-reduce of {n} floats on device memory, {ranks} ranks in a group: {}",
        if bad == 0 {
            "ok".to_string()
        } else {
            format!("{bad} WRONG")
        }
    );
    if bad > 0 || wrong.load(std::sync::atomic::Ordering::Relaxed) > 0 {
        std::process::exit(1);
    }
}
