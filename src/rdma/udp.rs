//! The userspace provider: the RC engine driven over real UDP sockets.
//!
//! One socket bound to `local_ip:ROCCL_ROCEV2_PORT` (default 4791; an ephemeral port when
//! that is taken, e.g. by another rank on the host) receives every packet; each QP sends from
//! its own socket bound to an ephemeral port, so the UDP source port is per-QP entropy as on
//! hardware. Send sockets set `IP_MTU_DISCOVER = IP_PMTUDISC_DO` and are not connected: the
//! kernel then sends IPv4 identification 0 with DF, which is what the ICRC the engine
//! computes assumes (the receiver cannot see the IP header and checks the ICRC with the same
//! convention; see `rdma::wire::icrc`). Datagrams are batched with `recvmmsg`/`sendmmsg`.
//! Progress happens inside `poll_cq` (no helper thread), under one lock per provider.
//!
//! A fault injector (`ROCCL_ROCEV2_FAULTS="drop=0.01,dup=0.01,reorder=0.01,corrupt=0.01,seed=7"`)
//! drops, duplicates, delays or corrupts outgoing datagrams to show recovery.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use super::engine::{CqId, Engine, QpAttr, QpState, Qpn, RecvWr, SendWr, Wc};
use super::mem::Access;
use super::verbs::{Mr, QpEndpoint, QpId, Verbs};
use super::wire;
use crate::error::{Error, Result};
use crate::net::PollFd;

const BATCH: usize = 32;
/// The progress thread leaves the engine to the application while it polled this recently.
const APP_ACTIVE: Duration = Duration::from_micros(500);
const DGRAM: usize = 4096 + 64;

/// Outgoing faults, for tests and demonstrations.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Faults {
    /// Probability of dropping a datagram.
    pub drop: f64,
    /// Probability of sending it twice.
    pub dup: f64,
    /// Probability of delaying it (by up to 500 µs) behind later ones.
    pub reorder: f64,
    /// Probability of flipping one bit.
    pub corrupt: f64,
    /// PRNG seed.
    pub seed: u64,
}

impl Faults {
    /// Parse `drop=0.01,dup=0.01,reorder=0.02,corrupt=0.01,seed=7`.
    pub fn parse(s: &str) -> Result<Faults> {
        let mut f = Faults {
            seed: 1,
            ..Faults::default()
        };
        for kv in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            let (k, v) = kv.split_once('=').ok_or_else(|| {
                Error::arg(format!("ROCCL_ROCEV2_FAULTS: '{kv}' is not key=value"))
            })?;
            let num = |v: &str| {
                v.parse::<f64>().map_err(|_| {
                    Error::arg(format!("ROCCL_ROCEV2_FAULTS: {k}={v} is not a number"))
                })
            };
            match k {
                "drop" => f.drop = num(v)?,
                "dup" => f.dup = num(v)?,
                "reorder" => f.reorder = num(v)?,
                "corrupt" => f.corrupt = num(v)?,
                "seed" => f.seed = num(v)? as u64,
                _ => {
                    return Err(Error::arg(format!(
                    "ROCCL_ROCEV2_FAULTS: unknown key '{k}' (drop, dup, reorder, corrupt, seed)"
                )))
                }
            }
        }
        Ok(f)
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && (self.next() % 1_000_000) as f64 / 1e6 < p
    }
}

struct Pending {
    at: Instant,
    dest: SocketAddr,
    src_port: u16,
    data: Vec<u8>,
}

struct Driver {
    engine: Engine,
    rx: Socket,
    tx: HashMap<u16, Socket>,
    cq_of: HashMap<Qpn, CqId>,
    psn_of: HashMap<Qpn, u32>,
    mtu: u32,
    faults: Option<(Faults, Rng)>,
    delayed: Vec<Pending>,
    bufs: Vec<[u8; DGRAM]>,
    txbufs: Vec<[u8; DGRAM]>,
    next_psn: u32,
    /// Last time an application thread polled a completion queue.
    last_app_poll: Instant,
}

/// The userspace RoCE v2 provider.
pub struct UserVerbs {
    d: Arc<Mutex<Driver>>,
    fd: i32,
    local: SocketAddr,
    stop: Arc<AtomicBool>,
}

/// The background progress thread: what a NIC does without the host. It receives,
/// acknowledges and retransmits while the application is busy elsewhere (otherwise a peer's
/// retry count would run out whenever a rank computes between collectives), sleeping in
/// `poll(2)` until a datagram or the next retransmission deadline.
fn progress_thread(d: Arc<Mutex<Driver>>, fd: i32, stop: Arc<AtomicBool>) {
    let debug = crate::log::level() >= crate::log::Level::Info;
    let mut last_dump = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if debug && last_dump.elapsed() > Duration::from_secs(5) {
            last_dump = Instant::now();
            let g = d.lock();
            crate::info!(
                "RoCE v2 engine {}: {:?}\n{}",
                g.engine.local(),
                g.engine.stats(),
                g.engine.describe(Instant::now())
            );
        }
        // While the application polls, it drives the engine itself: stay out of its way
        // (no lock contention, no stolen core) and only take over when it goes quiet.
        let idle = d.lock().last_app_poll.elapsed();
        if idle < APP_ACTIVE {
            std::thread::sleep(APP_ACTIVE - idle);
            continue;
        }
        let wait_ms = {
            let mut g = d.lock();
            let _ = g.progress();
            let next = g
                .engine
                .poll_timeout()
                .or_else(|| g.delayed.iter().map(|p| p.at).min());
            next.map_or(10, |t| {
                t.saturating_duration_since(Instant::now())
                    .as_millis()
                    .clamp(0, 10) as i32
            })
        };
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `p` is a valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut p, 1, wait_ms.max(1)) };
    }
}

fn udp_socket(addr: SocketAddr) -> std::io::Result<Socket> {
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    s.set_nonblocking(true)?;
    let _ = s.set_recv_buffer_size(8 << 20);
    let _ = s.set_send_buffer_size(8 << 20);
    s.bind(&addr.into())?;
    Ok(s)
}

/// Make the kernel send IPv4 id 0 with DF (see the module docs).
fn no_fragment(s: &Socket, v6: bool) -> Result<()> {
    let (level, opt, val) = if v6 {
        (
            libc::IPPROTO_IPV6,
            libc::IPV6_MTU_DISCOVER,
            libc::IPV6_PMTUDISC_DO,
        )
    } else {
        (
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_DO,
        )
    };
    // SAFETY: `val` is a live c_int and we pass its size; the fd is a valid socket.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            level,
            opt,
            (&val as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as u32,
        )
    };
    if r != 0 {
        return Err(Error::last_os(
            "setsockopt(IP_MTU_DISCOVER, IP_PMTUDISC_DO) on a RoCE v2 send socket",
        ));
    }
    Ok(())
}

/// The largest IB MTU whose packets fit the interface MTU of `ip`.
fn path_mtu(ip: IpAddr) -> u32 {
    let ifmtu = crate::bootstrap::ifaces::list()
        .ok()
        .and_then(|l| l.into_iter().find(|i| i.addr == ip))
        .and_then(|i| std::fs::read_to_string(format!("/sys/class/net/{}/mtu", i.name)).ok())
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(1500);
    // IPv6 40 + UDP 8 + BTH 12 + RETH 16 + ImmDt 4 + ICRC 4
    let room = ifmtu.saturating_sub(84);
    [4096, 2048, 1024, 512, 256]
        .into_iter()
        .find(|m| *m <= room)
        .unwrap_or(256)
}

impl UserVerbs {
    /// Open on `ip`, port from `ROCCL_ROCEV2_PORT` (default 4791, ephemeral if taken),
    /// faults from `ROCCL_ROCEV2_FAULTS`.
    pub fn open(ip: IpAddr) -> Result<UserVerbs> {
        let port = match std::env::var("ROCCL_ROCEV2_PORT") {
            Ok(v) => v
                .trim()
                .parse::<u16>()
                .map_err(|_| Error::arg(format!("ROCCL_ROCEV2_PORT={v} is not a port number")))?,
            Err(_) => wire::ROCEV2_PORT,
        };
        let faults = match std::env::var("ROCCL_ROCEV2_FAULTS") {
            Ok(v) if !v.trim().is_empty() => Some(Faults::parse(&v)?),
            _ => None,
        };
        Self::with(ip, port, faults)
    }

    /// Open with explicit settings (`port` 0: any).
    pub fn with(ip: IpAddr, port: u16, faults: Option<Faults>) -> Result<UserVerbs> {
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
        let d = Arc::new(Mutex::new(Driver {
            engine: Engine::new(ip, local.port()),
            rx,
            tx: HashMap::new(),
            cq_of: HashMap::new(),
            psn_of: HashMap::new(),
            mtu: path_mtu(ip),
            faults: faults.map(|f| (f, Rng(f.seed | 1))),
            delayed: Vec::new(),
            bufs: vec![[0u8; DGRAM]; BATCH],
            txbufs: vec![[0u8; DGRAM]; BATCH],
            next_psn: seed & 0x00ff_ffff,
            last_app_poll: Instant::now(),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let (d2, s2) = (Arc::clone(&d), Arc::clone(&stop));
        std::thread::Builder::new()
            .name("roccl-rocev2".into())
            .spawn(move || progress_thread(d2, fd, s2))
            .map_err(|e| Error::sys("spawning the RoCE v2 progress thread", e))?;
        Ok(UserVerbs { d, fd, local, stop })
    }

    /// Local address (IP and RoCE port).
    pub fn local(&self) -> SocketAddr {
        self.local
    }

    /// Engine counters.
    pub fn stats(&self) -> super::engine::Stats {
        self.d.lock().engine.stats()
    }
}

impl Driver {
    fn progress(&mut self) -> Result<()> {
        let now = Instant::now();
        self.receive(now)?;
        if self.engine.poll_timeout().is_some_and(|t| t <= now) {
            self.engine.handle_timeout(now);
        }
        self.transmit(now)
    }

    fn receive(&mut self, now: Instant) -> Result<()> {
        loop {
            let n = {
                // SAFETY: zeroed mmsghdr/iovec/sockaddr_storage arrays are valid; every iovec
                // points into `self.bufs`, which outlives the call.
                let mut addrs: [libc::sockaddr_storage; BATCH] = unsafe { std::mem::zeroed() };
                let mut iov: [libc::iovec; BATCH] = unsafe { std::mem::zeroed() };
                let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
                for i in 0..BATCH {
                    iov[i] = libc::iovec {
                        iov_base: self.bufs[i].as_mut_ptr().cast(),
                        iov_len: DGRAM,
                    };
                    msgs[i].msg_hdr.msg_iov = &mut iov[i];
                    msgs[i].msg_hdr.msg_iovlen = 1;
                    msgs[i].msg_hdr.msg_name =
                        (&mut addrs[i] as *mut libc::sockaddr_storage).cast();
                    msgs[i].msg_hdr.msg_namelen =
                        std::mem::size_of::<libc::sockaddr_storage>() as u32;
                }
                // SAFETY: `msgs` describes BATCH valid buffers; MSG_DONTWAIT never blocks.
                let r = unsafe {
                    libc::recvmmsg(
                        self.rx.as_raw_fd(),
                        msgs.as_mut_ptr(),
                        BATCH as u32,
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
                        return Ok(());
                    }
                    return Err(Error::sys("recvmmsg on the RoCE v2 socket", e));
                }
                let n = r as usize;
                for i in 0..n {
                    // SAFETY: the kernel filled `addrs[i]` with `msg_namelen` bytes.
                    let from = unsafe { SockAddr::new(addrs[i], msgs[i].msg_hdr.msg_namelen) };
                    if let Some(from) = from.as_socket() {
                        let len = msgs[i].msg_len as usize;
                        let (bufs, engine) = (&self.bufs, &mut self.engine);
                        engine.handle_datagram(now, from, &bufs[i][..len]);
                    }
                }
                n
            };
            if n < BATCH {
                return Ok(());
            }
        }
    }

    fn send_one(&mut self, dest: SocketAddr, src_port: u16, data: &[u8]) {
        if let Some(s) = self.tx.get(&src_port) {
            // A full socket buffer drops the datagram; the RC protocol retransmits it.
            let _ = s.send_to(data, &dest.into());
        }
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
        // Batch datagrams of one source port into one sendmmsg.
        let zero = SocketAddr::from(([0, 0, 0, 0], 0));
        let mut meta: [(SocketAddr, u16, usize); BATCH] = [(zero, 0, 0); BATCH];
        let mut n = 0usize;
        for _ in 0..4096 {
            if n == BATCH {
                self.flush(&meta[..n]);
                n = 0;
            }
            let Some(t) = self.engine.poll_transmit(now, &mut self.txbufs[n]) else {
                break;
            };
            if n > 0 && meta[0].1 != t.src_port {
                // Another QP's packet (sitting at index n): send the batch, restart with it.
                self.flush(&meta[..n]);
                self.txbufs.swap(0, n);
                n = 0;
            }
            let mut copies = 1;
            if let Some((f, rng)) = &mut self.faults {
                if rng.chance(f.drop) {
                    continue;
                }
                if rng.chance(f.corrupt) {
                    let k = (rng.next() as usize) % t.len;
                    self.txbufs[n][k] ^= 1 << (rng.next() % 8);
                }
                if rng.chance(f.reorder) {
                    let at = now + Duration::from_micros(20 + rng.next() % 480);
                    self.delayed.push(Pending {
                        at,
                        dest: t.dest,
                        src_port: t.src_port,
                        data: self.txbufs[n][..t.len].to_vec(),
                    });
                    continue;
                }
                if rng.chance(f.dup) && n + 1 < BATCH {
                    copies = 2;
                }
            }
            for c in 0..copies {
                if c == 1 {
                    let (a, b) = self.txbufs.split_at_mut(n);
                    b[0][..t.len].copy_from_slice(&a[n - 1][..t.len]);
                }
                meta[n] = (t.dest, t.src_port, t.len);
                n += 1;
            }
        }
        if n > 0 {
            self.flush(&meta[..n]);
        }
        Ok(())
    }

    /// Send `txbufs[..batch.len()]` (all from one source port) with one sendmmsg.
    fn flush(&mut self, batch: &[(SocketAddr, u16, usize)]) {
        let n = batch.len();
        let Some(sock) = self.tx.get(&batch[0].1) else {
            return;
        };
        let addrs: [SockAddr; BATCH] =
            std::array::from_fn(|i| SockAddr::from(batch.get(i).map_or(batch[0].0, |b| b.0)));
        // SAFETY: zeroed iovec/mmsghdr arrays are valid; each entry points into `txbufs` and
        // `addrs`, which outlive the call.
        let mut iov: [libc::iovec; BATCH] = unsafe { std::mem::zeroed() };
        let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
        for i in 0..n {
            iov[i] = libc::iovec {
                iov_base: self.txbufs[i].as_mut_ptr().cast(),
                iov_len: batch[i].2,
            };
            msgs[i].msg_hdr.msg_iov = &mut iov[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
            msgs[i].msg_hdr.msg_name = addrs[i].as_ptr() as *mut libc::c_void;
            msgs[i].msg_hdr.msg_namelen = addrs[i].len();
        }
        let mut off = 0;
        while off < n {
            // SAFETY: `msgs[off..n]` are valid message headers (see above).
            let r = unsafe {
                libc::sendmmsg(
                    sock.as_raw_fd(),
                    msgs[off..].as_mut_ptr(),
                    (n - off) as u32,
                    libc::MSG_DONTWAIT,
                )
            };
            if r <= 0 {
                // A full socket buffer drops the rest; the RC protocol retransmits it.
                crate::info!(
                    "RoCE v2: sendmmsg sent {off} of {n} datagrams: {}",
                    std::io::Error::last_os_error()
                );
                break;
            }
            off += r as usize;
        }
    }
}

/// How long a closing provider keeps answering retransmissions after the last datagram.
const LINGER_QUIET: Duration = Duration::from_millis(60);
/// Upper bound of the linger.
const LINGER_MAX: Duration = Duration::from_secs(1);

impl Drop for UserVerbs {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
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

    fn create_qp(&self) -> Result<(QpId, QpEndpoint)> {
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
        let cq = d.engine.create_cq();
        let q = d.engine.create_qp(cq, cq, port)?;
        d.engine.modify_qp(q, QpState::Init, &QpAttr::default())?;
        d.tx.insert(port, tx);
        d.cq_of.insert(q, cq);
        let psn = d.next_psn;
        d.next_psn = (d.next_psn.wrapping_mul(1_103_515_245).wrapping_add(12_345)) & 0x00ff_ffff;
        d.psn_of.insert(q, psn);
        Ok((
            QpId(q),
            QpEndpoint {
                addr: self.local,
                qpn: q,
                psn,
                mtu: d.mtu,
            },
        ))
    }

    fn connect_qp(&self, qp: QpId, remote: &QpEndpoint) -> Result<()> {
        let mut d = self.d.lock();
        let psn = *d
            .psn_of
            .get(&qpn(qp))
            .ok_or_else(|| Error::arg("connect_qp: unknown QP"))?;
        let timeout = std::env::var("ROCCL_IB_TIMEOUT")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(12u8);
        let attr = QpAttr {
            // Peers on this host talk through the kernel's loopback path whatever the
            // interface: use the largest IB MTU there.
            mtu: if remote.addr.ip() == self.local.ip() {
                4096
            } else {
                d.mtu.min(remote.mtu)
            },
            dest: remote.addr,
            dest_qpn: remote.qpn,
            rq_psn: remote.psn,
            sq_psn: psn,
            timeout,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
        };
        d.engine.modify_qp(qpn(qp), QpState::Rtr, &attr)?;
        d.engine.modify_qp(qpn(qp), QpState::Rts, &attr)
    }

    fn destroy_qp(&self, qp: QpId) {
        // Keep it acknowledging retransmissions until the provider goes away (linger).
        let _ = self.d.lock().engine.close_qp(qpn(qp));
    }

    fn post_send(&self, qp: QpId, wr: &SendWr) -> Result<()> {
        let mut d = self.d.lock();
        d.engine.post_send(qpn(qp), wr)?;
        // Push the first packets out now: lower latency than waiting for the next poll.
        d.transmit(Instant::now())
    }

    fn post_recv(&self, qp: QpId, wr: &RecvWr) -> Result<()> {
        self.d.lock().engine.post_recv(qpn(qp), wr)
    }

    fn poll_cq(&self, qp: QpId, out: &mut [Wc]) -> Result<usize> {
        let mut d = self.d.lock();
        d.progress()?;
        let cq = *d
            .cq_of
            .get(&qpn(qp))
            .ok_or_else(|| Error::arg("poll_cq: unknown QP"))?;
        Ok(d.engine.poll_cq(cq, out))
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        out.push(PollFd {
            fd: self.fd,
            events: libc::POLLIN,
        });
    }

    fn read_registered(&self, addr: u64, out: &mut [u8]) {
        let _g = self.d.lock();
        // SAFETY: the caller passes memory inside one of its registered regions (valid
        // until deregistration); the engine writes registered memory only while holding the
        // lock we hold, so this copy cannot observe a half-written update.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), out.len()) };
    }

    fn qp_state(&self, qp: QpId) -> Result<QpState> {
        self.d.lock().engine.qp_state(qpn(qp))
    }
}
