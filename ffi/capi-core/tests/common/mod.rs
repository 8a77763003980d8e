//! Helpers shared by the C ABI tests on the simulated device.
#![allow(dead_code)]

use std::ffi::c_void;
use std::sync::Arc;

use parking_lot::Mutex;
use roccl_core::device::fake_gpu::{FakeGpu, FakeGpuBuffer};

pub fn ptr(b: &FakeGpuBuffer) -> *mut c_void {
    b.addr() as *mut c_void
}

pub fn put(b: &FakeGpuBuffer, v: impl Fn(usize) -> f32) {
    b.with(|x| {
        for (i, e) in x.chunks_mut(4).enumerate() {
            e.copy_from_slice(&v(i).to_le_bytes());
        }
    })
}

pub fn floats(x: &[u8]) -> Vec<f32> {
    x.chunks(4)
        .map(|e| f32::from_le_bytes(e.try_into().unwrap()))
        .collect()
}

/// Producer writing `v` into `b` late on `stream`.
pub fn produce(
    sim: &FakeGpu,
    stream: usize,
    b: &Arc<FakeGpuBuffer>,
    v: impl Fn(usize) -> f32 + Send + Sync + 'static,
) {
    let b = Arc::clone(b);
    sim.launch(stream, move || put(&b, &v)).unwrap();
}

/// Consumer: snapshot `b`, then scribble over `bs`.
pub fn consume(
    sim: &FakeGpu,
    stream: usize,
    b: &Arc<FakeGpuBuffer>,
    bs: &[&Arc<FakeGpuBuffer>],
) -> Arc<Mutex<Vec<u8>>> {
    let snap = Arc::new(Mutex::new(Vec::new()));
    let (s, b) = (Arc::clone(&snap), Arc::clone(b));
    let bs: Vec<_> = bs.iter().map(|x| Arc::clone(x)).collect();
    sim.launch(stream, move || {
        *s.lock() = b.with(|x| x.to_vec());
        for x in &bs {
            x.with(|y| y.fill(0xee));
        }
    })
    .unwrap();
    snap
}
