//! The RDMA network (`ROCCL_NET=rocev2`): the core's network trait over any verbs provider
//! (today the userspace RoCE v2 engine; real NICs through libibverbs).
//!
//! Receiver-driven, as proven RDMA transports are. Each connection is one RC QP. The sender
//! owns a FIFO of [`FIFO`] clear-to-send slots registered for remote write. For every
//! (grouped) receive, the receiver registers its buffers, posts one receive work request per
//! buffer and RDMA-writes a slot — sequence number, buffer count, and per buffer address,
//! size, rkey and tag — into the sender's FIFO. The sender, for each send in order, waits for
//! the slot of the current sequence number, matches its tag to a buffer of the slot, and
//! RDMA-writes the data with immediate: the immediate is the size (one buffer) or
//! `index << 29 | size` (grouped). The receiver's receive completion carries the size.
//!
//! Connection setup runs over a TCP side channel whose address is the listen handle: the
//! connecting side sends its QP endpoint and FIFO (address, rkey), the listener creates its
//! QP, connects it and answers with its endpoint, the connecting side connects its QP and
//! sends one byte to say it is ready to receive.
//!
//! Memory: buffers are registered per request and released at completion (registration in
//! the userspace engine is a table insert; a cache for hardware comes with the verbs provider).

//!
//! The modules, in the order a message meets them:
//! - `setup`: the listen handle, the setup messages and the two setup state machines
//!   (connecting and accepting) that end in a send or a receive comm;
//! - `cts`: the clear-to-send FIFO and the credit protocol (entries, their torn-read
//!   protection, credits and when to report them);
//! - `eager`: eager messages — their configuration, the receiver's bounce buffers and the
//!   sender's staging;
//! - `send`, `recv`: the send and receive comms;
//! - `flush`: flushes of received GPU memory through a loopback QP;
//! - `regcache`: the registration cache.

mod cts;
mod eager;
mod flush;
mod recv;
mod regcache;
mod send;
mod settings;
mod setup;
#[cfg(test)]
mod tests;

pub use settings::RoceSettings;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[cfg(doc)]
use super::SendComm;
use super::{
    Connecting, ListenComm, MemHandle, Net, NetHandle, NetProperties, PtrSupport, MAX_RECVS,
    MAX_REQUESTS,
};
use crate::error::{Error, Result};
use crate::rdma::udp::UserVerbs;
use crate::rdma::verbs::{Access, Verbs, Wc, WcStatus};
use eager::EagerCfg;
use regcache::{Pinned, RegCache};

#[cfg(test)]
pub(crate) use setup::handle_with_port;
#[cfg(feature = "fuzzing")]
pub(crate) use setup::{fuzz, fuzz_seed};

/// Clear-to-send slots per connection (= requests in flight).
pub const FIFO: usize = MAX_REQUESTS;

/// Largest grouped-receive buffer index and size an immediate carries: `index << 29 | size`.
const IMM_SIZE_BITS: u32 = 29;

/// Completions taken per poll (shared among a connection's queue pairs).
pub(super) const WCS: usize = 32;

/// One NIC of a [`RoceNet`] (for the userspace engine, one address it runs on): the
/// network's devices, which channels spread over.
pub(super) struct Device {
    pub(super) verbs: Arc<dyn Verbs>,
    /// Its address (the GID of the NIC's port, the userspace engine's address).
    pub(super) ip: IpAddr,
    /// Link speed, if known.
    speed_mbps: Option<u32>,
    pci_path: Option<String>,
    dmabuf: bool,
}

impl Device {
    fn over(verbs: Arc<dyn Verbs>, ip: IpAddr) -> Device {
        Device {
            dmabuf: verbs.dmabuf_supported(),
            verbs,
            ip,
            speed_mbps: None,
            pci_path: None,
        }
    }
}

/// The RoCE v2 network over one or more verbs providers (NICs).
pub struct RoceNet {
    /// The NICs (`ROCCL_IB_HCA` lists several): device `d` of [`Net::connect`] is
    /// `devs[d % len]`; at least one.
    pub(super) devs: Vec<Device>,
    /// Address of the TCP side channel that sets connections up (for every device).
    ip: IpAddr,
    /// The host's other addresses (the userspace engine on a host of several subnets, a
    /// switchless mesh): the side channel and the engine take packets on every address,
    /// handles name these too, and each connection uses the address on the way to its peer.
    others: Vec<std::net::Ipv4Addr>,
    /// Queue pairs per connection (`ROCCL_IB_QPS_PER_CONNECTION`): messages take them in
    /// turn, each from its own UDP source port.
    qps: usize,
    /// Largest eager message ([`RoceSettings::eager`]; 0: off).
    eager: u32,
    /// GPU memory may be posted: connections send and receive without CPU copies.
    device_buffers: AtomicBool,
    /// The key connection setups are authenticated with ([`Net::set_job_key`]).
    key: crate::net::NetKey,
}

/// The setting of queue pairs per connection.
pub const QPS_VAR: &str = "ROCCL_IB_QPS_PER_CONNECTION";

/// A queue pair count, 1 to 8.
pub fn parse_qps(v: &str) -> Result<usize> {
    match v.trim().parse::<usize>() {
        Ok(n) if (1..=setup::MAX_QPS).contains(&n) => Ok(n),
        _ => Err(Error::arg(format!(
            "{QPS_VAR}={v}: want the queue pairs per connection, 1 to {}",
            setup::MAX_QPS
        ))),
    }
}

impl RoceNet {
    /// The userspace RoCE v2 engine on `ip` (its settings: [`RoceSettings::engine`]), or
    /// on each interface or address [`RoceSettings::hca`] lists (one engine per "NIC");
    /// connections are set up over TCP on `ip`.
    pub fn userspace(ip: IpAddr, settings: &RoceSettings) -> Result<RoceNet> {
        let engine = &settings.engine;
        if let Some(addrs) = engine_addrs(settings.hca.as_deref())? {
            let devs = addrs
                .into_iter()
                .map(|a| Ok(Device::over(Arc::new(UserVerbs::open(a, engine)?), a)))
                .collect::<Result<Vec<_>>>()?;
            return Ok(RoceNet::with_devices(devs, ip)?.with_settings(settings));
        }
        let others = crate::bootstrap::ifaces::other_addrs(ip, setup::MAX_OTHER_ADDRS);
        let verbs = if others.is_empty() {
            UserVerbs::open(ip, engine)?
        } else {
            UserVerbs::open(std::net::Ipv4Addr::UNSPECIFIED.into(), engine)?
        };
        Ok(RoceNet {
            others,
            ..RoceNet::over(Arc::new(verbs), ip).with_settings(settings)
        })
    }

    /// RoCE v2 NICs through libibverbs: device, port and GID chosen from sysfs as
    /// [`RoceSettings::criteria`] says (every port `ROCCL_IB_HCA` lists that qualifies, when
    /// it lists several), opened with [`RoceSettings::ib`]; connections are set up over TCP
    /// on `ip`.
    #[cfg(feature = "verbs")]
    pub fn nic(ip: IpAddr, settings: &RoceSettings) -> Result<RoceNet> {
        use crate::rdma::select;
        let ports = select::scan(std::path::Path::new(select::SYSFS_ROOT))?;
        let choices = select::choose_each(&ports, &settings.criteria)?;
        let ib = settings.ib;
        let mut devs = Vec::new();
        for choice in &choices {
            let port = ports
                .iter()
                .find(|p| p.dev == choice.dev && p.port == choice.port);
            let v = crate::rdma::ibv::IbvVerbs::open(choice, ib)?;
            devs.push(Device {
                dmabuf: v.dmabuf(),
                verbs: Arc::new(v),
                ip: choice.gid.ip(),
                speed_mbps: port.and_then(|p| p.rate_gbps).map(|g| (g * 1000.0) as u32),
                pci_path: port.and_then(|p| p.pci.clone()),
            });
        }
        Ok(RoceNet::with_devices(devs, ip)?.with_settings(settings))
    }

    /// Over any provider (connections set up over TCP on `ip`).
    pub fn over(verbs: Arc<dyn Verbs>, ip: IpAddr) -> RoceNet {
        RoceNet {
            devs: vec![Device::over(verbs, ip)],
            ip,
            others: Vec::new(),
            qps: 1,
            eager: eager::EAGER_DEFAULT,
            device_buffers: AtomicBool::new(false),
            key: crate::net::NetKey::new(),
        }
    }

    /// Over several providers, each a NIC at its address (connections set up over TCP on
    /// `ip`); device `d` of [`Net::connect`] is the `d % len`th.
    pub fn over_devices(devs: Vec<(Arc<dyn Verbs>, IpAddr)>, ip: IpAddr) -> Result<RoceNet> {
        let devs = devs.into_iter().map(|(v, a)| Device::over(v, a)).collect();
        RoceNet::with_devices(devs, ip)
    }

    fn with_devices(devs: Vec<Device>, ip: IpAddr) -> Result<RoceNet> {
        if devs.is_empty() {
            return Err(Error::arg("a RoCE v2 network needs at least one device"));
        }
        Ok(RoceNet {
            devs,
            ..RoceNet::over_nothing(ip)
        })
    }

    fn over_nothing(ip: IpAddr) -> RoceNet {
        RoceNet {
            devs: Vec::new(),
            ip,
            others: Vec::new(),
            qps: 1,
            eager: eager::EAGER_DEFAULT,
            device_buffers: AtomicBool::new(false),
            key: crate::net::NetKey::new(),
        }
    }

    /// With what `settings` say of the network itself: queue pairs per connection and
    /// eager messages.
    fn with_settings(self, settings: &RoceSettings) -> RoceNet {
        RoceNet {
            eager: settings.eager.min(eager::EAGER_MAX),
            ..self.with_qps(settings.qps)
        }
    }

    /// With `qps` queue pairs per connection this side opens (1 to 8; the accepting side
    /// follows the connecting one).
    pub fn with_qps(mut self, qps: usize) -> RoceNet {
        self.qps = qps.clamp(1, setup::MAX_QPS);
        self
    }

    /// The device of index `dev` ([`Net::connect`]'s): they are used in turn.
    pub(super) fn device(&self, dev: usize) -> (usize, &Device) {
        let d = dev % self.devs.len();
        (d, &self.devs[d])
    }

    /// This side's eager configuration: none where GPU memory may be posted (the receiver
    /// would copy eager messages out of its bounce buffers with the CPU).
    fn eager_cfg(&self) -> Result<EagerCfg> {
        let mut e = EagerCfg::with_size(self.eager);
        if self.device_buffers.load(Ordering::Relaxed) {
            e.size = 0;
        }
        Ok(e)
    }

    /// The provider's name (the first device's; the others' follow after commas).
    pub fn provider(&self) -> String {
        let names: Vec<String> = self.devs.iter().map(|d| d.verbs.name()).collect();
        names.join(",")
    }
}

/// The addresses `ROCCL_IB_HCA` (`spec`) gives the userspace engine: each item an interface
/// (its first IPv4 address) or an address of this host; `None` when unset.
fn engine_addrs(spec: Option<&str>) -> Result<Option<Vec<IpAddr>>> {
    let Some(spec) = spec else {
        return Ok(None);
    };
    let spec = spec.trim();
    if spec.is_empty() {
        return Ok(None);
    }
    let hint = "the userspace engine (ROCCL_NET=rocev2) runs on the interfaces or addresses it lists, e.g. eth0,eth1 or 10.0.0.1,10.0.1.1 (RDMA device names such as mlx5_0 are for ROCCL_NET=verbs)";
    if spec.starts_with('^') || spec.starts_with('=') {
        return Err(Error::arg(format!(
            "{}={spec}: '^' and '=' are for RDMA NICs; {hint}",
            crate::rdma::select::HCA_VAR
        )));
    }
    let ifaces = crate::bootstrap::ifaces::list().unwrap_or_default();
    let mut out = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let name = item.split(':').next().unwrap_or(item);
        let addr = match item.parse::<IpAddr>() {
            Ok(a) => ifaces
                .iter()
                .any(|i| i.addr == a || (a.is_loopback() && i.addr.is_loopback()))
                .then_some(a),
            Err(_) => ifaces
                .iter()
                .find(|i| i.name == name && i.addr.is_ipv4())
                .or_else(|| ifaces.iter().find(|i| i.name == name))
                .map(|i| i.addr),
        };
        match addr {
            Some(a) if !out.contains(&a) => out.push(a),
            Some(_) => {}
            None => {
                return Err(Error::arg(format!(
                    "{}={spec}: {item} is neither an interface with an address nor an address of this host; {hint}",
                    crate::rdma::select::HCA_VAR
                )))
            }
        }
    }
    Ok(Some(out))
}

/// Whether a kernel module lets the NIC register GPU memory by its address (peer memory:
/// `nvidia_peermem`, or AMD's `amdkfd` peer-memory client), as NCCL and RCCL check.
pub fn peer_memory() -> bool {
    [
        "/sys/kernel/mm/memory_peers/nv_mem/version",
        "/sys/module/nvidia_peermem/version",
        "/sys/kernel/mm/memory_peers/amdkfd/version",
    ]
    .iter()
    .any(|p| std::path::Path::new(p).exists())
}

impl Net for RoceNet {
    fn counters(&self, out: &mut Vec<(&'static str, u64)>) {
        // Summed over the devices, by name.
        let start = out.len();
        let mut one = Vec::new();
        for d in &self.devs {
            one.clear();
            d.verbs.counters(&mut one);
            for &(name, v) in &one {
                match out[start..].iter_mut().find(|(n, _)| *n == name) {
                    Some(c) => c.1 += v,
                    None => out.push((name, v)),
                }
            }
        }
    }

    fn name(&self) -> &'static str {
        if self.devs[0].verbs.hardware() {
            "verbs"
        } else {
            "rocev2"
        }
    }

    fn devices(&self) -> usize {
        self.devs.len()
    }

    fn properties(&self, dev: usize) -> Result<NetProperties> {
        let Some(d) = self.devs.get(dev) else {
            return Err(Error::arg(format!(
                "rocev2 has {} device(s); asked for device {dev}",
                self.devs.len()
            )));
        };
        let hardware = d.verbs.hardware();
        Ok(NetProperties {
            name: d.verbs.name(),
            pci_path: d.pci_path.clone(),
            guid: dev as u64,
            ptr_support: PtrSupport {
                host: true,
                device: if hardware { peer_memory() } else { d.dmabuf },
                dmabuf: d.dmabuf,
            },
            speed_mbps: d
                .speed_mbps
                .unwrap_or(if d.ip.is_loopback() { 100_000 } else { 10_000 }),
            port: 1,
            latency_us: if hardware { 3.0 } else { 8.0 },
            max_comms: 4096,
            max_recvs: MAX_RECVS as u32,
        })
    }

    fn set_timeout(&self, timeout: std::time::Duration) {
        for d in &self.devs {
            d.verbs.set_timeout(timeout);
        }
    }

    fn set_job_key(&self, key: &crate::bootstrap::auth::JobKey) {
        self.key.set(key);
    }

    fn expect_device_buffers(&self) {
        self.device_buffers.store(true, Ordering::Relaxed);
    }

    fn listen(&self, dev: usize) -> Result<(NetHandle, Box<dyn ListenComm>)> {
        self.properties(dev)?;
        setup::listen(self)
    }

    fn connect(&self, dev: usize, handle: &NetHandle) -> Result<Box<dyn Connecting>> {
        setup::connect(self, dev, handle)
    }
}

fn wc_error(w: &Wc, side: &str, verbs: &dyn Verbs, peer: SocketAddr) -> Error {
    verbs.completion_error(w.status);
    let hint = crate::rdma::verb_errors::wc_hint(w.status, &verbs.name(), &peer.ip().to_string());
    let hint = if hint.is_empty() {
        String::new()
    } else {
        format!(": {hint}")
    };
    let what = format!(
        "RoCE v2 {side}: work completion {:?} (status {}){hint}",
        w.status, w.status as u32
    );
    // The kind tells the executor the cause: the peer never answered, or this host could
    // not send at all (a fault the provider knows of on this host's side explains any
    // failed completion: a port without link, an address gone from under the QPs).
    let silent = matches!(w.status, WcStatus::RetryExcErr | WcStatus::RnrRetryExcErr);
    match verbs.local_fault() {
        Some(fault) => Error::sys(
            format!("{what}; {fault}"),
            std::io::Error::other(crate::net::LocalFault),
        ),
        None if silent => Error::sys(
            what,
            std::io::Error::new(std::io::ErrorKind::TimedOut, "retries exhausted"),
        ),
        None => Error::sys(what, std::io::Error::other("RDMA completion error")),
    }
}

/// An explicit registration (`regMr`, `regMrDmaBuf`), kept in `cache` until `dereg`, with
/// the rights `access` its comm needs while requests use it (see [`RegCache::pin`]). The
/// handle's key is the registration's id in `cache`, not a memory key.
///
/// # Safety
/// The contract of [`SendComm::reg_mr`] and [`SendComm::reg_mr_device`]: the memory (and
/// the dmabuf) stays valid until the registration is released or the comm dropped.
unsafe fn reg_explicit(
    verbs: &dyn Verbs,
    cache: &mut RegCache,
    (addr, len): (usize, usize),
    access: Access,
    device: bool,
    dmabuf: Option<(i32, u64)>,
) -> Result<MemHandle> {
    if len == 0 {
        return Err(Error::arg("registering 0 bytes"));
    }
    // SAFETY: this function's contract (regMr's): the memory, or the dmabuf, stays valid
    // until `dereg_mr` or the comm's drop, which release the registration.
    let mr = unsafe {
        match dmabuf {
            Some((fd, offset)) => verbs.reg_dmabuf(fd, offset, len, addr as u64, access)?,
            None => verbs.reg_mr(addr as u64, len, access)?,
        }
    };
    let id = cache.pin(verbs, Pinned { mr, access, device });
    Ok(MemHandle { addr, len, key: id })
}

/// The rights an explicit registration needs while in use: a send comm's only reads it
/// locally; a receive comm's is written by the peer, and GPU memory is also read by the
/// flush (an RDMA read through a loopback QP).
fn explicit_rights(receive: bool, device: bool) -> Access {
    match (receive, device) {
        (false, _) => Access::LOCAL_WRITE,
        (true, false) => Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        (true, true) => Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    }
}

/// An eager message met GPU memory on a connection nobody told how to copy it.
fn no_device_copy() -> Error {
    Error::InvalidUsage(
        "an eager message met GPU memory, but this RoCE v2 connection has no way to copy GPU memory (it was set up for host memory): announce GPU buffers before connecting (Net::expect_device_buffers), or set a device copy"
            .into(),
    )
}
