//! The userspace provider: the RC engine driven over real UDP sockets.
//!
//! One socket bound to `local_ip:ROCCL_ROCEV2_PORT` (default 4791; an ephemeral port when
//! that is taken, e.g. by another rank on the host) receives every packet (with an
//! unspecified `local_ip`, on every address of the host: each QP then sends from and is
//! reached at its address on the route to its peer, a switchless mesh's cable); each QP sends from
//! its own socket bound to an ephemeral port, so the UDP source port is per-QP entropy as on
//! hardware. Send sockets set `IP_MTU_DISCOVER = IP_PMTUDISC_DO` and are not connected: the
//! kernel then sends IPv4 identification 0 with DF, which is what the ICRC the engine
//! computes assumes (the receiver cannot see the IP header and checks the ICRC with the same
//! convention; see `rdma::wire::icrc`). Datagrams are batched with `recvmmsg`/`sendmmsg`.
//! Progress happens inside `poll_cq` and, while the application is away, on a progress
//! thread, under one lock per provider; completions wake sleepers through a per-QP eventfd.
//!
//! A fault injector (`ROCCL_ROCEV2_FAULTS="drop=0.01,dup=0.01,reorder=0.01,corrupt=0.01,seed=7"`)
//! drops, duplicates, delays or corrupts outgoing datagrams to show recovery.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use socket2::{SockAddr, Socket};

use super::engine::{CqId, Engine, QpAttr, QpState, Qpn, RecvWr, SendWr, Transmit, Wc};
use super::mem::Access;
use super::verbs::{Mr, QpEndpoint, QpId, Verbs};
use super::wire;
use crate::error::{Error, Result};
use crate::os::wait::PollFd;

mod faults;
mod progress;
mod settings;
mod socket;
use faults::{count, Rng};
pub use faults::{fault_stats, FaultStats, Faults};
use progress::{progress_thread, Nudge};
pub use settings::{EngineSettings, TAKEOVER_DEFAULT};
use socket::{
    gro_segment_size, ib_mtu_for, no_fragment, path_mtu, route_mtu, set_int_opt, udp_gso_supported,
    udp_socket, Cmsg,
};

/// Datagrams per `recvmmsg`.
const RX_BATCH: usize = 16;
/// Receive buffer per datagram with UDP GRO (several packets merged by the kernel).
const RX_GRO: usize = 65536;
/// An empty receive socket is asked again only after this long.
const RX_RECHECK: Duration = Duration::from_nanos(1500);
/// UDP sends per `sendmmsg`.
const GROUPS: usize = 16;
/// Bytes of one UDP GSO send (a UDP payload must stay below 65507).
const GSO_BYTES: usize = 65000;
const DGRAM: usize = 4096 + 64;

struct Pending {
    at: Instant,
    dest: SocketAddr,
    src_port: u16,
    data: Vec<u8>,
}

/// What the provider keeps per QP besides the engine's state.
struct QpSide {
    cq: CqId,
    /// The address it told its peer it is at (`set_qp_addr`; an engine on every address).
    addr: Option<IpAddr>,
    /// First PSN it sends.
    psn: u32,
    /// Its send socket's port (the key of `Driver::tx`).
    port: u16,
    /// Readable while its completion queue holds completions that its poller may not have
    /// seen (set by whoever made progress for it; see `Driver::wake`).
    wake: OwnedFd,
    armed: bool,
    /// Its descriptors were handed out (`qp_fds`: someone is about to sleep on them) since
    /// it was last polled; only then is `wake` armed (no system calls while nobody sleeps).
    watched: bool,
    /// Destroyed by its owner: freed once the engine says it is closed and quiet.
    destroyed: bool,
}

/// Make `side`'s wake-up descriptor readable.
fn arm(side: &mut QpSide) {
    side.armed = true;
    let one = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a live buffer to an eventfd we own.
    unsafe { libc::write(side.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
}

/// A closed QP is freed after this long without a packet for it: longer than the
/// peer's longest retransmission interval (the backoff cap), so a peer that lost our last
/// acknowledgement hears from us again.
const CLOSED_QUIET: Duration = Duration::from_millis(250);

struct Driver {
    engine: Engine,
    rx: Socket,
    /// The socket of each QP by its port (the packets' UDP source port). They stay
    /// unconnected: Linux gives the datagrams of a connected UDP socket a counting IPv4
    /// identification, and the ICRC covers that field, which this provider sets to the GSO
    /// segment index (0 for a lone datagram, as unconnected sockets with DF get); a NIC
    /// receiving from it would find every ICRC wrong (`tests/capture`).
    tx: HashMap<u16, Socket>,
    /// The provider's side of each QP the engine holds.
    qps: HashMap<Qpn, QpSide>,
    /// Some QP was destroyed and waits to be freed (see [`Driver::reap_closed`]).
    closing: bool,
    mtu: u32,
    faults: Option<(Faults, Rng)>,
    delayed: Vec<Pending>,
    /// Received datagrams: RX_BATCH buffers of RX_GRO bytes.
    rxbuf: Vec<u8>,
    /// Outgoing sends: GROUPS slots of GSO_BYTES bytes.
    txarena: Vec<u8>,
    groups: Vec<Group>,
    /// Send packets of one QP as UDP GSO datagrams (`ROCCL_ROCEV2_GSO`, on by default).
    gso: bool,
    /// The receive socket takes GRO datagrams.
    gro: bool,
    udp: UdpStats,
    /// Sends have failed since then (the operating system refused them), with the last
    /// error; cleared by the next send that goes out.
    send_failing: Option<(Instant, std::io::Error)>,
    /// When a receive last found the socket empty.
    rx_empty_at: Option<Instant>,
    next_psn: u32,
    /// Last time an application thread polled a completion queue.
    last_app_poll: Instant,
    /// QPs retransmit until this long passes without progress ([`Verbs::set_timeout`]).
    retry_for: Duration,
    /// Engine counters already added to [`fault_stats`].
    reported: super::engine::Stats,
    /// Scratch list of QPs to free (kept: no allocation per progress while some linger).
    reap_buf: Vec<Qpn>,
}

/// The userspace RoCE v2 provider.
pub struct UserVerbs {
    d: Arc<Mutex<Driver>>,
    fd: i32,
    local: SocketAddr,
    stop: Arc<AtomicBool>,
    /// Wakes the progress thread from a sleep without a time limit (`progress`).
    nudge: Arc<Nudge>,
    /// Pose as a NIC that reaches GPU memory (`ROCCL_ROCEV2_SIM_GPU=1`; see
    /// [`EngineSettings::sim_gpu`]).
    sim_gpu: AtomicBool,
    /// Local ACK timeout code of its QPs ([`EngineSettings::ib_timeout`]).
    ib_timeout: u8,
    /// Completions in error the network saw, by status.
    wc_errors: crate::rdma::verbs::WcErrors,
}

impl UserVerbs {
    /// Open on `ip` as `settings` say: its port (4791 by default, ephemeral if taken), its
    /// faults, GSO/GRO, QP timeout and whether it poses as a NIC reaching GPU memory.
    pub fn open(ip: IpAddr, settings: &EngineSettings) -> Result<UserVerbs> {
        let EngineSettings {
            port,
            faults,
            offload,
            ..
        } = *settings;
        let rx = match udp_socket(SocketAddr::new(ip, port)) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && port != 0 => {
                crate::info!("RoCE v2 port {port} on {ip} is taken (another rank on this host?): using an ephemeral port");
                udp_socket(SocketAddr::new(ip, 0))
                    .map_err(|e| Error::sys(format!("bind a UDP socket on {ip}"), e))?
            }
            Err(e) => {
                return Err(Error::sys(
                    format!("bind the RoCE v2 UDP socket on {ip}:{port}"),
                    e,
                ))
            }
        };
        let local = rx
            .local_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .ok_or_else(|| Error::Internal("RoCE v2 socket has no local address".into()))?;
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u32);
        let fd = rx.as_raw_fd();
        let gro = offload && set_int_opt(fd, libc::SOL_UDP, libc::UDP_GRO, 1);
        let gso = offload && udp_gso_supported(fd);
        crate::info!(
            "RoCE v2 on {local}: UDP GSO {}, GRO {} (ROCCL_ROCEV2_GSO=0 turns both off)",
            if gso { "on" } else { "off" },
            if gro { "on" } else { "off" }
        );
        let d = Arc::new(Mutex::new(Driver {
            engine: Engine::new(ip, local.port()),
            rx,
            tx: HashMap::new(),
            qps: HashMap::new(),
            closing: false,
            // On every address: the largest, and each QP takes its route's at connect_qp.
            mtu: if ip.is_unspecified() {
                4096
            } else {
                path_mtu(ip)
            },
            faults: faults.map(|f| (f, Rng(f.seed | 1))),
            delayed: Vec::new(),
            rxbuf: vec![0u8; RX_BATCH * RX_GRO],
            txarena: vec![0u8; GROUPS * GSO_BYTES],
            groups: Vec::with_capacity(GROUPS),
            gso,
            gro,
            udp: UdpStats::default(),
            send_failing: None,
            rx_empty_at: None,
            next_psn: seed & 0x00ff_ffff,
            last_app_poll: Instant::now(),
            // Until the network is told the communicator's deadline: ROCCL_TIMEOUT's.
            retry_for: settings.deadline,
            reported: Default::default(),
            reap_buf: Vec::new(),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let nudge = Arc::new(
            Nudge::new()
                .map_err(|e| Error::sys("creating the RoCE v2 progress thread's eventfd", e))?,
        );
        let (d2, n2, s2) = (Arc::clone(&d), Arc::clone(&nudge), Arc::clone(&stop));
        let takeover = settings.takeover;
        std::thread::Builder::new()
            .name("roccl-rocev2".into())
            .spawn(move || progress_thread(d2, n2, fd, s2, takeover))
            .map_err(|e| Error::sys("spawning the RoCE v2 progress thread", e))?;
        Ok(UserVerbs {
            d,
            fd,
            local,
            stop,
            nudge,
            sim_gpu: AtomicBool::new(settings.sim_gpu),
            ib_timeout: settings.ib_timeout,
            wc_errors: Default::default(),
        })
    }

    /// Open with the default settings but `port` (0: any) and `faults`.
    pub fn with(ip: IpAddr, port: u16, faults: Option<Faults>) -> Result<UserVerbs> {
        Self::with_offload(ip, port, faults, true)
    }

    /// Open with the default settings but `port` (0: any) and `faults`; `offload == false`
    /// sends and receives one packet per datagram (no UDP GSO/GRO).
    pub fn with_offload(
        ip: IpAddr,
        port: u16,
        faults: Option<Faults>,
        offload: bool,
    ) -> Result<UserVerbs> {
        let settings = EngineSettings {
            port,
            faults,
            offload,
            ..EngineSettings::default()
        };
        Self::open(ip, &settings)
    }

    /// Take dmabufs and advertise them (what `ROCCL_ROCEV2_SIM_GPU=1` turns on), for tests.
    pub fn set_sim_gpu(&self, on: bool) {
        self.sim_gpu.store(on, Ordering::Relaxed);
    }

    /// Local address (IP and RoCE port).
    pub fn local(&self) -> SocketAddr {
        self.local
    }

    /// Engine counters.
    pub fn stats(&self) -> super::engine::Stats {
        self.d.lock().engine.stats()
    }

    /// Change the injected faults (tests: a link that goes bad and heals).
    #[cfg(test)]
    pub(crate) fn set_faults(&self, f: Option<Faults>) {
        self.d.lock().faults = f.map(|f| (f, Rng(f.seed | 1)));
    }

    /// Queue pairs the provider holds (destroyed ones until they are freed) and their send
    /// sockets.
    pub fn open_qps(&self) -> (usize, usize) {
        let d = self.d.lock();
        (d.engine.qp_count().max(d.qps.len()), d.tx.len())
    }

    /// Socket-level counters.
    pub fn udp_stats(&self) -> UdpStats {
        let d = self.d.lock();
        UdpStats {
            gso: d.gso,
            gro: d.gro,
            ..d.udp
        }
    }
}

/// What the provider's sockets did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UdpStats {
    /// Packets are sent as UDP GSO datagrams.
    pub gso: bool,
    /// The receive socket takes GRO datagrams.
    pub gro: bool,
    /// UDP datagrams handed to the kernel (a GSO datagram counts once).
    pub sends: u64,
    /// RoCE v2 packets in them.
    pub packets: u64,
    /// Datagrams received.
    pub received: u64,
    /// Of those, datagrams that held several packets (GRO).
    pub merged: u64,
    /// Rounds of progress the progress thread made because the application had left the
    /// engine alone for longer than [`EngineSettings::takeover`].
    pub background: u64,
}

impl Driver {
    /// Receive, run the timers, transmit; returns the time it started.
    fn progress(&mut self) -> Result<Instant> {
        let now = Instant::now();
        self.receive(now)?;
        if self.engine.poll_timeout().is_some_and(|t| t <= now) {
            self.engine.handle_timeout(now);
        }
        self.transmit(now)?;
        if self.closing {
            self.reap_closed(now);
        }
        if self.faults.is_some() {
            self.report_stats();
        }
        Ok(now)
    }

    /// Add what the engine counted since the last report to [`fault_stats`].
    fn report_stats(&mut self) {
        let st = self.engine.stats();
        let r = &mut self.reported;
        count(4, st.retransmits - r.retransmits);
        count(5, st.icrc_errors - r.icrc_errors);
        count(6, st.duplicates - r.duplicates);
        *r = st;
    }

    /// Make the wake-up descriptor of every QP whose completion queue holds completions
    /// readable (except `polling`'s, whose caller takes them now), so that a thread asleep
    /// in `poll(2)` on it wakes: the completions may have come from packets another thread
    /// (or the progress thread) took off the shared socket, which then stays quiet.
    fn wake(&mut self, polling: Option<Qpn>) {
        for (q, side) in self.qps.iter_mut() {
            if !side.watched
                || side.armed
                || Some(*q) == polling
                || self.engine.cq_len(side.cq) == 0
            {
                continue;
            }
            arm(side);
        }
    }

    /// Clear QP `q`'s wake-up descriptor once its completion queue is empty; its poller is
    /// awake now.
    fn unwake(&mut self, q: Qpn) {
        let Some(side) = self.qps.get_mut(&q) else {
            return;
        };
        side.watched = false;
        if side.armed && self.engine.cq_len(side.cq) == 0 {
            side.armed = false;
            let mut b = [0u8; 8];
            // SAFETY: reads at most 8 bytes into a live buffer from a non-blocking eventfd.
            unsafe { libc::read(side.wake.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
        }
    }

    /// Free the destroyed QPs that are done: the engine's slot, the completion queue, the
    /// send socket and the wake-up descriptor.
    fn reap_closed(&mut self, now: Instant) {
        let mut done = std::mem::take(&mut self.reap_buf);
        done.clear();
        done.extend(
            self.qps
                .iter()
                .filter(|(q, s)| {
                    s.destroyed && self.engine.closed_and_quiet(**q, now, CLOSED_QUIET)
                })
                .map(|(q, _)| *q),
        );
        for &q in &done {
            if let Some(side) = self.qps.remove(&q) {
                let _ = self.engine.destroy_qp(q);
                self.engine.destroy_cq(side.cq);
                self.tx.remove(&side.port);
            }
        }
        self.closing = self.qps.values().any(|s| s.destroyed);
        self.reap_buf = done;
    }

    fn receive(&mut self, now: Instant) -> Result<()> {
        // Polled from several comms in a row: a socket found empty this recently is not asked
        // again (a syscall per poll would double the cost of an idle pass).
        if self
            .rx_empty_at
            .is_some_and(|t| now.saturating_duration_since(t) < RX_RECHECK)
        {
            return Ok(());
        }
        self.rx_empty_at = None;
        let size = if self.gro { RX_GRO } else { DGRAM };
        let mut first = true;
        loop {
            // SAFETY: zeroed mmsghdr/iovec/sockaddr_storage/control arrays are valid; every
            // iovec points into `self.rxbuf` and every control buffer into `ctrl`, all of which
            // outlive the call.
            let mut addrs: [libc::sockaddr_storage; RX_BATCH] = unsafe { std::mem::zeroed() };
            let mut iov: [libc::iovec; RX_BATCH] = unsafe { std::mem::zeroed() };
            let mut msgs: [libc::mmsghdr; RX_BATCH] = unsafe { std::mem::zeroed() };
            let mut ctrl = [Cmsg::default(); RX_BATCH];
            let base = self.rxbuf.as_mut_ptr();
            for i in 0..RX_BATCH {
                iov[i] = libc::iovec {
                    // SAFETY: `rxbuf` holds RX_BATCH * RX_GRO bytes and size <= RX_GRO.
                    iov_base: unsafe { base.add(i * RX_GRO) }.cast(),
                    iov_len: size,
                };
                let h = &mut msgs[i].msg_hdr;
                h.msg_iov = &mut iov[i];
                h.msg_iovlen = 1;
                h.msg_name = (&mut addrs[i] as *mut libc::sockaddr_storage).cast();
                h.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as u32;
                if self.gro {
                    h.msg_control = (&mut ctrl[i] as *mut Cmsg).cast();
                    h.msg_controllen = std::mem::size_of::<Cmsg>();
                }
            }
            // SAFETY: `msgs` describes RX_BATCH valid buffers; MSG_DONTWAIT never blocks.
            let r = unsafe {
                libc::recvmmsg(
                    self.rx.as_raw_fd(),
                    msgs.as_mut_ptr(),
                    RX_BATCH as u32,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut(),
                )
            };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) {
                    if first {
                        self.rx_empty_at = Some(now);
                    }
                    return Ok(());
                }
                return Err(Error::sys("recvmmsg on the RoCE v2 socket", e));
            }
            let n = r as usize;
            for i in 0..n {
                // SAFETY: the kernel filled `addrs[i]` with `msg_namelen` bytes.
                let from = unsafe { SockAddr::new(addrs[i], msgs[i].msg_hdr.msg_namelen) };
                let Some(from) = from.as_socket() else {
                    continue;
                };
                let len = msgs[i].msg_len as usize;
                let seg = if self.gro {
                    gro_segment_size(&msgs[i].msg_hdr).unwrap_or(len)
                } else {
                    len
                };
                let data = &self.rxbuf[i * RX_GRO..i * RX_GRO + len];
                self.udp.received += 1;
                self.udp.merged += u64::from(len > seg);
                // A GRO datagram is several RoCE v2 packets of `seg` bytes (the last one
                // possibly shorter), each checked and handled on its own.
                for pkt in data.chunks(seg.max(1)) {
                    self.engine.handle_datagram(now, from, pkt);
                }
            }
            if n < RX_BATCH {
                return Ok(());
            }
            first = false;
        }
    }

    fn send_one(&mut self, dest: SocketAddr, src_port: u16, data: &[u8]) {
        if let Some(s) = self.tx.get(&src_port) {
            // A full socket buffer drops the datagram; the RC protocol retransmits it.
            let _ = s.send_to(data, &dest.into());
        }
    }

    /// Start a new send group (slot `ng`) holding the packet of `t` now at `at` in the arena,
    /// encoded for GSO position `encoded_for`, flushing first when every slot is taken.
    /// Returns the group's index.
    fn open_group(
        &mut self,
        groups: &mut Vec<Group>,
        t: Transmit,
        at: usize,
        encoded_for: u8,
    ) -> usize {
        if groups.len() == GROUPS {
            self.flush(groups);
            groups.clear();
        }
        let g = groups.len();
        let start = g * GSO_BYTES;
        if at != start {
            self.txarena.copy_within(at..at + t.len, start);
        }
        if encoded_for != 0 {
            let ip = wire::IpInfo {
                src: t.src,
                dst: t.dest.ip(),
                src_port: t.src_port,
                dst_port: t.dest.port(),
            };
            let _ = wire::reseal(&mut self.txarena[start..start + t.len], &ip, 0);
        }
        groups.push(Group {
            dest: t.dest,
            src_port: t.src_port,
            seg: t.len,
            nseg: 1,
            len: t.len,
            open: true,
        });
        g
    }

    fn transmit(&mut self, now: Instant) -> Result<()> {
        // Delayed (reordered) datagrams that are due.
        let mut i = 0;
        while i < self.delayed.len() {
            if self.delayed[i].at <= now {
                let p = self.delayed.swap_remove(i);
                self.send_one(p.dest, p.src_port, &p.data);
            } else {
                i += 1;
            }
        }
        let mut groups = std::mem::take(&mut self.groups);
        groups.clear();
        // Packets of one QP with the same size leave as one UDP GSO send (a shorter one may
        // end it); with faults injected, every packet leaves on its own so that each can be
        // dropped, corrupted, delayed or duplicated.
        let gso = self.gso && self.faults.is_none();
        for _ in 0..4096 {
            // Where the next packet goes: appended to the open group, or a fresh slot.
            let (at, seg) = match groups.last() {
                Some(g)
                    if gso
                        && g.open
                        && g.nseg < wire::MAX_SEGMENTS
                        && g.len + DGRAM <= GSO_BYTES =>
                {
                    ((groups.len() - 1) * GSO_BYTES + g.len, g.nseg as u8)
                }
                _ if groups.len() == GROUPS => {
                    self.flush(&groups);
                    groups.clear();
                    (0, 0)
                }
                _ => (groups.len() * GSO_BYTES, 0),
            };
            let Some(t) =
                self.engine
                    .poll_transmit_segment(now, &mut self.txarena[at..at + DGRAM], seg)
            else {
                break;
            };
            if seg > 0 {
                let g = groups.last_mut().expect("seg > 0 only with an open group");
                if t.dest == g.dest && t.src_port == g.src_port && t.len <= g.seg {
                    g.nseg += 1;
                    g.len += t.len;
                    // GSO cuts equal segments; a shorter one can only be the last.
                    g.open = t.len == g.seg;
                    continue;
                }
                g.open = false;
                self.open_group(&mut groups, t, at, seg);
                continue;
            }
            let Some((f, rng)) = &mut self.faults else {
                self.open_group(&mut groups, t, at, 0);
                continue;
            };
            if rng.chance(f.drop) {
                count(0, 1);
                continue;
            }
            if rng.chance(f.corrupt) {
                count(3, 1);
                rng.corrupt(&mut self.txarena[at..at + t.len]);
            }
            if rng.chance(f.reorder) {
                count(2, 1);
                let delay = Duration::from_micros(20 + rng.next() % 480);
                self.delayed.push(Pending {
                    at: now + delay,
                    dest: t.dest,
                    src_port: t.src_port,
                    data: self.txarena[at..at + t.len].to_vec(),
                });
                continue;
            }
            let dup = rng.chance(f.dup);
            count(1, u64::from(dup));
            let g = self.open_group(&mut groups, t, at, 0);
            groups[g].open = false;
            if dup {
                let d = self.open_group(&mut groups, t, g * GSO_BYTES, 0);
                groups[d].open = false;
            }
        }
        if !groups.is_empty() {
            self.flush(&groups);
        }
        self.groups = groups;
        Ok(())
    }

    /// Send the groups (group `i` at `txarena[i * GSO_BYTES..]`): consecutive groups of one
    /// source port with one `sendmmsg`, each group of several packets as one UDP GSO datagram.
    fn flush(&mut self, groups: &[Group]) {
        let mut first = 0;
        while first < groups.len() {
            let port = groups[first].src_port;
            let mut end = first + 1;
            while end < groups.len() && groups[end].src_port == port {
                end += 1;
            }
            self.flush_port(first, &groups[first..end]);
            first = end;
        }
    }

    fn flush_port(&mut self, first: usize, groups: &[Group]) {
        let n = groups.len();
        let Some(sock) = self.tx.get(&groups[0].src_port) else {
            return;
        };
        let fd = sock.as_raw_fd();
        let addrs: [SockAddr; GROUPS] = std::array::from_fn(|i| {
            SockAddr::from(groups.get(i).map_or(groups[0].dest, |g| g.dest))
        });
        // SAFETY: zeroed iovec/mmsghdr arrays are valid; each entry points into `txarena`,
        // `addrs` and `ctrl`, which outlive the call.
        let mut iov: [libc::iovec; GROUPS] = unsafe { std::mem::zeroed() };
        let mut msgs: [libc::mmsghdr; GROUPS] = unsafe { std::mem::zeroed() };
        let mut ctrl = [Cmsg::default(); GROUPS];
        let base = self.txarena.as_mut_ptr();
        for (i, g) in groups.iter().enumerate() {
            iov[i] = libc::iovec {
                // SAFETY: group `first + i` lies inside the arena.
                iov_base: unsafe { base.add((first + i) * GSO_BYTES) }.cast(),
                iov_len: g.len,
            };
            let h = &mut msgs[i].msg_hdr;
            h.msg_iov = &mut iov[i];
            h.msg_iovlen = 1;
            h.msg_name = addrs[i].as_ptr() as *mut libc::c_void;
            h.msg_namelen = addrs[i].len();
            if g.nseg > 1 {
                ctrl[i] = Cmsg::segment(g.seg as u16);
                h.msg_control = (&mut ctrl[i] as *mut Cmsg).cast();
                h.msg_controllen = std::mem::size_of::<Cmsg>();
            }
        }
        let mut off = 0;
        while off < n {
            // SAFETY: `msgs[off..n]` are valid message headers (see above).
            let r = unsafe {
                libc::sendmmsg(
                    fd,
                    msgs[off..].as_mut_ptr(),
                    (n - off) as u32,
                    libc::MSG_DONTWAIT,
                )
            };
            if r <= 0 {
                let e = std::io::Error::last_os_error();
                if groups[off].nseg > 1
                    && matches!(e.raw_os_error(), Some(libc::EIO | libc::EINVAL))
                {
                    // The path cannot segment (no checksum offload on the route's device):
                    // the packets are lost and retransmitted one per datagram from now on.
                    crate::log::log(
                        crate::log::Level::Warn,
                        format_args!(
                            "RoCE v2: UDP GSO send refused ({e}): sending one packet per datagram"
                        ),
                    );
                    self.gso = false;
                    off += 1;
                    continue;
                }
                // A full socket buffer drops the rest; the RC protocol retransmits it.
                crate::info!("RoCE v2: sendmmsg sent {off} of {n} datagrams: {e}");
                if e.kind() != std::io::ErrorKind::WouldBlock {
                    // Not a full buffer: the host cannot send (link down, no route).
                    let since = self
                        .send_failing
                        .as_ref()
                        .map_or_else(Instant::now, |f| f.0);
                    self.send_failing = Some((since, e));
                }
                break;
            }
            self.send_failing = None;
            let sent = &groups[off..off + r as usize];
            self.udp.sends += sent.len() as u64;
            self.udp.packets += sent.iter().map(|g| g.nseg as u64).sum::<u64>();
            off += r as usize;
        }
    }
}

/// Packets that leave as one UDP send: `nseg` packets of `seg` bytes (the last possibly
/// shorter) to one destination from one source port.
#[derive(Clone, Copy)]
struct Group {
    dest: SocketAddr,
    src_port: u16,
    seg: usize,
    nseg: usize,
    len: usize,
    /// Another packet of `seg` bytes may be appended.
    open: bool,
}

/// How long a closing provider keeps answering retransmissions after the last datagram.
const LINGER_QUIET: Duration = Duration::from_millis(60);
/// Upper bound of the linger.
const LINGER_MAX: Duration = Duration::from_secs(1);

/// Queue pairs this process's userspace engines have created (see [`queue_pairs_created`]).
static QUEUE_PAIRS_CREATED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many queue pairs the userspace RoCE v2 engines of this process have created since it
/// started: a job's connections make a fixed number; tests check that strangers at the
/// setup port or the UDP port make none (a refused hello creates nothing).
pub fn queue_pairs_created() -> u64 {
    QUEUE_PAIRS_CREATED.load(Ordering::Relaxed)
}

impl Drop for UserVerbs {
    fn drop(&mut self) {
        self.linger();
        self.d.lock().report_stats();
    }
}

impl UserVerbs {
    /// [`Verbs::poll_cqs`] under the driver's lock: progress, then each QP's completions.
    fn poll_cqs_locked(&self, qps: &[QpId], out: &mut [Wc], counts: &mut [usize]) -> Result<()> {
        let mut d = self.d.lock();
        d.last_app_poll = d.progress()?;
        let share = (out.len() / qps.len().max(1)).max(1);
        let mut at = 0;
        for (i, &qp) in qps.iter().enumerate() {
            let q = qpn(qp);
            let cq = d
                .qps
                .get(&q)
                .filter(|s| !s.destroyed)
                .ok_or_else(|| Error::arg("poll_cq: unknown QP"))?
                .cq;
            let end = (at + share).min(out.len());
            counts[i] = d.engine.poll_cq(cq, &mut out[at..end]);
            at += counts[i];
            d.unwake(q);
        }
        // Completions this progress made for other QPs: wake whoever sleeps on them.
        d.wake(None);
        Ok(())
    }

    fn linger(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.nudge.wake();
        // Linger: a peer that lost our last ACK retransmits within its timeout; answer until
        // the line has been quiet for a few of its timeouts, so it completes instead of
        // failing with RETRY_EXC_ERR after we are gone.
        let start = Instant::now();
        let mut last_rx = Instant::now();
        let mut seen = self.d.lock().engine.stats().rx_packets;
        loop {
            {
                let mut d = self.d.lock();
                let busy = d.engine.closing_busy();
                if !d.engine.has_closing()
                    || start.elapsed() >= LINGER_MAX
                    || (!busy && last_rx.elapsed() >= LINGER_QUIET)
                {
                    break;
                }
                let _ = d.progress();
                let rx = d.engine.stats().rx_packets;
                if rx != seen {
                    seen = rx;
                    last_rx = Instant::now();
                }
            }
            let mut p = libc::pollfd {
                fd: self.fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: `p` is a valid pollfd for the duration of the call.
            unsafe { libc::poll(&mut p, 1, 5) };
        }
    }
}

fn qpn(qp: QpId) -> Qpn {
    qp.0
}

impl Verbs for UserVerbs {
    fn name(&self) -> String {
        format!("userspace RoCE v2 on {}", self.local)
    }

    fn max_inline(&self) -> usize {
        super::engine::MAX_INLINE
    }

    unsafe fn reg_mr(&self, addr: u64, len: usize, access: Access) -> Result<Mr> {
        // SAFETY: forwarded contract: the caller keeps the memory valid until dereg_mr.
        let key = unsafe {
            self.d
                .lock()
                .engine
                .mrs
                .register(addr as usize, len, access)?
        };
        Ok(Mr {
            addr,
            len,
            lkey: key,
            rkey: key,
        })
    }

    fn dereg_mr(&self, mr: &Mr) -> Result<()> {
        self.d.lock().engine.mrs.deregister(mr.lkey)
    }

    fn counters(&self, out: &mut Vec<(&'static str, u64)>) {
        let s = self.stats();
        out.extend([
            ("rx_packets", s.rx_packets),
            ("tx_packets", s.tx_packets),
            ("retransmits", s.retransmits),
            ("spurious_retransmits", s.spurious_retransmits),
            ("timeouts", s.timeouts),
            ("tail_probes", s.tail_probes),
            ("rnr_naks_sent", s.rnr_naks_sent),
            ("seq_naks_sent", s.seq_naks_sent),
            ("error_naks_sent", s.error_naks_sent),
            ("seq_naks_received", s.seq_naks_received),
            ("rnr_naks_received", s.rnr_naks_received),
            ("error_naks_received", s.error_naks_received),
            ("icrc_errors", s.icrc_errors),
            ("malformed", s.malformed),
            ("duplicates", s.duplicates),
            ("out_of_sequence", s.out_of_sequence),
            ("wrong_source", s.wrong_source),
            ("ghost_acks", s.ghost_acks),
            ("duplicate_reads_dropped", s.duplicate_reads_dropped),
        ]);
        self.wc_errors.report(out, true);
    }

    fn completion_error(&self, status: crate::rdma::verbs::WcStatus) {
        self.wc_errors.note(status);
    }

    fn rekey_mr(&self, mr: &Mr, access: Access) -> Result<Mr> {
        let key = self.d.lock().engine.mrs.rekey(mr.lkey, access)?;
        Ok(Mr {
            lkey: key,
            rkey: key,
            ..*mr
        })
    }

    fn dmabuf_supported(&self) -> bool {
        self.sim_gpu.load(Ordering::Relaxed)
    }

    unsafe fn reg_dmabuf(
        &self,
        fd: i32,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<Mr> {
        if !self.dmabuf_supported() {
            return Err(Error::InvalidUsage(
                "the userspace RoCE engine takes dmabufs only with ROCCL_ROCEV2_SIM_GPU=1 (to test the GPU-direct path); GPU buffers must be staged through host memory".into(),
            ));
        }
        let iova = usize::try_from(iova).map_err(|_| Error::arg("dmabuf iova out of range"))?;
        let key = self
            .d
            .lock()
            .engine
            .mrs
            .register_dmabuf(fd, offset, len, iova, access)?;
        Ok(Mr {
            addr: iova as u64,
            len,
            lkey: key,
            rkey: key,
        })
    }

    fn cacheable_registrations(&self) -> bool {
        // A registration is a bounds-and-rights entry; memory is touched only by work posted
        // against it (or by a peer told about it in a live clear-to-send).
        true
    }

    fn create_qp(&self) -> Result<(QpId, QpEndpoint)> {
        QUEUE_PAIRS_CREATED.fetch_add(1, Ordering::Relaxed);
        let mut d = self.d.lock();
        let tx = udp_socket(SocketAddr::new(self.local.ip(), 0))
            .map_err(|e| Error::sys("bind a RoCE v2 send socket", e))?;
        no_fragment(&tx, self.local.is_ipv6())?;
        let port = tx
            .local_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .map(|a| a.port())
            .unwrap_or(0);
        // SAFETY: eventfd takes no pointers; the result is checked before use.
        let efd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(Error::last_os(
                "eventfd for a RoCE v2 queue pair's completions (out of file descriptors?)",
            ));
        }
        // SAFETY: `efd` is a fresh descriptor that nothing else owns.
        let wake = unsafe { OwnedFd::from_raw_fd(efd) };
        let cq = d.engine.create_cq();
        let q = match d.engine.create_qp(cq, cq, port) {
            Ok(q) => q,
            Err(e) => {
                d.engine.destroy_cq(cq);
                return Err(e);
            }
        };
        d.engine.modify_qp(q, QpState::Init, &QpAttr::default())?;
        d.tx.insert(port, tx);
        // The first PSN from the OS random source (a stranger cannot guess it from another
        // QP's); the generator only if that fails.
        let mut r = [0u8; 4];
        let psn = match getrandom::getrandom(&mut r) {
            Ok(()) => u32::from_le_bytes(r) & 0x00ff_ffff,
            Err(_) => d.next_psn,
        };
        d.next_psn = (d.next_psn.wrapping_mul(1_103_515_245).wrapping_add(12_345)) & 0x00ff_ffff;
        d.qps.insert(
            q,
            QpSide {
                cq,
                addr: None,
                psn,
                port,
                wake,
                armed: false,
                watched: false,
                destroyed: false,
            },
        );
        // Listening on every address, a QP's own is known only once it is connected (the
        // one on the route to its peer): loopback until then, which the caller replaces
        // with the address on the way to its peer (a QP connected to itself keeps it).
        let addr = if self.local.ip().is_unspecified() {
            SocketAddr::new(Ipv4Addr::LOCALHOST.into(), self.local.port())
        } else {
            self.local
        };
        Ok((
            QpId(q),
            QpEndpoint {
                addr,
                qpn: q,
                psn,
                mtu: d.mtu,
                engine: true,
            },
        ))
    }

    fn connect_qp(&self, qp: QpId, remote: &QpEndpoint) -> Result<()> {
        let mut d = self.d.lock();
        let side = d
            .qps
            .get(&qpn(qp))
            .ok_or_else(|| Error::arg("connect_qp: unknown QP"))?;
        let (psn, told) = (side.psn, side.addr);
        let timeout = self.ib_timeout;
        // Listening on every address: this QP uses the one on the route to its peer.
        let local = if self.local.ip().is_unspecified() {
            // The address the peer was told, else the one on the route to it.
            let routed = || crate::bootstrap::ifaces::route_source(remote.addr.ip());
            let ip = told.or_else(routed).ok_or_else(|| {
                Error::arg(format!(
                    "RoCE v2: no route from this host to the peer's queue pair at {} (is the cable to that host up, with an address on its subnet?)",
                    remote.addr
                ))
            })?;
            d.engine.set_qp_source(qpn(qp), ip)?;
            ip
        } else {
            self.local.ip()
        };
        let attr = QpAttr {
            // Peers on this host talk through the kernel's loopback path whatever the
            // interface: use the largest IB MTU there.
            // Elsewhere the smaller of both ends' and the route's: an address on `lo` routed
            // over a 1500-byte link would otherwise send 4 KiB packets the kernel refuses.
            mtu: if remote.addr.ip() == local {
                4096
            } else {
                let route = route_mtu(local, remote.addr).map_or(4096, ib_mtu_for);
                d.mtu.min(remote.mtu).min(route)
            },
            dest: remote.addr,
            dest_qpn: remote.qpn,
            rq_psn: remote.psn,
            sq_psn: psn,
            timeout,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            // Nothing forces IB's 7 retries here: a paused or flapping peer is waited for
            // as long as the communicator waits.
            retry_for: Some(d.retry_for),
            // A peer that is this engine keeps out-of-order packets: resend only what was
            // lost, and tell it what we miss. A NIC gets IBTA's go-back-N and nothing else.
            selective: remote.engine,
        };
        d.engine.modify_qp(qpn(qp), QpState::Rtr, &attr)?;
        d.engine.modify_qp(qpn(qp), QpState::Rts, &attr)
    }

    fn set_timeout(&self, timeout: Duration) {
        self.d.lock().retry_for = timeout;
    }

    fn drain_limit(&self) -> Duration {
        // The engine fails a QP without progress for this long by itself.
        self.d.lock().retry_for + Duration::from_secs(1)
    }

    fn destroy_qp(&self, qp: QpId) {
        // The engine keeps delivering what was posted and acknowledging the peer until the
        // QP is done and quiet; then progress frees it (see `Driver::reap_closed`).
        let mut d = self.d.lock();
        if let Some(side) = d.qps.get_mut(&qpn(qp)) {
            side.destroyed = true;
            d.closing = true;
            let _ = d.engine.close_qp(qpn(qp), Instant::now());
        }
        drop(d);
        // A thread asleep with nothing pending comes back to free it.
        self.nudge.app_active();
    }

    fn post_send(&self, qp: QpId, wr: &SendWr) -> Result<()> {
        let mut d = self.d.lock();
        d.engine.post_send(qpn(qp), wr)?;
        // Push the first packets out now: lower latency than waiting for the next poll.
        let r = d.transmit(Instant::now());
        drop(d);
        self.nudge.app_active();
        r
    }

    fn local_fault(&self) -> Option<String> {
        let d = self.d.lock();
        let (since, e) = d.send_failing.as_ref()?;
        Some(format!(
            "this host cannot send from {}: the operating system has refused every send for {:.1?} ({e}); is its link down or its route gone?",
            self.local.ip(),
            since.elapsed()
        ))
    }

    fn post_send_unhurried(&self, qp: QpId, wr: &SendWr) -> Result<()> {
        // The next progress (the caller's next poll, or the progress thread within
        // its takeover time) transmits it.
        let r = self.d.lock().engine.post_send(qpn(qp), wr);
        self.nudge.app_active();
        r
    }

    fn post_recv(&self, qp: QpId, wr: &RecvWr) -> Result<()> {
        self.d.lock().engine.post_recv(qpn(qp), wr)
    }

    fn poll_cq(&self, qp: QpId, out: &mut [Wc]) -> Result<usize> {
        let mut n = [0];
        self.poll_cqs(&[qp], out, &mut n)?;
        Ok(n[0])
    }

    fn poll_cqs(&self, qps: &[QpId], out: &mut [Wc], counts: &mut [usize]) -> Result<()> {
        let r = self.poll_cqs_locked(qps, out, counts);
        // After the lock: a progress thread nudged awake finds this poll's time.
        self.nudge.app_active();
        r
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        out.push(PollFd {
            fd: self.fd,
            events: libc::POLLIN,
        });
    }

    fn qp_fds(&self, qp: QpId, out: &mut Vec<PollFd>) {
        self.poll_fds(out);
        let mut d = self.d.lock();
        let d = &mut *d;
        if let Some(side) = d.qps.get_mut(&qpn(qp)) {
            // About to sleep on it: from now on whoever makes progress wakes it, and a
            // completion already waiting wakes it at once.
            side.watched = true;
            if !side.armed && d.engine.cq_len(side.cq) > 0 {
                arm(side);
            }
            out.push(PollFd {
                fd: side.wake.as_raw_fd(),
                events: libc::POLLIN,
            });
        }
    }

    unsafe fn read_registered(&self, addr: u64, out: &mut [u8]) {
        let _g = self.d.lock();
        // SAFETY: the caller passes memory inside one of its registered regions, not yet
        // deregistered (this function's contract); the engine writes registered memory only while holding the
        // lock we hold, so this copy cannot observe a half-written update.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), out.len()) };
    }

    unsafe fn read_registered_in_order(&self, pieces: &mut [(u64, &mut [u8])]) {
        let _g = self.d.lock();
        for (i, (addr, out)) in pieces.iter_mut().enumerate() {
            if i > 0 {
                std::sync::atomic::fence(Ordering::Acquire);
            }
            // SAFETY: as in `read_registered`, piece by piece: each lies inside a region
            // registered here (this function's contract), and the engine writes registered
            // memory only while holding the lock held for all of them.
            unsafe {
                std::ptr::copy_nonoverlapping(*addr as *const u8, out.as_mut_ptr(), out.len())
            };
        }
    }

    fn qp_state(&self, qp: QpId) -> Result<QpState> {
        self.d.lock().engine.qp_state(qpn(qp))
    }

    fn sends_acknowledged(&self, qp: QpId) -> bool {
        self.d.lock().engine.sends_acknowledged(qpn(qp))
    }

    fn set_qp_addr(&self, qp: QpId, ip: IpAddr) {
        if let Some(side) = self.d.lock().qps.get_mut(&qpn(qp)) {
            side.addr = Some(ip);
        }
    }

    fn qp_rtt(&self, qp: QpId) -> Option<std::time::Duration> {
        self.d.lock().engine.qp_rtt(qpn(qp))
    }
}

#[cfg(test)]
mod tests;
