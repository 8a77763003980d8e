//! The shared-memory network for ranks on one host (`ROCCL_NET=shm`).
//!
//! Each connection is a single-producer single-consumer byte ring in a POSIX shared-memory
//! segment (`ROCCL_SHM_RING` bytes, default 1 MiB, reserved with `posix_fallocate` so a full
//! /dev/shm is an error at connection time, not a SIGBUS later). The sender writes a 16-byte
//! header (length, tag) and the payload, streaming: a message larger than the ring flows
//! through it while the receiver copies it out, so a transfer costs one copy on each side and
//! no system call. Head and tail counters sit on their own cache lines; the sender owns the
//! head, the receiver the tail.
//!
//! Connection setup and wake-ups use a TCP connection on loopback (the listen handle is its
//! port and the host's boot id): the connecting side creates the segment and sends its name,
//! the listener maps it and acknowledges, and the name is unlinked. A side about to sleep in
//! `poll(2)` raises its flag in the segment; the other side then writes a doorbell byte on the
//! TCP connection after it produced or consumed. That connection also tells when the peer's
//! process is gone.
//!
//! Strangers: the handle carries the listener's random 16-byte token (bytes 32..48); the
//! name message is followed by a 16-byte tag (HMAC-SHA256 under the key of the job and the
//! token, `net::NetKey`). Before it opens anything the listener checks that the
//! connecting process runs as this user (the owner of its loopback socket), the tag (and that
//! it was not seen before), that the name is one roccl makes (`/roccl-` then digits, `-` and
//! hex) and the ring size; [`Segment::open`] then refuses a segment of another user or
//! shorter than the ring. A connection that fails any check, sends garbage, closes early or
//! sends nothing for `SETUP_DEADLINE` is dropped, counted and logged once per source, never
//! an error of the listener.

use std::collections::VecDeque;
use std::ffi::CString;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use super::{
    Connecting, ListenComm, Liveness, MemHandle, Net, NetHandle, NetProperties, PollFd, PtrSupport,
    RecvBuf, RecvComm, RecvGroup, ReqId, SendComm, Side, MAX_RECVS, MAX_REQUESTS,
};
use crate::error::{Error, Result};
use crate::os::process::{cma_read, host_id, CMA_PROBE};
use crate::os::shm::Segment;

mod settings;
pub use settings::ShmSettings;

const HANDLE_MAGIC: u32 = 0x4d48_5352; // "RSHM"
const NAME_MSG: usize = 96;
/// Bytes of the name message's tag.
const TAG: usize = crate::bootstrap::auth::TAG_BYTES;
/// Where the listener's token is in the handle.
const HANDLE_TOKEN: usize = 32;
/// Bytes of a message header in the ring: length (u64), tag (u32), kind (u32: 0 payload
/// follows, 1 direct), and for a direct message the sender's address (u64), pid (u32) and
/// direct sequence number (u32).
const MSG_HDR: usize = 32;
/// Bytes before the ring's data: five cache lines of counters and flags.
const SEG_HDR: usize = 320;

/// The segment header: counters and sleep flags, each on its own cache line.
#[repr(C)]
struct Header {
    head: AtomicU64,
    _p0: [u8; 56],
    tail: AtomicU64,
    _p1: [u8; 56],
    recv_sleeping: AtomicU32,
    _p2: [u8; 60],
    send_sleeping: AtomicU32,
    _p3: [u8; 60],
    /// Direct messages the receiver has copied out of the sender's memory.
    direct_done: AtomicU64,
    _p4: [u8; 56],
}

const _: () = assert!(std::mem::size_of::<Header>() == SEG_HDR);

/// The byte ring in a connection's segment: a [`Header`], then `cap` bytes of data.
trait Ring {
    /// The ring's counters and flags.
    fn header(&self) -> &Header;
    /// Bytes of ring data.
    fn cap(&self) -> usize;
    /// Copy `src` into the ring at stream position `pos` (wrapping).
    ///
    /// # Safety
    /// `pos..pos + src.len()` must be free space the caller (the producer) owns.
    unsafe fn put(&self, pos: u64, src: *const u8, n: usize);
    /// Copy `n` bytes at stream position `pos` out of the ring.
    ///
    /// # Safety
    /// `pos..pos + n` must be data the producer published and the consumer owns.
    unsafe fn get(&self, pos: u64, dst: *mut u8, n: usize);
}

impl Ring for Segment {
    /// The ring's counters and flags.
    fn header(&self) -> &Header {
        // SAFETY: the segment starts with a Header (zero-initialized by the kernel), and all
        // of its fields are atomics or padding.
        unsafe { &*(self.base() as *const Header) }
    }

    /// Bytes of ring data.
    fn cap(&self) -> usize {
        self.size() - SEG_HDR
    }

    /// Copy `src` into the ring at stream position `pos` (wrapping).
    ///
    /// # Safety
    /// `pos..pos + src.len()` must be free space the caller (the producer) owns.
    unsafe fn put(&self, pos: u64, src: *const u8, n: usize) {
        let cap = self.cap();
        let at = (pos as usize) & (cap - 1);
        let first = n.min(cap - at);
        // SAFETY: both ranges lie inside the ring's data area; the caller owns them.
        unsafe {
            let data = self.base().add(SEG_HDR);
            std::ptr::copy_nonoverlapping(src, data.add(at), first);
            std::ptr::copy_nonoverlapping(src.add(first), data, n - first);
        }
    }

    /// Copy `n` bytes at stream position `pos` out of the ring.
    ///
    /// # Safety
    /// `pos..pos + n` must be data the producer published and the consumer owns.
    unsafe fn get(&self, pos: u64, dst: *mut u8, n: usize) {
        let cap = self.cap();
        let at = (pos as usize) & (cap - 1);
        let first = n.min(cap - at);
        // SAFETY: as above.
        unsafe {
            let data = self.base().add(SEG_HDR);
            std::ptr::copy_nonoverlapping(data.add(at), dst, first);
            std::ptr::copy_nonoverlapping(data, dst.add(first), n - first);
        }
    }
}

/// Wake the peer: one byte on the setup connection (a full socket buffer already wakes it).
fn ring_doorbell(side: &TcpStream) {
    let _ = (&*side).write(&[1]);
}

/// Read pending doorbell bytes; false if the peer closed the connection.
fn drain_doorbells(side: &TcpStream) -> bool {
    let mut b = [0u8; 64];
    loop {
        match (&*side).read(&mut b) {
            Ok(0) => return false,
            Ok(n) if n < b.len() => return true,
            Ok(_) => {}
            Err(_) => return true,
        }
    }
}

/// A descriptor that is always readable: handed to `poll(2)` when work is pending so that a
/// rank about to sleep returns at once.
fn always_ready() -> i32 {
    static FD: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *FD.get_or_init(|| {
        let mut p = [0i32; 2];
        // SAFETY: a valid 2-element array for pipe(2); the write makes the read end readable
        // for the life of the process (nothing ever reads it).
        unsafe {
            if libc::pipe(p.as_mut_ptr()) != 0 {
                return -1;
            }
            libc::write(p[1], [1u8].as_ptr().cast(), 1);
        }
        p[0]
    })
}

/// The shared-memory network.
pub struct ShmNet {
    /// Its counters ([`Net::counters`]), shared with its connections.
    stats: Arc<ShmStats>,
    host: [u8; 16],
    ring: usize,
    /// Direct (single-copy) messages from this size on (usize::MAX: never).
    cma: usize,
    /// The key connections are authenticated with ([`Net::set_job_key`]).
    key: super::NetKey,
}

impl ShmNet {
    /// Open, as `settings` say (the ring size, single-copy messages).
    pub fn new(settings: &ShmSettings) -> Result<ShmNet> {
        Ok(ShmNet {
            stats: Arc::default(),
            host: host_id(),
            ring: settings::parse_ring(&settings.ring.to_string())?,
            cma: settings.cma_threshold(),
            key: super::NetKey::new(),
        })
    }
}

/// Whether `name` is one [`ShmNet`]'s connect makes: `/roccl-`, then digits, `-` and hex.
fn valid_segment_name(name: &[u8]) -> bool {
    name.len() <= 64
        && name.starts_with(b"/roccl-")
        && name.len() > 7
        && name[7..]
            .iter()
            .all(|c| c.is_ascii_hexdigit() || *c == b'-')
}

/// The setup listener's port and the size of the segment to create (header and ring) from
/// a handle of this host's shared-memory network (`host`: this host's boot id).
pub(crate) fn decode_handle(handle: &NetHandle, host: &[u8; 16]) -> Result<(u16, usize)> {
    let b = handle.as_bytes();
    if u32::from_le_bytes(b[0..4].try_into().unwrap()) != HANDLE_MAGIC {
        return Err(Error::arg(
            "not a roccl shared-memory handle: was it produced by another network?",
        ));
    }
    if b[16..32] != host[..] {
        return Err(Error::InvalidUsage(
            "the shared-memory network connects ranks of one host only, and this peer runs on another (boot ids differ): use ROCCL_NET=tcp, rocev2 or verbs across hosts".into(),
        ));
    }
    let port = u16::from_le_bytes([b[4], b[5]]);
    // The listener's ring: what ROCCL_SHM_RING allows (a ring of 0 bytes or one whose
    // segment size overflows would be created, then divided by or indexed past).
    let ring = u64::from_le_bytes(b[8..16].try_into().unwrap());
    let Some(ring) = usize::try_from(ring)
        .ok()
        .filter(|r| r.is_power_of_two() && (1 << 16..=1 << 30).contains(r))
    else {
        return Err(Error::arg(format!(
            "the shared-memory handle asks for a ring of {ring} bytes, not a power of two from 65536 to 1073741824: was it produced by another roccl version, or damaged?"
        )));
    };
    Ok((port, SEG_HDR + ring))
}

/// What a connector's setup message (its tag checked) says: its segment's name, ring size,
/// process id and the address of its probe word (for the single-copy check).
#[derive(Debug)]
pub(crate) struct NameMsg {
    /// The segment's name (`/roccl-...`).
    pub name: CString,
    /// Bytes of the segment's ring (a power of two, 64 KiB to 1 GiB).
    pub ring: usize,
    /// The connector's process id.
    pub pid: u32,
    /// Where [`CMA_PROBE`] is in the connector's memory.
    pub probe: u64,
}

/// Parse a setup message of [`NAME_MSG`] bytes; `Err`: why it is refused.
pub(crate) fn parse_name_msg(msg: &[u8]) -> std::result::Result<NameMsg, String> {
    if msg.len() != NAME_MSG {
        return Err(format!(
            "a setup message of {} bytes, not {NAME_MSG}",
            msg.len()
        ));
    }
    let n = usize::from(msg[0]).min(NAME_MSG - 25);
    let raw = &msg[1..1 + n];
    let name = match CString::new(raw) {
        Ok(c) if valid_segment_name(raw) => c,
        _ => return Err("a segment name roccl does not make".into()),
    };
    let ring = u64::from_le_bytes(msg[NAME_MSG - 8..NAME_MSG].try_into().unwrap());
    let Some(ring) = usize::try_from(ring)
        .ok()
        .filter(|r| r.is_power_of_two() && (1 << 16..=1 << 30).contains(r))
    else {
        return Err(format!("a ring size of {ring} bytes"));
    };
    Ok(NameMsg {
        name,
        ring,
        pid: u32::from_le_bytes(msg[NAME_MSG - 24..NAME_MSG - 20].try_into().unwrap()),
        probe: u64::from_le_bytes(msg[NAME_MSG - 16..NAME_MSG - 8].try_into().unwrap()),
    })
}

/// Checks of a handle and a setup message (its tag checked) without I/O, for the fuzz
/// targets: decode them as the connector and the listener do.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz(handle: &[u8], msg: &[u8]) {
    if let Ok(h) = NetHandle::from_bytes(handle) {
        let host: [u8; 16] = h.as_bytes()[16..32].try_into().unwrap();
        if let Ok((_, seg_len)) = decode_handle(&h, &host) {
            assert!(
                seg_len > SEG_HDR,
                "a segment without a ring: {seg_len} bytes"
            );
        }
    }
    if let Ok(m) = parse_name_msg(msg) {
        assert!(valid_segment_name(m.name.as_bytes()), "{m:?}");
        assert!(m.ring.is_power_of_two(), "{m:?}");
    }
}

impl Net for ShmNet {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn devices(&self) -> usize {
        1
    }

    fn properties(&self, dev: usize) -> Result<NetProperties> {
        if dev != 0 {
            return Err(Error::arg(format!("shm has one device; asked for {dev}")));
        }
        Ok(NetProperties {
            name: "shm".into(),
            pci_path: None,
            guid: 0,
            ptr_support: PtrSupport {
                host: true,
                device: false,
                dmabuf: false,
            },
            speed_mbps: 400_000,
            port: 0,
            latency_us: 0.5,
            max_comms: 65536,
            max_recvs: MAX_RECVS as u32,
        })
    }

    fn listen(&self, dev: usize) -> Result<(NetHandle, Box<dyn ListenComm>)> {
        self.properties(dev)?;
        let l = TcpListener::bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0))
            .map_err(|e| Error::sys("bind the shared-memory setup listener on 127.0.0.1", e))?;
        l.set_nonblocking(true)
            .map_err(|e| Error::sys("fcntl on the shared-memory setup listener", e))?;
        let port = l
            .local_addr()
            .map_err(|e| Error::sys("getsockname", e))?
            .port();
        let (token, key) = self.key.listener("shm")?;
        let mut h = [0u8; HANDLE_TOKEN + super::TOKEN_BYTES];
        h[0..4].copy_from_slice(&HANDLE_MAGIC.to_le_bytes());
        h[4..6].copy_from_slice(&port.to_le_bytes());
        h[8..16].copy_from_slice(&(self.ring as u64).to_le_bytes());
        h[16..32].copy_from_slice(&self.host);
        h[HANDLE_TOKEN..].copy_from_slice(&token);
        Ok((
            NetHandle::from_bytes(&h)?,
            Box::new(ShmListen {
                stats: Arc::clone(&self.stats),
                key,
                seen: super::SeenTags::new(),
                l,
                pending: Vec::new(),
                ready: VecDeque::new(),
                cma: self.cma,
                strict: self.key.encrypting(),
            }),
        ))
    }

    fn set_job_key(&self, key: &crate::bootstrap::auth::JobKey) {
        self.key.set(key);
    }

    fn set_encryption(&self, on: bool) {
        // Shared memory stays on the host and is not encrypted; an encrypted job's
        // listeners refuse peers whose user they cannot tell (`peer_user_check`).
        self.key.set_encryption(on);
    }

    fn counters(&self, out: &mut Vec<(&'static str, u64)>) {
        out.extend([
            ("sleeps", self.stats.sleeps.load(Ordering::Relaxed)),
            ("wakeups", self.stats.wakeups.load(Ordering::Relaxed)),
        ]);
    }

    fn connect(&self, _dev: usize, handle: &NetHandle) -> Result<Box<dyn Connecting>> {
        let b = handle.as_bytes();
        let (port, seg_len) = decode_handle(handle, &self.host)?;
        let ring = seg_len - SEG_HDR;
        let mut side = Side::dial(
            SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port),
            "shared-memory setup: ",
        )?;
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "/roccl-{}-{}-{:x}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed),
            // Unpredictable, so that no other user can take the name first.
            u64::from_le_bytes(crate::bootstrap::auth::random()?)
        );
        let cname = CString::new(name.clone()).expect("no NUL in the name");
        let seg = Segment::create(&cname, seg_len)?;
        let mut msg = [0u8; NAME_MSG];
        msg[0] = name.len() as u8;
        msg[1..1 + name.len()].copy_from_slice(name.as_bytes());
        msg[NAME_MSG - 8..].copy_from_slice(&(ring as u64).to_le_bytes());
        msg[NAME_MSG - 24..NAME_MSG - 20].copy_from_slice(&std::process::id().to_le_bytes());
        let probe = &CMA_PROBE as *const u64 as u64;
        msg[NAME_MSG - 16..NAME_MSG - 8].copy_from_slice(&probe.to_le_bytes());
        let key = self
            .key
            .for_token("shm", &b[HANDLE_TOKEN..HANDLE_TOKEN + super::TOKEN_BYTES]);
        side.queue(&msg);
        side.queue(&key.tag(&[&msg]));
        side.expect(1);
        Ok(Box::new(ShmConnecting {
            stats: Arc::clone(&self.stats),
            side,
            seg: Some(seg),
            name: cname,
            cma: self.cma,
        }))
    }
}

/// `h` with its setup port replaced by `port` (tests of peers that do not answer).
#[cfg(test)]
pub(crate) fn handle_with_port(h: &NetHandle, port: u16) -> NetHandle {
    let mut b = *h.as_bytes();
    b[4..6].copy_from_slice(&port.to_le_bytes());
    NetHandle::from_bytes(&b).unwrap()
}

/// What a shared-memory network counts (`roccl_net_*_total{network="shm"}`): waits where
/// a side raised its sleeping flag before sleeping in `poll(2)`, and doorbells rung to wake
/// a sleeping peer.
#[derive(Default)]
struct ShmStats {
    sleeps: AtomicU64,
    wakeups: AtomicU64,
}

struct ShmConnecting {
    stats: Arc<ShmStats>,
    side: Side,
    seg: Option<Segment>,
    name: CString,
    cma: usize,
}

impl Drop for ShmConnecting {
    fn drop(&mut self) {
        // SAFETY: unlinking the name we created (a no-op error if already unlinked).
        unsafe { libc::shm_unlink(self.name.as_ptr()) };
    }
}

impl Connecting for ShmConnecting {
    fn poll(&mut self) -> Result<Option<Box<dyn SendComm>>> {
        if !self.side.pump()? {
            return Ok(None);
        }
        let seg = self
            .seg
            .take()
            .ok_or_else(|| Error::Internal("connection polled after completion".into()))?;
        let side = self
            .side
            .s
            .try_clone()
            .map_err(|e| Error::sys("dup of the shared-memory setup socket", e))?;
        let cma = self.side.inb.first() == Some(&2);
        Ok(Some(Box::new(ShmSend {
            stats: Arc::clone(&self.stats),
            seg,
            direct_from: if cma { self.cma } else { usize::MAX },
            direct_sent: 0,
            live: Liveness::new(side, "shared memory"),
            reqs: VecDeque::with_capacity(MAX_REQUESTS),
            base: 0,
            head: 0,
            polls: 0,
            failed: None,
        })))
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        out.push(PollFd {
            fd: self.side.s.as_raw_fd(),
            events: libc::POLLIN | libc::POLLOUT,
        });
    }
}

struct ShmListen {
    stats: Arc<ShmStats>,
    /// The key name messages are authenticated with.
    key: crate::bootstrap::auth::JobKey,
    /// Tags of the name messages accepted (a replayed one is refused).
    seen: super::SeenTags,
    l: TcpListener,
    pending: Vec<Side>,
    /// Connections complete and not handed out yet: a call drives every pending socket
    /// (refusing every stranger whose bytes are in) and hands out one of these.
    ready: VecDeque<Box<dyn RecvComm>>,
    cma: usize,
    /// The job encrypts: a peer whose user cannot be told is refused, not let through on
    /// its tag alone.
    strict: bool,
}

/// Whether a connection whose peer runs as user `theirs` (`None`: this host cannot tell,
/// `NETLINK_SOCK_DIAG` being unavailable) may go on to its tag check, in a job of user
/// `uid`; `strict` (the job encrypts) refuses peers it cannot tell. Says once when it cannot
/// tell and lets the tag decide.
fn peer_user_check(theirs: Option<u32>, uid: u32, strict: bool) -> std::result::Result<(), String> {
    match theirs {
        Some(t) if t == uid => Ok(()),
        Some(t) => Err(format!("a process of user {t}, not of this job's user {uid}")),
        None if strict => Err(
            "this host cannot tell which user the peer runs as (NETLINK_SOCK_DIAG unavailable) and the job encrypts: refused rather than trusted on its tag alone".into(),
        ),
        None => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                crate::warn!(
                    "shared-memory setup listener: this host cannot tell which user a connecting process runs as (NETLINK_SOCK_DIAG unavailable: a container without it, or an old kernel); strangers are still refused by the job's tag, and an encrypted job (ROCCL_ENCRYPT=1) refuses such peers"
                )
            });
            Ok(())
        }
    }
}

impl ListenComm for ShmListen {
    fn accept(&mut self) -> Result<Option<Box<dyn RecvComm>>> {
        loop {
            match self.l.accept() {
                Ok((s, from)) => {
                    // The peer must run as this user (what SO_PEERCRED says of a Unix socket).
                    let me = s.local_addr().ok();
                    // SAFETY: geteuid has no preconditions.
                    let uid = unsafe { libc::geteuid() };
                    let theirs = me.and_then(|me| crate::os::process::loopback_peer_uid(me, from));
                    if let Err(why) = peer_user_check(theirs, uid, self.strict) {
                        crate::bootstrap::auth::refuse(
                            "shared-memory setup listener",
                            Some(from.ip()),
                            &why,
                        );
                        continue;
                    }
                    let Ok(mut side) = Side::new(s) else {
                        continue;
                    };
                    side.expect(NAME_MSG + TAG);
                    if let Some(old) =
                        crate::net::oldest_stranger(&self.pending, |_| true, Side::born)
                    {
                        let old = self.pending.swap_remove(old);
                        crate::bootstrap::auth::refuse(
                            "shared-memory setup listener",
                            old.peer_ip(),
                            "too many connections without a name message: the oldest is dropped for a new one",
                        );
                    }
                    self.pending.push(side);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // Out of descriptors, a connection reset before accept...: try again later.
                Err(_) => break,
            }
        }
        let mut i = 0;
        while i < self.pending.len() {
            let pumped = self.pending[i].pump();
            let bad = match &pumped {
                Err(e) => Some(format!("the connection failed during setup ({e})")),
                Ok(false) if self.pending[i].overdue() => Some(format!(
                    "no whole setup message within {:.0?}",
                    super::SETUP_DEADLINE
                )),
                Ok(false) => {
                    i += 1;
                    continue;
                }
                Ok(true) => None,
            };
            let mut side = self.pending.swap_remove(i);
            let refuse = |why: &str| {
                crate::bootstrap::auth::refuse("shared-memory setup listener", side.peer_ip(), why)
            };
            if let Some(why) = bad {
                refuse(&why);
                continue;
            }
            let (msg, tag) = side.inb.split_at(NAME_MSG);
            if !self.key.verify(&[msg], tag) {
                refuse("a setup message not authenticated by this job's key (garbage, a rank of another job, or without the job secret)");
                continue;
            }
            if !self.seen.first(tag) {
                refuse("a replayed setup message");
                continue;
            }
            let NameMsg {
                name,
                ring,
                pid,
                probe,
            } = match parse_name_msg(msg) {
                Ok(m) => m,
                Err(why) => {
                    refuse(&why);
                    continue;
                }
            };
            let seg = match Segment::open(&name, SEG_HDR + ring) {
                Ok(s) => s,
                Err(e) => {
                    refuse(&format!("its segment cannot be mapped: {e}"));
                    continue;
                }
            };
            // Can we read the sender's memory? (Not across PID namespaces, or under a ptrace
            // policy like Yama's scope 1+ between sibling processes.)
            let mut word = 0u64;
            let cma = self.cma != usize::MAX
                && cma_read(pid as i32, probe, bytemuck::bytes_of_mut(&mut word)).is_ok()
                && word == CMA_PROBE;
            side.queue(&[if cma { 2 } else { 1 }]);
            // One byte to a fresh socket's empty buffer: sent at once, or the peer is gone.
            if !matches!(side.pump(), Ok(true)) {
                continue;
            }
            self.ready.push_back(Box::new(ShmRecv {
                stats: Arc::clone(&self.stats),
                seg,
                pid: pid as i32,
                direct_seen: 0,
                live: Liveness::new(side.s, "shared memory"),
                reqs: VecDeque::with_capacity(MAX_REQUESTS),
                base: 0,
                filling: 0,
                tail: 0,
                cur: None,
                polls: 0,
                failed: None,
            }));
        }
        Ok(self.ready.pop_front())
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        out.push(PollFd {
            fd: self.l.as_raw_fd(),
            events: libc::POLLIN,
        });
        for s in &self.pending {
            out.push(PollFd {
                fd: s.s.as_raw_fd(),
                events: libc::POLLIN,
            });
        }
    }
}

struct SReq {
    addr: usize,
    len: usize,
    tag: u32,
    /// Header written.
    started: bool,
    /// Payload bytes written.
    written: usize,
    /// Sent direct: the receiver's acknowledgement number that completes it.
    direct: Option<u64>,
    reaped: bool,
}

/// Bytes in use in a ring of `cap` bytes whose producer is at `head` and consumer at
/// `tail`, one of them read from shared memory the peer writes (`whose`: "consumer" or
/// "producer"). A consumer behind `head - cap` or past `head` is the peer's corruption: an
/// error, never a reason to overwrite unread bytes or read unwritten ones.
fn ring_used(cap: u64, head: u64, tail: u64, whose: &str) -> Result<u64> {
    match head.checked_sub(tail) {
        Some(used) if used <= cap => Ok(used),
        _ => Err(Error::InvalidUsage(format!(
            "shared memory: the peer's {whose} position is out of the ring (producer at byte {head}, consumer at {tail}, ring of {cap} bytes): its process corrupted the segment, or it runs another roccl version"
        ))),
    }
}

struct ShmSend {
    stats: Arc<ShmStats>,
    seg: Segment,
    /// Messages from this size on go direct (usize::MAX: never).
    direct_from: usize,
    /// Direct messages sent so far.
    direct_sent: u64,
    live: Liveness,
    reqs: VecDeque<SReq>,
    base: u64,
    /// Bytes produced so far (our copy of the header's head).
    head: u64,
    polls: u32,
    failed: Option<String>,
}

impl ShmSend {
    fn progress(&mut self) -> Result<()> {
        super::refuse_if_failed(&self.failed, "shared-memory send comm")?;
        let r = self.progress_inner();
        super::remember_failure(&mut self.failed, r)
    }

    fn progress_inner(&mut self) -> Result<()> {
        let h = self.seg.header();
        // Doorbells come only while our flag was up; the peer's exit is checked now and then.
        self.polls = self.polls.wrapping_add(1);
        // Read before writing: a store on every poll would bounce the line between the ranks.
        let flagged = h.send_sleeping.load(Ordering::Relaxed) != 0
            && h.send_sleeping.swap(0, Ordering::Relaxed) != 0;
        let alive = !(flagged || self.polls % 64 == 0) || drain_doorbells(&self.live.side);
        if !alive && self.blocked() {
            return Err(Error::sys(
                "shared memory send: the peer closed its connection (its process exited or it destroyed the communicator) while this rank still has data for it",
                std::io::ErrorKind::UnexpectedEof.into(),
            ));
        }
        let cap = self.seg.cap() as u64;
        let start = self.head;
        let tail = h.tail.load(Ordering::Acquire);
        // Checked once: below, head only advances by what is free, so `head - tail <= cap`.
        ring_used(cap, self.head, tail, "consumer")?;
        for r in self.reqs.iter_mut() {
            if r.started && r.written == r.len {
                continue;
            }
            let free = cap - (self.head - tail);
            if !r.started {
                if free < MSG_HDR as u64 {
                    break;
                }
                let mut hdr = [0u8; MSG_HDR];
                hdr[0..8].copy_from_slice(&(r.len as u64).to_le_bytes());
                hdr[8..12].copy_from_slice(&r.tag.to_le_bytes());
                if r.len >= self.direct_from {
                    // Direct: the receiver reads it from our memory and acknowledges.
                    self.direct_sent += 1;
                    hdr[12..16].copy_from_slice(&1u32.to_le_bytes());
                    hdr[16..24].copy_from_slice(&(r.addr as u64).to_le_bytes());
                    hdr[24..28].copy_from_slice(&std::process::id().to_le_bytes());
                    hdr[28..32].copy_from_slice(&(self.direct_sent as u32).to_le_bytes());
                    r.direct = Some(self.direct_sent);
                    r.written = r.len;
                }
                // SAFETY: `free` bytes after head belong to us (the consumer is behind tail).
                unsafe { self.seg.put(self.head, hdr.as_ptr(), MSG_HDR) };
                self.head += MSG_HDR as u64;
                r.started = true;
            }
            let free = cap - (self.head - tail);
            let n = (r.len - r.written).min(free as usize);
            if n > 0 {
                // SAFETY: the isend contract keeps the buffer readable; the ring range is ours.
                unsafe {
                    self.seg
                        .put(self.head, (r.addr + r.written) as *const u8, n)
                };
                self.head += n as u64;
                r.written += n;
            }
            if r.written < r.len {
                break; // ring full: the rest when the receiver made room
            }
        }
        if self.head != start {
            h.head.store(self.head, Ordering::Release);
            if h.recv_sleeping.load(Ordering::SeqCst) != 0 {
                ring_doorbell(&self.live.side);
                self.stats.wakeups.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Whether a request waits: for room in the ring, or for the receiver's copy.
    fn blocked(&self) -> bool {
        let acked = self.seg.header().direct_done.load(Ordering::Acquire);
        self.reqs
            .iter()
            .any(|r| !r.started || r.written < r.len || r.direct.is_some_and(|d| d > acked))
    }
}

impl SendComm for ShmSend {
    unsafe fn isend(
        &mut self,
        data: *const u8,
        len: usize,
        tag: u32,
        _mr: Option<&MemHandle>,
    ) -> Result<Option<ReqId>> {
        self.progress()?;
        if self.reqs.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        let id = self.base + self.reqs.len() as u64;
        self.reqs.push_back(SReq {
            addr: data as usize,
            len,
            tag,
            started: false,
            written: 0,
            direct: None,
            reaped: false,
        });
        self.progress()?;
        Ok(Some(ReqId(id as u32)))
    }

    fn test(&mut self, req: ReqId) -> Result<Option<usize>> {
        self.progress()?;
        let r = super::pending_request(&mut self.reqs, self.base, req, |r| r.reaped, "send")?;
        // Complete once every byte is in the ring (or, direct, copied by the receiver): the
        // caller's buffer is free again.
        if !r.started || r.written < r.len {
            return Ok(None);
        }
        if let Some(d) = r.direct {
            if self.seg.header().direct_done.load(Ordering::Acquire) < d {
                return Ok(None);
            }
        }
        r.reaped = true;
        let len = r.len;
        super::pop_reaped(&mut self.reqs, &mut self.base, |r| r.reaped);
        Ok(Some(len))
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        let h = self.seg.header();
        out.push(PollFd {
            fd: self.live.side.as_raw_fd(),
            events: libc::POLLIN,
        });
        if self.blocked() {
            h.send_sleeping.store(1, Ordering::SeqCst);
            self.stats.sleeps.fetch_add(1, Ordering::Relaxed);
            // Room or an acknowledgement appeared between the last look and the flag: do not
            // sleep.
            let cap = self.seg.cap() as u64;
            // A corrupt position: do not sleep; the next progress reports it.
            let free = ring_used(cap, self.head, h.tail.load(Ordering::SeqCst), "consumer")
                .map_or(1, |used| cap - used);
            if free > 0 || !self.blocked() {
                out.push(PollFd {
                    fd: always_ready(),
                    events: libc::POLLIN,
                });
            }
        }
    }
}

struct RReq {
    g: RecvGroup,
    reaped: bool,
}

struct ShmRecv {
    stats: Arc<ShmStats>,
    seg: Segment,
    /// The sender's process, for direct messages.
    pid: i32,
    /// Direct messages copied so far.
    direct_seen: u64,
    live: Liveness,
    reqs: VecDeque<RReq>,
    base: u64,
    /// Request id of the receive the next message belongs to.
    filling: u64,
    /// Bytes consumed so far (our copy of the header's tail).
    tail: u64,
    /// The message being copied out: (buffer index, length, bytes copied).
    cur: Option<(usize, usize, usize)>,
    polls: u32,
    failed: Option<String>,
}

impl ShmRecv {
    fn progress(&mut self) -> Result<()> {
        super::refuse_if_failed(&self.failed, "shared-memory receive comm")?;
        let r = self.progress_inner();
        super::remember_failure(&mut self.failed, r)
    }

    fn progress_inner(&mut self) -> Result<()> {
        let h = self.seg.header();
        self.polls = self.polls.wrapping_add(1);
        let flagged = h.recv_sleeping.load(Ordering::Relaxed) != 0
            && h.recv_sleeping.swap(0, Ordering::Relaxed) != 0;
        let alive = !(flagged || self.polls % 64 == 0) || drain_doorbells(&self.live.side);
        let start = self.tail;
        loop {
            let head = h.head.load(Ordering::Acquire);
            let idx = (self.filling - self.base) as usize;
            let Some(r) = self.reqs.get_mut(idx) else {
                break; // no receive posted for the next message yet
            };
            let cap = self.seg.cap() as u64;
            if self.cur.is_none() {
                if ring_used(cap, head, self.tail, "producer")? < MSG_HDR as u64 {
                    break;
                }
                let mut hdr = [0u8; MSG_HDR];
                // SAFETY: the producer published these bytes (head is past them).
                unsafe { self.seg.get(self.tail, hdr.as_mut_ptr(), MSG_HDR) };
                let len = u64::from_le_bytes(hdr[0..8].try_into().unwrap()) as usize;
                let tag = u32::from_le_bytes(hdr[8..12].try_into().unwrap());
                let direct = u32::from_le_bytes(hdr[12..16].try_into().unwrap()) == 1;
                let e = r.g.buffer_for(tag, len)?;
                self.tail += MSG_HDR as u64;
                if direct {
                    let src = u64::from_le_bytes(hdr[16..24].try_into().unwrap());
                    let seq = u32::from_le_bytes(hdr[28..32].try_into().unwrap());
                    // SAFETY: `buffer_for` returned a posted receive buffer of at least `len`
                    // bytes, which the caller keeps valid and unaliased until the receive
                    // completes.
                    let dst =
                        unsafe { std::slice::from_raw_parts_mut(r.g.bufs[e].0 as *mut u8, len) };
                    cma_read(self.pid, src, dst).map_err(|err| {
                        Error::sys(
                            format!(
                                "shared memory receive: reading {len} bytes from process {} (process_vm_readv)",
                                self.pid
                            ),
                            err,
                        )
                    })?;
                    if r.g.fill(e, len)? {
                        self.filling += 1;
                    }
                    // Publish the consumed header, then acknowledge the copy (direct messages
                    // are numbered in order on both sides).
                    self.direct_seen += 1;
                    if seq != self.direct_seen as u32 {
                        return Err(Error::Internal(format!(
                            "shared memory receive: direct message {seq} where {} was due",
                            self.direct_seen as u32
                        )));
                    }
                    h.tail.store(self.tail, Ordering::Release);
                    h.direct_done.store(self.direct_seen, Ordering::Release);
                    if h.send_sleeping.load(Ordering::SeqCst) != 0 {
                        ring_doorbell(&self.live.side);
                        self.stats.wakeups.fetch_add(1, Ordering::Relaxed);
                    }
                    continue;
                }
                self.cur = Some((e, len, 0));
            }
            let (e, len, done) = self.cur.expect("set above");
            let avail =
                ring_used(cap, h.head.load(Ordering::Acquire), self.tail, "producer")? as usize;
            let n = (len - done).min(avail);
            if n > 0 {
                // SAFETY: published bytes; the irecv contract keeps the buffer writable.
                unsafe {
                    self.seg
                        .get(self.tail, (r.g.bufs[e].0 + done) as *mut u8, n)
                };
                self.tail += n as u64;
            }
            if done + n < len {
                self.cur = Some((e, len, done + n));
                break;
            }
            self.cur = None;
            if r.g.fill(e, len)? {
                self.filling += 1;
            }
        }
        if self.tail != start {
            h.tail.store(self.tail, Ordering::Release);
            if h.send_sleeping.load(Ordering::SeqCst) != 0 {
                ring_doorbell(&self.live.side);
                self.stats.wakeups.fetch_add(1, Ordering::Relaxed);
            }
        }
        let waiting = self.reqs.iter().any(|r| !r.g.done());
        if !alive && waiting && h.head.load(Ordering::Acquire) == self.tail {
            return Err(Error::sys(
                "shared memory receive: the peer closed its connection (its process exited or it destroyed the communicator) while this rank still waits for it",
                std::io::ErrorKind::UnexpectedEof.into(),
            ));
        }
        Ok(())
    }
}

impl RecvComm for ShmRecv {
    unsafe fn irecv(&mut self, bufs: &[RecvBuf]) -> Result<Option<ReqId>> {
        self.progress()?;
        let g = RecvGroup::new(bufs)?;
        if self.reqs.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        let id = self.base + self.reqs.len() as u64;
        self.reqs.push_back(RReq { g, reaped: false });
        self.progress()?;
        Ok(Some(ReqId(id as u32)))
    }

    fn test(&mut self, req: ReqId, sizes: &mut [usize]) -> Result<bool> {
        self.progress()?;
        let r = super::pending_request(&mut self.reqs, self.base, req, |r| r.reaped, "receive")?;
        if !r.g.done() {
            return Ok(false);
        }
        for (d, s) in sizes.iter_mut().zip(r.g.sizes()) {
            *d = *s;
        }
        r.reaped = true;
        super::pop_reaped(&mut self.reqs, &mut self.base, |r| r.reaped);
        Ok(true)
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        let h = self.seg.header();
        out.push(PollFd {
            fd: self.live.side.as_raw_fd(),
            events: libc::POLLIN,
        });
        if self.reqs.iter().any(|r| !r.g.done()) {
            h.recv_sleeping.store(1, Ordering::SeqCst);
            self.stats.sleeps.fetch_add(1, Ordering::Relaxed);
            // Data arrived between the last look and the flag: do not sleep.
            if h.head.load(Ordering::SeqCst) != self.tail {
                out.push(PollFd {
                    fd: always_ready(),
                    events: libc::POLLIN,
                });
            }
        }
    }
}

#[cfg(test)]
mod auth_tests;

#[cfg(test)]
mod tests;
