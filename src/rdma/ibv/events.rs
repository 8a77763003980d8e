//! The async-event thread: fatal device and QP events become errors of the QPs they hit; a
//! port that loses its link is remembered (its QPs retry through a short loss, as the NIC's
//! retry count allows) and, with a GID that changed under the device, explains the errors of
//! QPs that then fail ([`Dev::local_fault`]).

use std::ffi::CStr;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys as ffi;

use super::{ip_of, Dev, FlagTable};

/// A loss of the port's link: when, and how long it lasted once the port came back.
#[derive(Clone, Copy, Debug)]
pub(super) struct PortDown {
    since: Instant,
    lasted: Option<Duration>,
}

/// A past loss of link explains failures for this long after the port came back.
const PORT_DOWN_MEMORY: Duration = Duration::from_secs(60);

impl Dev {
    /// Returns once the port has its link, at most `limit` after it lost it (at once while
    /// it has it: one relaxed load). A send posted to a port without link fails its QP on
    /// some providers (Linux rxe completes it with LOC_QP_OP_ERR), so sends wait through a
    /// short loss of link, as the QPs' retries do for what is already in flight.
    pub(super) fn await_link(&self, limit: Duration) -> crate::error::Result<()> {
        if !self.link_down.load(Ordering::Relaxed) {
            return Ok(());
        }
        let since = self.port_down.lock().map_or_else(Instant::now, |d| d.since);
        while self.link_down.load(Ordering::Acquire) {
            if since.elapsed() >= limit {
                return Err(crate::error::Error::sys(
                    format!(
                        "RDMA device {}: a send waited for the link: {}",
                        self.name,
                        self.local_fault().unwrap_or_default()
                    ),
                    std::io::Error::new(std::io::ErrorKind::NotConnected, "the port has no link"),
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// What on this host's side explains QPs that fail now: a GID that is no longer the one
    /// the device was opened with (the interface's address changed or was removed), or a
    /// port that lost its link.
    pub(super) fn local_fault(&self) -> Option<String> {
        let gid = self.gid_fault();
        let port = self.port_down.lock().and_then(|d| match d.lasted {
            None => Some(format!(
                "port {} of {} lost its link {:.1?} ago and has not come back (cable, switch port or `ip link set down`)",
                self.port,
                self.name,
                d.since.elapsed()
            )),
            Some(l) if d.since.elapsed() < PORT_DOWN_MEMORY => Some(format!(
                "port {} of {} lost its link for {l:.1?}, {:.1?} ago",
                self.port,
                self.name,
                d.since.elapsed()
            )),
            Some(_) => None,
        });
        match (gid, port) {
            (Some(g), Some(p)) => Some(format!("{g}; {p}")),
            (g, p) => g.or(p),
        }
    }

    /// The GID this device's QPs send from, if it is no longer in the port's table.
    fn gid_fault(&self) -> Option<String> {
        // SAFETY: zeroed is a valid out-parameter.
        let mut gid: ffi::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: `self.ctx` is open; `gid` is a valid out-pointer.
        let r = unsafe {
            ffi::ibv_query_gid(self.ctx, self.port, c_int::from(self.gid_index), &mut gid)
        };
        // SAFETY: a GID is 16 plain bytes in either view of the union.
        let now = (r == 0).then(|| ip_of(unsafe { gid.raw }));
        if now == Some(self.addr) {
            return None;
        }
        let now = match now {
            Some(a) if !a.is_unspecified() => format!("holds {a} now"),
            _ => "is empty now".into(),
        };
        Some(format!(
            "the address of {} port {} changed under this communicator: its RoCE v2 GID (index {}) was {} when the communicator chose it and {now}; its connections are bound to the old address. Keep interface addresses fixed while jobs run; a communicator created after the change chooses the GID afresh",
            self.name, self.port, self.gid_index, self.addr
        ))
    }
}

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
                E::IBV_EVENT_PORT_ERR | E::IBV_EVENT_PORT_ACTIVE | E::IBV_EVENT_GID_CHANGE => {
                    // SAFETY: for port events the element is the port number.
                    let port = unsafe { ev.element.port_num };
                    if port == c_int::from(dev.port) {
                        port_event(&dev, ev.event_type, &what);
                    }
                }
                _ => crate::info!("RDMA async event on {}: {what}", dev.name),
            }
            // SAFETY: `ev` came from ibv_get_async_event.
            unsafe { ffi::ibv_ack_async_event(&mut ev) };
        }
    }
}

/// A port event of the device's port: a lost link is remembered, its QPs keep retrying and
/// new sends wait for it (a link back within their retries loses nothing); its return and a
/// changed GID are told.
fn port_event(dev: &Dev, kind: ffi::ibv_event_type, what: &str) {
    use ffi::ibv_event_type as E;
    let warn = |m: String| crate::log::log(crate::log::Level::Warn, format_args!("{m}"));
    match kind {
        E::IBV_EVENT_PORT_ERR => {
            *dev.port_down.lock() = Some(PortDown {
                since: Instant::now(),
                lasted: None,
            });
            dev.link_down.store(true, Ordering::Release);
            warn(format!(
                "RDMA device {}: async event {what}: port {} lost its link (cable, switch port or `ip link set down`); its connections retry until it comes back or their retries (ROCCL_IB_TIMEOUT, ROCCL_IB_RETRY_CNT) run out",
                dev.name, dev.port
            ));
        }
        E::IBV_EVENT_PORT_ACTIVE => {
            dev.link_down.store(false, Ordering::Release);
            let mut down = dev.port_down.lock();
            if let Some(d) = down.as_mut().filter(|d| d.lasted.is_none()) {
                d.lasted = Some(d.since.elapsed());
                warn(format!(
                    "RDMA device {}: port {} is up again after {:.1?}",
                    dev.name,
                    dev.port,
                    d.since.elapsed()
                ));
            }
        }
        _ => match dev.gid_fault() {
            Some(m) => warn(format!("RDMA device {}: async event {what}: {m}", dev.name)),
            None => crate::info!(
                "RDMA device {}: async event {what}; its GID is unchanged",
                dev.name
            ),
        },
    }
}
