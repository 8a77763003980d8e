//! Errors of the verbs layer in words a user can act on: which verb failed on which device,
//! the likely cause and the fix. Shared by the NIC provider (`rdma::ibv`, feature `verbs`)
//! and the RDMA network's completion errors; plain data, so it is tested on every build.

use std::fmt;

use super::verbs::WcStatus;
use crate::error::Error;

/// The libibverbs call that failed (one variant per verb roccl calls).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    /// `ibv_get_device_list`.
    GetDeviceList,
    /// `ibv_open_device`.
    OpenDevice,
    /// `ibv_query_device`.
    QueryDevice,
    /// `ibv_query_port`.
    QueryPort,
    /// `ibv_query_gid`.
    QueryGid,
    /// `ibv_alloc_pd`.
    AllocPd,
    /// `ibv_reg_mr`.
    RegMr,
    /// `ibv_reg_dmabuf_mr`.
    RegDmabufMr,
    /// `ibv_create_comp_channel`.
    CreateCompChannel,
    /// `ibv_create_cq`.
    CreateCq,
    /// `ibv_req_notify_cq`.
    ReqNotifyCq,
    /// `ibv_create_qp`.
    CreateQp,
    /// `ibv_modify_qp` to INIT.
    ModifyQpInit,
    /// `ibv_modify_qp` to RTR.
    ModifyQpRtr,
    /// `ibv_modify_qp` to RTS.
    ModifyQpRts,
    /// `ibv_post_send`.
    PostSend,
    /// `ibv_post_recv`.
    PostRecv,
    /// `ibv_poll_cq`.
    PollCq,
}

impl Verb {
    /// The C call.
    pub fn c_name(self) -> &'static str {
        match self {
            Verb::GetDeviceList => "ibv_get_device_list",
            Verb::OpenDevice => "ibv_open_device",
            Verb::QueryDevice => "ibv_query_device",
            Verb::QueryPort => "ibv_query_port",
            Verb::QueryGid => "ibv_query_gid",
            Verb::AllocPd => "ibv_alloc_pd",
            Verb::RegMr => "ibv_reg_mr",
            Verb::RegDmabufMr => "ibv_reg_dmabuf_mr",
            Verb::CreateCompChannel => "ibv_create_comp_channel",
            Verb::CreateCq => "ibv_create_cq",
            Verb::ReqNotifyCq => "ibv_req_notify_cq",
            Verb::CreateQp => "ibv_create_qp",
            Verb::ModifyQpInit => "ibv_modify_qp(INIT)",
            Verb::ModifyQpRtr => "ibv_modify_qp(RTR)",
            Verb::ModifyQpRts => "ibv_modify_qp(RTS)",
            Verb::PostSend => "ibv_post_send",
            Verb::PostRecv => "ibv_post_recv",
            Verb::PollCq => "ibv_poll_cq",
        }
    }
}

/// What is known around a failure, for the hint.
#[derive(Clone, Debug, Default)]
pub struct Context {
    /// Device name (`mlx5_0`, `irdma0`, ...).
    pub dev: String,
    /// Soft `ulimit -l` in bytes (`None`: unlimited or unknown).
    pub memlock: Option<u64>,
    /// Bytes being registered.
    pub len: Option<usize>,
    /// The device's QP limit and how many this process holds.
    pub max_qp: Option<(u32, u32)>,
    /// GID index in use and why it was chosen.
    pub gid: Option<String>,
    /// The peer's address (GID).
    pub peer: Option<String>,
}

/// A failed verb: the call, the device, errno, and the likely cause and fix.
#[derive(Clone, Debug)]
pub struct VerbError {
    /// The call.
    pub verb: Verb,
    /// The device.
    pub dev: String,
    /// `errno` (0 when the call reports no errno).
    pub errno: i32,
    /// Likely cause and fix.
    pub hint: String,
}

impl fmt::Display for VerbError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let e = std::io::Error::from_raw_os_error(self.errno);
        write!(f, "{} failed on {}", self.verb.c_name(), self.dev)?;
        if self.errno != 0 {
            write!(f, " ({e})")?;
        }
        if !self.hint.is_empty() {
            write!(f, ": {}", self.hint)?;
        }
        Ok(())
    }
}

impl From<VerbError> for Error {
    fn from(v: VerbError) -> Error {
        // The OS error is the source, printed after `what`.
        let source = if v.errno != 0 {
            std::io::Error::from_raw_os_error(v.errno)
        } else {
            std::io::Error::other("RDMA verb failed")
        };
        let mut what = format!("{} failed on {}", v.verb.c_name(), v.dev);
        if !v.hint.is_empty() {
            what = format!("{what} ({})", v.hint);
        }
        Error::System {
            what,
            call: Some(v.verb.c_name()),
            source,
        }
    }
}

fn human(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{} GiB", b >> 30)
    } else if b >= 1 << 20 {
        format!("{} MiB", b >> 20)
    } else {
        format!("{} KiB", b >> 10)
    }
}

const CONTAINER: &str =
    "in a container run with --device=/dev/infiniband --cap-add=IPC_LOCK --ulimit memlock=-1";

/// The failed `verb` with `errno` and its likely cause and fix.
pub fn verb_error(verb: Verb, errno: i32, cx: &Context) -> VerbError {
    let dev = if cx.dev.is_empty() {
        "this host".to_string()
    } else {
        cx.dev.clone()
    };
    let hint = match (verb, errno) {
        (Verb::GetDeviceList, _) => {
            "libibverbs finds no RDMA device: load the NIC's RDMA driver (irdma for Intel E810, mlx5_ib for ConnectX), check `ls /sys/class/infiniband`, and install the provider (apt-get install rdma-core ibverbs-providers)".into()
        }
        (Verb::OpenDevice | Verb::AllocPd, libc::EACCES | libc::EPERM) => format!(
            "no permission on /dev/infiniband/uverbs*: run as a user with access (group rdma) or, {CONTAINER}"
        ),
        (Verb::RegMr | Verb::RegDmabufMr, libc::ENOMEM | libc::EAGAIN) => {
            let lim = match cx.memlock {
                Some(l) => format!("the locked-memory limit is {} (ulimit -l)", human(l)),
                None => "the locked-memory limit (ulimit -l) may be too low".into(),
            };
            let what = cx.len.map(|n| format!(" of {}", human(n as u64))).unwrap_or_default();
            format!(
                "registration{what} pins memory and {lim}: raise it with `ulimit -l unlimited` (or memlock in /etc/security/limits.conf, LimitMEMLOCK=infinity for systemd services; {CONTAINER})"
            )
        }
        (Verb::RegMr | Verb::RegDmabufMr, libc::EFAULT) => {
            "the buffer is not mapped memory the NIC can pin (freed, or device memory without dmabuf support)".into()
        }
        (Verb::RegMr | Verb::RegDmabufMr, libc::EACCES | libc::EPERM) => format!(
            "no permission to pin memory: {CONTAINER}"
        ),
        (Verb::RegDmabufMr, libc::EOPNOTSUPP | libc::EPROTONOSUPPORT) => {
            "this NIC or driver cannot register dmabuf memory: GPU buffers are staged through host memory instead".into()
        }
        (Verb::CreateQp | Verb::CreateCq | Verb::CreateCompChannel, libc::ENOMEM | libc::ENOSPC | libc::EAGAIN) => {
            let lim = match cx.max_qp {
                Some((max, held)) => format!(" ({dev} allows {max} QPs, this process holds {held})"),
                None => String::new(),
            };
            format!(
                "the device's queue pair or completion queue limit is reached{lim}: run fewer ranks per node or fewer channels per peer (ROCCL_NCHANNELS); Intel E810 (irdma) has far fewer QPs than ConnectX (see docs/ROCE.md), and the memlock limit also caps queue memory"
            )
        }
        (Verb::CreateQp, libc::EINVAL) => {
            "the device refused the queue sizes or inline size: lower ROCCL_IB_INLINE".into()
        }
        (Verb::ModifyQpRtr, libc::EINVAL) => format!(
            "the device refused the path to the peer{}: check that the GID index{} is a RoCE v2 entry on an active port, that both ends agree on the MTU, and ROCCL_IB_TC/ROCCL_IB_SL values",
            cx.peer.as_ref().map(|p| format!(" {p}")).unwrap_or_default(),
            cx.gid.as_ref().map(|g| format!(" ({g})")).unwrap_or_default()
        ),
        (Verb::ModifyQpRtr, libc::ETIMEDOUT | libc::ENETUNREACH | libc::EHOSTUNREACH | libc::ENODATA) => format!(
            "no route to the peer's GID{}: both GIDs must be RoCE v2 on reachable subnets (ROCCL_IB_ADDR_RANGE), and the peer's MAC must resolve (ping it over this interface)",
            cx.peer.as_ref().map(|p| format!(" {p}")).unwrap_or_default()
        ),
        (Verb::PostSend | Verb::PostRecv, libc::ENOMEM) => {
            "the work queue is full (more work in flight than the QP was created for): a roccl bug, please report it".into()
        }
        (Verb::PostSend | Verb::PostRecv, libc::EINVAL) => {
            "the work request was refused (inline data too large or QP not ready)".into()
        }
        _ => String::new(),
    };
    VerbError {
        verb,
        dev,
        errno,
        hint,
    }
}

/// Cause and fix of an error completion, for a message naming the peer.
pub fn wc_hint(status: WcStatus, provider: &str, peer: &str) -> String {
    match status {
        WcStatus::RetryExcErr => format!(
            "peer {peer} unreachable over RoCE v2 through {provider} (no acknowledgement after every retry): the peer died, or the path drops packets — check that both GIDs are RoCE v2 on the same subnet, the MTU on both ends and the switch, and that PFC/ECN and the traffic class (ROCCL_IB_TC) match the switch configuration"
        ),
        WcStatus::RnrRetryExcErr => format!(
            "peer {peer} never had a receive posted (RNR retries exhausted): it stopped consuming messages or called a different collective"
        ),
        WcStatus::RemAccessErr => format!(
            "peer {peer} refused the memory key or range (remote access error): the peer freed or deregistered the buffer, or sizes differ between the ranks"
        ),
        WcStatus::RemInvReqErr => format!(
            "peer {peer} rejected the request as invalid (message larger than its buffer, or opcode not allowed)"
        ),
        WcStatus::LocLenErr => format!(
            "a message from {peer} was larger than the receive buffer (mismatched counts between the ranks?)"
        ),
        WcStatus::LocProtErr => {
            "a local buffer was not covered by its registration (a roccl bug, please report it)".into()
        }
        WcStatus::WrFlushErr => {
            "the queue pair failed earlier; this request was flushed (see the first error)".into()
        }
        WcStatus::RemOpErr => format!("peer {peer} failed to carry out the operation"),
        WcStatus::LocQpOpErr => format!(
            "{provider} could not send a packet of this queue pair toward {peer}: Linux soft-RoCE (rxe) fails a queue pair whose packet the kernel cannot route or hand to the link (this host's link or address, or the way to the peer, went away); a NIC, when it refuses a work request (see dmesg)"
        ),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_verb_names_its_c_call() {
        for v in [
            Verb::GetDeviceList,
            Verb::OpenDevice,
            Verb::QueryDevice,
            Verb::QueryPort,
            Verb::QueryGid,
            Verb::AllocPd,
            Verb::RegMr,
            Verb::RegDmabufMr,
            Verb::CreateCompChannel,
            Verb::CreateCq,
            Verb::ReqNotifyCq,
            Verb::CreateQp,
            Verb::ModifyQpInit,
            Verb::ModifyQpRtr,
            Verb::ModifyQpRts,
            Verb::PostSend,
            Verb::PostRecv,
            Verb::PollCq,
        ] {
            assert!(v.c_name().starts_with("ibv_"), "{v:?}");
            let e = verb_error(v, libc::EIO, &Context::default());
            assert!(e.to_string().contains(v.c_name()), "{e}");
        }
    }

    #[test]
    fn memlock_is_named_with_its_value_and_fix() {
        let cx = Context {
            dev: "irdma0".into(),
            memlock: Some(64 << 10),
            len: Some(16 << 20),
            ..Context::default()
        };
        let m = verb_error(Verb::RegMr, libc::ENOMEM, &cx).to_string();
        for want in [
            "ibv_reg_mr",
            "irdma0",
            "64 KiB",
            "16 MiB",
            "ulimit -l",
            "memlock=-1",
        ] {
            assert!(m.contains(want), "{want} missing from: {m}");
        }
        let e: Error = verb_error(Verb::RegMr, libc::ENOMEM, &cx).into();
        assert_eq!(e.kind(), crate::error::ErrorKind::System);
        assert!(e.to_string().contains("Cannot allocate memory"), "{e}");
    }

    #[test]
    fn permissions_qp_limits_and_paths() {
        let cx = Context {
            dev: "mlx5_0".into(),
            max_qp: Some((1024, 1024)),
            gid: Some("index 3: RoCE v2 10.0.0.5 on eth2".into()),
            peer: Some("10.0.0.6".into()),
            ..Context::default()
        };
        let p = verb_error(Verb::OpenDevice, libc::EACCES, &cx).to_string();
        assert!(
            p.contains("/dev/infiniband") && p.contains("--device"),
            "{p}"
        );
        let q = verb_error(Verb::CreateQp, libc::ENOMEM, &cx).to_string();
        assert!(q.contains("allows 1024 QPs") && q.contains("mlx5_0"), "{q}");
        let r = verb_error(Verb::ModifyQpRtr, libc::EINVAL, &cx).to_string();
        assert!(r.contains("index 3") && r.contains("10.0.0.6"), "{r}");
        let n = verb_error(Verb::GetDeviceList, 0, &Context::default()).to_string();
        assert!(n.contains("irdma") && n.contains("mlx5_ib"), "{n}");
    }

    #[test]
    fn completion_errors_name_the_peer_and_the_fix() {
        let h = wc_hint(WcStatus::RetryExcErr, "mlx5_0", "rank 3 at 10.0.0.7");
        for want in [
            "rank 3 at 10.0.0.7",
            "RoCE v2",
            "MTU",
            "PFC/ECN",
            "ROCCL_IB_TC",
        ] {
            assert!(h.contains(want), "{want} missing from: {h}");
        }
        assert!(wc_hint(WcStatus::RemAccessErr, "x", "p").contains("memory key"));
        assert!(wc_hint(WcStatus::LocQpOpErr, "rxe0", "p").contains("could not send"));
        assert!(wc_hint(WcStatus::Success, "x", "p").is_empty());
    }
}
