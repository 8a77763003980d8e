//! Connection setup: the connecting side opens its sockets and sends a hello on each
//! ([`TcpConnecting`]); the listener groups the sockets it accepts by connection id and
//! hands out the receive comm once all have arrived ([`TcpListen`]).

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use socket2::{Domain, Protocol, Socket, Type};

use super::io::{recv_raw, send_raw, Layout};
use super::records::{ConnKeys, Crypt};
use super::recv::TcpRecvComm;
use super::send::TcpSendComm;
use super::TcpStats;
use super::{
    decode_handle, encode_handle, tune, Handle, TcpNet, HANDLE_TOKEN, HDR, HELLO, HELLO_DUPLEX,
    HELLO_MAGIC, HELLO_SEALED, MAX_SOCKS,
};
use crate::bootstrap::auth::{self, JobKey};
use crate::error::{Error, Result};
use crate::net::{
    connect_done, start_connect, Connecting, ListenComm, NetHandle, PollFd, RecvComm, SendComm,
};

impl TcpNet {
    /// Open a connection to `handle`'s listener; `duplex`: the shared socket, then each
    /// direction's own (see [`Layout`]).
    pub(super) fn dial(&self, handle: &NetHandle, duplex: bool) -> Result<Box<dyn Connecting>> {
        let h = decode_handle(handle)?;
        let (sa, per_way, split) = (h.reachable(), h.nsocks, h.split);
        let nsocks = if duplex { 1 + 2 * per_way } else { per_way };
        let sealed = self.key.encrypting();
        let count = nsocks as u16
            | if duplex { HELLO_DUPLEX } else { 0 }
            | if sealed { HELLO_SEALED } else { 0 };
        let token = &handle.as_bytes()[HANDLE_TOKEN..HANDLE_TOKEN + crate::net::TOKEN_BYTES];
        let key = self.key.for_token("tcp", token);
        let id = u64::from_le_bytes(auth::random()?);
        let keys = sealed.then(|| ConnKeys::new(&key, id, true));
        let mut socks = Vec::with_capacity(nsocks);
        let sndbuf = self.sndbuf_for(sa.ip());
        for i in 0..nsocks {
            let s = Socket::new(Domain::for_address(sa), Type::STREAM, Some(Protocol::TCP))
                .map_err(|e| Error::sys("socket() for a TCP connection", e))?;
            tune(&s)?;
            if let Some(b) = sndbuf {
                s.set_send_buffer_size(b)
                    .map_err(|e| Error::sys("setsockopt(SO_SNDBUF)", e))?;
            }
            start_connect(&s, sa, "")?;
            let mut hello = [0u8; HELLO];
            hello[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
            hello[4..12].copy_from_slice(&id.to_le_bytes());
            hello[12..14].copy_from_slice(&(i as u16).to_le_bytes());
            hello[14..16].copy_from_slice(&count.to_le_bytes());
            let tag = key.tag(&[&hello[..HDR]]);
            hello[HDR..].copy_from_slice(&tag);
            socks.push(PendingSock {
                sock: s,
                hello,
                sent: 0,
                connected: false,
            });
        }
        Ok(Box::new(TcpConnecting {
            peer: sa,
            socks,
            keys,
            stats: Arc::clone(&self.stats),
            layout: Layout {
                split,
                inline: duplex.then_some(self.duplex_inline),
            },
        }))
    }
}

impl TcpNet {
    /// Listen on this network's address: the handle says where, and how to connect.
    pub(super) fn open_listener(&self) -> Result<(NetHandle, Box<dyn ListenComm>)> {
        // With other addresses, every address takes connections (one port for all).
        let bind_ip = match self.addr {
            std::net::IpAddr::V4(_) if !self.others.is_empty() => {
                std::net::Ipv4Addr::UNSPECIFIED.into()
            }
            a => a,
        };
        let sa = SocketAddr::new(bind_ip, 0);
        let s = Socket::new(Domain::for_address(sa), Type::STREAM, Some(Protocol::TCP))
            .map_err(|e| Error::sys("socket() for the TCP listener", e))?;
        s.bind(&sa.into())
            .map_err(|e| Error::sys(format!("bind({sa}) for the TCP listener"), e))?;
        s.listen(4096)
            .map_err(|e| Error::sys(format!("listen() on {sa}"), e))?;
        s.set_nonblocking(true)
            .map_err(|e| Error::sys("fcntl(O_NONBLOCK) on the listener", e))?;
        let local = s
            .local_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .ok_or_else(|| Error::Internal("listener has no local address".into()))?;
        let (token, key) = self.key.listener("tcp")?;
        let handle = encode_handle(
            &Handle {
                addr: SocketAddr::new(self.addr, local.port()),
                others: self.others.clone(),
                nsocks: self.nsocks,
                split: self.split,
            },
            self.duplex,
            &token,
        )?;
        Ok((
            handle,
            Box::new(TcpListen {
                sealed: self.key.encrypting(),
                key,
                seen: crate::net::SeenTags::new(),
                done: crate::net::SeenTags::new(),
                sock: s,
                split: self.split,
                duplex_inline: self.duplex_inline,
                local_sndbuf: self.local_sndbuf,
                stats: Arc::clone(&self.stats),
                pending: Vec::new(),
                groups: HashMap::new(),
                ready: std::collections::VecDeque::new(),
            }),
        ))
    }
}

pub(super) struct PendingSock {
    sock: Socket,
    hello: [u8; HELLO],
    sent: usize,
    connected: bool,
}

pub(super) struct TcpConnecting {
    peer: SocketAddr,
    socks: Vec<PendingSock>,
    /// The connection's keys when the job encrypts.
    keys: Option<ConnKeys>,
    layout: Layout,
    stats: Arc<TcpStats>,
}

/// A connection's sockets: those of the direction of its opener (the shared one first) and,
/// on a duplex connection, those of the way back.
pub(super) fn ways(
    mut socks: Vec<Arc<Socket>>,
    duplex: bool,
) -> (Vec<Arc<Socket>>, Vec<Arc<Socket>>) {
    if !duplex {
        return (socks, Vec::new());
    }
    let back = socks.split_off(1 + (socks.len() - 1) / 2);
    (socks, back)
}

impl Connecting for TcpConnecting {
    fn poll(&mut self) -> Result<Option<Box<dyn SendComm>>> {
        let mut all = true;
        for p in &mut self.socks {
            if !p.connected {
                if !connect_done(
                    &p.sock,
                    self.peer,
                    "",
                    "is the peer alive and the address reachable? check ROCCL_SOCKET_IFNAME",
                )? {
                    all = false;
                    continue;
                }
                p.connected = true;
            }
            while p.sent < HELLO {
                match send_raw(p.sock.as_raw_fd(), &p.hello[p.sent..]) {
                    Ok(n) => p.sent += n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(Error::sys(format!("sending hello to {}", self.peer), e)),
                }
            }
            if p.sent < HELLO {
                all = false;
            }
        }
        if !all {
            return Ok(None);
        }
        let socks: Vec<Arc<Socket>> = self.socks.drain(..).map(|p| Arc::new(p.sock)).collect();
        let (own, back) = ways(socks, self.layout.inline.is_some());
        let crypt = self.keys.map(|k| Crypt::new(k, own.len(), back.len()));
        TcpStats::count(&self.stats.connections);
        let mut comm = TcpSendComm::new(own, back, self.layout, self.peer, crypt);
        comm.stats = Arc::clone(&self.stats);
        comm.receive_back = Some(TcpRecvComm::way_back);
        Ok(Some(Box::new(comm)))
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        for p in &self.socks {
            out.push(PollFd {
                fd: p.sock.as_raw_fd(),
                events: libc::POLLOUT,
            });
        }
    }
}

/// What an authenticated hello says: the connection it belongs to, which of its sockets
/// this one is, how many there are, and whether the connection is duplex.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    /// The connection id (one per connect).
    pub id: u64,
    /// This socket's place in the connection, below `n`.
    pub idx: usize,
    /// The connection's sockets, both ways together.
    pub n: usize,
    /// Whether the connection is duplex (a shared socket, then each way's own).
    pub duplex: bool,
    /// Whether the connection is encrypted ([`super::records`]).
    pub sealed: bool,
}

/// The fields of a hello whose magic and tag have been checked, or `None` when its shape
/// is not one a roccl connector makes (no sockets, too many, an index outside them, or a
/// duplex connection without a shared socket and two equal ways).
pub(crate) fn hello_shape(h: &[u8; HELLO]) -> Option<Hello> {
    let id = u64::from_le_bytes(h[4..12].try_into().unwrap());
    let idx = u16::from_le_bytes([h[12], h[13]]) as usize;
    let count = u16::from_le_bytes([h[14], h[15]]);
    let duplex = count & HELLO_DUPLEX != 0;
    let sealed = count & HELLO_SEALED != 0;
    let n = (count & !(HELLO_DUPLEX | HELLO_SEALED)) as usize;
    let per_way = if duplex { n.saturating_sub(1) / 2 } else { n };
    let shape_ok = !duplex || n % 2 == 1;
    if per_way == 0 || per_way > MAX_SOCKS || idx >= n || !shape_ok {
        return None;
    }
    Some(Hello {
        id,
        idx,
        n,
        duplex,
        sealed,
    })
}

pub(super) struct Incoming {
    sock: Socket,
    from: Option<std::net::IpAddr>,
    hello: [u8; HELLO],
    got: usize,
    since: std::time::Instant,
}

/// Say once per process that a listener could not accept (the call goes on: its own
/// connections are made or time out as usual).
fn listener_trouble(what: &str, e: &io::Error) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        crate::warn!(
            "{what}: accept() failed ({e}); going on (out of file descriptors? raise `ulimit -n`)"
        )
    });
}

/// A connection id as a key of [`crate::net::SeenTags`].
fn id_bytes(id: u64) -> [u8; auth::TAG_BYTES] {
    let mut b = [0u8; auth::TAG_BYTES];
    b[..8].copy_from_slice(&id.to_le_bytes());
    b
}

impl TcpListen {
    /// Why the hello `h` reuses a connection id, if it does: the connection is complete
    /// already, or the hello's count or direction differ from its connection's others, or
    /// its socket is there already.
    fn reused(&self, h: &Hello) -> Option<&'static str> {
        if self.done.contains(&id_bytes(h.id)) {
            return Some(
                "a hello reusing the id of a connection made already (its keys would repeat)",
            );
        }
        match self.groups.get(&h.id) {
            Some(g) if g.1.len() != h.n || g.0 != h.duplex => {
                Some("a hello whose socket count or direction differ from its connection's")
            }
            Some(g) if g.1[h.idx].is_some() => {
                Some("a second hello for one socket of a connection")
            }
            _ => None,
        }
    }
}

pub(super) struct TcpListen {
    /// The key hellos are authenticated with.
    key: JobKey,
    /// The job encrypts: so must every connection.
    sealed: bool,
    /// Tags of the hellos accepted (a replayed hello is refused).
    seen: crate::net::SeenTags,
    /// Ids of the connections completed (an id is never taken twice).
    done: crate::net::SeenTags,
    sock: Socket,
    /// Split threshold published in our handle; senders cut messages with it (both ways on
    /// a duplex connection).
    split: usize,
    /// Payloads a duplex connection sends inline ([`super::TcpSettings::duplex_inline`]).
    duplex_inline: usize,
    /// `SO_SNDBUF` for sending back to a peer on this host ([`RecvComm::reverse`]).
    local_sndbuf: Option<usize>,
    stats: Arc<TcpStats>,
    pending: Vec<Incoming>,
    /// Sockets of connections still arriving, by connection id, and whether it is duplex.
    groups: HashMap<u64, (bool, Vec<Option<Socket>>)>,
    /// Connections complete and not handed out yet: a call drives every pending socket
    /// (refusing every stranger whose bytes are in) and hands out one of these.
    ready: std::collections::VecDeque<Box<dyn RecvComm>>,
}

/// Where a pending connection's hello stands.
enum HelloRead {
    /// Not all of it yet.
    Partial,
    /// All 32 bytes.
    Whole,
    /// Closed, failed or too slow: drop it.
    Dropped,
}

impl TcpListen {
    /// Accept every waiting connection (the oldest stranger giving way past the cap).
    fn take_new(&mut self) {
        loop {
            match self.sock.accept() {
                Ok((s, from)) => {
                    if tune(&s).is_err() {
                        continue; // a socket already reset by its peer: drop it
                    }
                    if let Some(old) =
                        crate::net::oldest_stranger(&self.pending, |_| true, |p| p.since)
                    {
                        let old = self.pending.swap_remove(old);
                        auth::refuse(
                            "tcp setup listener",
                            old.from,
                            "too many connections without a hello: the oldest is dropped for a new one",
                        );
                    }
                    self.pending.push(Incoming {
                        sock: s,
                        from: from.as_socket().map(|a| a.ip()),
                        hello: [0; HELLO],
                        got: 0,
                        since: std::time::Instant::now(),
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                // Out of descriptors (EMFILE, ENFILE), a connection aborted before accept:
                // the listener's trouble, not the call's; try again at the next call.
                Err(e) => {
                    listener_trouble("tcp setup listener", &e);
                    break;
                }
            }
        }
    }

    /// Read on pending connection `i`'s hello.
    fn read_hello(&mut self, i: usize) -> HelloRead {
        let inc = &mut self.pending[i];
        while inc.got < HELLO {
            // SAFETY: the unread rest of this connection's own hello buffer.
            match unsafe {
                recv_raw(
                    inc.sock.as_raw_fd(),
                    inc.hello[inc.got..].as_mut_ptr(),
                    HELLO - inc.got,
                )
            } {
                Ok(0) => return HelloRead::Dropped, // closed before its hello
                Ok(n) => inc.got += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => return HelloRead::Dropped,
            }
        }
        if inc.got == HELLO {
            return HelloRead::Whole;
        }
        if inc.since.elapsed() > crate::net::SETUP_DEADLINE {
            auth::refuse(
                "tcp setup listener",
                inc.from,
                &format!(
                    "no whole hello within {:.0?} ({} of {HELLO} bytes)",
                    crate::net::SETUP_DEADLINE,
                    inc.got
                ),
            );
            return HelloRead::Dropped;
        }
        HelloRead::Partial
    }

    /// What a whole hello says, if it is one of this job's connections (else refused,
    /// counted and logged).
    fn check_hello(&mut self, inc: &Incoming) -> Option<Hello> {
        let h = &inc.hello;
        let refuse = |why: &str| {
            auth::refuse("tcp setup listener", inc.from, why);
            None
        };
        if u32::from_le_bytes(h[0..4].try_into().unwrap()) != HELLO_MAGIC {
            return refuse("not a roccl hello (bad magic)");
        }
        if !self.key.verify(&[&h[..HDR]], &h[HDR..]) {
            return refuse("a hello not authenticated by this job's key (a rank of another job, or without the job secret)");
        }
        if !self.seen.first(&h[HDR..]) {
            return refuse("a replayed hello");
        }
        let hello = hello_shape(h)?;
        // A connection id names one connection: its keys and nonces derive from it, so a
        // second connection under an id (even from a dialer with the key) would repeat
        // them. Refused, as is a hello that does not fit its connection's others.
        if let Some(why) = self.reused(&hello) {
            return refuse(why);
        }
        if hello.sealed != self.sealed {
            return refuse(if self.sealed {
                "an unencrypted connection to an encrypted job"
            } else {
                "an encrypted connection to a job that does not encrypt"
            });
        }
        Some(hello)
    }

    /// File `inc`'s socket with its connection's others; the connection once all are here.
    fn group(&mut self, inc: Incoming, h: Hello) -> Option<Box<dyn RecvComm>> {
        let g = self
            .groups
            .entry(h.id)
            .or_insert_with(|| (h.duplex, (0..h.n).map(|_| None).collect()));
        g.1[h.idx] = Some(inc.sock);
        if !g.1.iter().all(Option::is_some) {
            return None;
        }
        self.done.first(&id_bytes(h.id));
        let socks: Vec<Arc<Socket>> = self
            .groups
            .remove(&h.id)
            .map(|g| g.1)
            .unwrap_or_default()
            .into_iter()
            .flatten()
            .map(Arc::new)
            .collect();
        let (own, back) = ways(socks, h.duplex);
        let layout = Layout {
            split: self.split,
            inline: h.duplex.then_some(self.duplex_inline),
        };
        let crypt = self
            .sealed
            .then(|| Crypt::new(ConnKeys::new(&self.key, h.id, false), own.len(), back.len()));
        let mut comm = TcpRecvComm::new(own, back, layout, crypt);
        comm.send_back = Some(TcpSendComm::way_back);
        comm.local_sndbuf = self.local_sndbuf;
        comm.stats = Arc::clone(&self.stats);
        TcpStats::count(&self.stats.connections);
        Some(Box::new(comm))
    }
}

impl ListenComm for TcpListen {
    fn accept(&mut self) -> Result<Option<Box<dyn RecvComm>>> {
        self.take_new();
        let mut i = 0;
        while i < self.pending.len() {
            match self.read_hello(i) {
                HelloRead::Partial => i += 1,
                HelloRead::Dropped => {
                    self.pending.swap_remove(i);
                }
                HelloRead::Whole => {
                    let inc = self.pending.swap_remove(i);
                    let Some(h) = self.check_hello(&inc) else {
                        continue;
                    };
                    if let Some(comm) = self.group(inc, h) {
                        self.ready.push_back(comm);
                    }
                }
            }
        }
        Ok(self.ready.pop_front())
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        out.push(PollFd {
            fd: self.sock.as_raw_fd(),
            events: libc::POLLIN,
        });
        for p in &self.pending {
            out.push(PollFd {
                fd: p.sock.as_raw_fd(),
                events: libc::POLLIN,
            });
        }
    }
}
