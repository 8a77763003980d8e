//! GPU memory on the connections: how it may be registered toward each peer, and the
//! registrations kept from call to call (a GPU buffer registered once, reused while it
//! lives).

/// Most GPU registrations kept across calls, over all connections.
pub(crate) const DEV_CACHE: usize = 64;

/// A GPU buffer registered on one connection, kept after the call: the next call on the same
/// memory reuses it. `ident` tells memory freed and allocated again at the same address
/// apart: the runtime's allocation id (`(u64::MAX, id)`), else the dmabuf's device and inode
/// (the registration keeps the old dmabuf, and so its inode, alive).
pub(crate) struct DevCached {
    pub peer: usize,
    pub ch: usize,
    pub send: bool,
    pub addr: usize,
    pub len: usize,
    pub ident: (u64, u64),
    pub mr: crate::net::MemHandle,
    pub used: u64,
    /// The last call that used it.
    pub call: u64,
}

/// GPU memory toward the peers.
pub(crate) struct GpuRegs {
    /// Per peer, whether GPU memory may be posted toward it and how it is registered:
    /// `Some(true)` through dmabufs, `Some(false)` by address (peer memory), `None` not at
    /// all (the default; set at init with `ROCCL_GPU_DIRECT`).
    pub device_mem: Vec<Option<bool>>,
    /// GPU buffers registered through their dmabufs, kept across calls (see [`DevCached`]).
    pub cache: Vec<DevCached>,
    /// Clock of `cache` uses (least recently used goes first).
    pub clock: u64,
    /// Number of the executor's current call (entries it uses are never released).
    pub epoch: u64,
}

impl GpuRegs {
    /// `device_mem` per peer; empty: GPU memory toward no peer.
    pub fn new(nranks: usize, device_mem: Vec<Option<bool>>) -> Self {
        GpuRegs {
            device_mem: if device_mem.is_empty() {
                vec![None; nranks]
            } else {
                device_mem
            },
            cache: Vec::new(),
            clock: 0,
            epoch: 0,
        }
    }
}
