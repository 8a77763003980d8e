//! RDMA: the RoCE v2 wire format, the userspace RC engine, the verbs layer.
pub mod engine;
#[cfg(feature = "verbs")]
pub mod ibv;
pub mod mem;
pub mod reorder;
pub mod select;
pub mod udp;
pub mod verb_errors;
pub mod verbs;
pub mod wire;

#[cfg(test)]
mod engine_pair;

/// `ROCCL_ROCEV2_SIM_GPU=1`: the userspace engine poses as a NIC that reaches GPU memory: it
/// advertises GPU pointers and dmabufs (NCCL_PTR_CUDA | NCCL_PTR_DMABUF), takes host memory
/// registered as GPU memory, and maps registered dmabufs (memfds in tests) itself, so the
/// GPU-direct path (no eager or inline copies, dmabuf registration, flushes through the NIC)
/// runs without a GPU (tests/plugin/run.sh, net::rocev2 tests).
pub(crate) fn sim_gpu() -> bool {
    crate::envvar::switch_or("ROCCL_ROCEV2_SIM_GPU", false)
}
