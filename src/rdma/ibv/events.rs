//! The async-event thread: fatal device, port and QP events become errors of the QPs they
//! hit.

use std::ffi::CStr;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rdma_sys as ffi;

use super::{Dev, FlagTable};

/// The async-event thread: fatal events become errors of the QPs (or the device) they hit.
pub(super) fn async_events(dev: Arc<Dev>, flags: FlagTable, stop: Arc<AtomicBool>) {
    // SAFETY: `dev.ctx` is open for as long as `dev` lives.
    let fd = unsafe { (*dev.ctx).async_fd };
    // SAFETY: fcntl on a descriptor we own through the context.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
    }
    while !stop.load(Ordering::Relaxed) {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut p, 1, 100) } <= 0 {
            continue;
        }
        loop {
            // SAFETY: zeroed is a valid out-parameter.
            let mut ev: ffi::ibv_async_event = unsafe { std::mem::zeroed() };
            // SAFETY: `dev.ctx` is open; `ev` is a valid out-pointer.
            if unsafe { ffi::ibv_get_async_event(dev.ctx, &mut ev) } != 0 {
                break;
            }
            // SAFETY: ibv_event_type_str returns a static string.
            let what = unsafe { CStr::from_ptr(ffi::ibv_event_type_str(ev.event_type)) }
                .to_string_lossy()
                .into_owned();
            use ffi::ibv_event_type as E;
            match ev.event_type {
                E::IBV_EVENT_QP_FATAL | E::IBV_EVENT_QP_REQ_ERR | E::IBV_EVENT_QP_ACCESS_ERR => {
                    // SAFETY: for QP events the element is the QP, alive until we ack.
                    let qpn = unsafe { (*ev.element.qp).qp_num };
                    let msg = format!(
                        "async event {what} on QP {qpn:#x}: the QP is in error (the peer sent a malformed or unauthorized request, or the NIC hit an internal error); the communicator must be recreated"
                    );
                    crate::log::log(crate::log::Level::Warn, format_args!("{msg}"));
                    if let Some((_, f)) = flags.lock().iter().find(|(n, _)| *n == qpn) {
                        *f.fatal.lock() = Some(msg);
                        f.flag.store(true, Ordering::Release);
                    }
                }
                E::IBV_EVENT_DEVICE_FATAL | E::IBV_EVENT_CQ_ERR => {
                    let msg = format!(
                        "async event {what}: the device failed (driver reset or hardware error, see dmesg); every communicator on it must be recreated"
                    );
                    crate::log::log(crate::log::Level::Warn, format_args!("{msg}"));
                    *dev.fatal.lock() = Some(msg);
                    dev.fatal_flag.store(true, Ordering::Release);
                }
                E::IBV_EVENT_PORT_ERR => {
                    // SAFETY: for port events the element is the port number.
                    let port = unsafe { ev.element.port_num };
                    if port == c_int::from(dev.port) {
                        let msg = format!(
                            "async event {what}: port {port} went down (link lost: cable, switch port or `ip link set down`)"
                        );
                        crate::log::log(crate::log::Level::Warn, format_args!("{msg}"));
                        *dev.fatal.lock() = Some(msg);
                        dev.fatal_flag.store(true, Ordering::Release);
                    }
                }
                _ => crate::info!("RDMA async event on {}: {what}", dev.name),
            }
            // SAFETY: `ev` came from ibv_get_async_event.
            unsafe { ffi::ibv_ack_async_event(&mut ev) };
        }
    }
}
