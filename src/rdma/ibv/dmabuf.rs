//! dmabuf registration: `ibv_reg_dmabuf_mr`, looked up at run time and probed, so that an
//! older libibverbs still loads.

use std::os::raw::c_int;

use rdma_sys as ffi;

use super::errno;

/// `ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access)`.
pub(super) type RegDmabuf =
    unsafe extern "C" fn(*mut ffi::ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ffi::ibv_mr;

/// `ibv_reg_dmabuf_mr` if this libibverbs exports it (rdma-core 34+): looked up at run time,
/// so roccl still loads with an older libibverbs.
pub(super) fn reg_dmabuf_fn() -> Option<RegDmabuf> {
    // SAFETY: dlsym with a NUL-terminated name on the default namespace.
    let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"ibv_reg_dmabuf_mr".as_ptr()) };
    // SAFETY: the symbol has this signature in every rdma-core that exports it.
    (!f.is_null()).then(|| unsafe { std::mem::transmute::<*mut libc::c_void, RegDmabuf>(f) })
}

/// Whether the device registers dmabuf memory: `ibv_reg_dmabuf_mr` called with an invalid
/// descriptor, which a supporting device rejects with EBADF and others with EOPNOTSUPP.
pub(super) fn probe_dmabuf(pd: *mut ffi::ibv_pd) -> bool {
    let Some(reg) = reg_dmabuf_fn() else {
        return false;
    };
    // SAFETY: `pd` is live; fd -1 makes the call fail before any registration.
    let mr = unsafe { reg(pd, 0, 0, 0, -1, 0) };
    if !mr.is_null() {
        // SAFETY: registered by the call above (not expected to happen).
        unsafe { ffi::ibv_dereg_mr(mr) };
        return true;
    }
    !matches!(errno(), libc::EOPNOTSUPP | libc::EPROTONOSUPPORT)
}
