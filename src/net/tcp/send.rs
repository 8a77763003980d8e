//! The send comm: each message's header and parts written to its sockets in post order.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use socket2::Socket;

use super::io::{io_err, send2, shut, Layout};
use super::records::{Crypt, Sealer};
use super::{WayBack, HDR, LEN_MASK, MAX_FDS, MSG_MAGIC};
use crate::error::{Error, Result};
use crate::net::{MemHandle, PollFd, RecvComm, ReqId, SendComm, MAX_REQUESTS};

pub(super) struct SendMsg {
    addr: usize,
    len: usize,
    hdr: [u8; HDR],
    /// Bytes sent on each socket (socket 0 counts the header).
    off: [usize; MAX_FDS],
    parts_left: u8,
    reaped: bool,
}

pub(super) struct TcpSendComm {
    /// The network's counters.
    pub(super) stats: Arc<super::TcpStats>,
    socks: Vec<Arc<Socket>>,
    /// A duplex connection's sockets of the way back, until [`SendComm::reverse`].
    back: Vec<Arc<Socket>>,
    /// What makes the receive comm of the way back (`TcpRecvComm::way_back`, given by the
    /// setup of a duplex connection).
    pub(super) receive_back: Option<fn(WayBack) -> Box<dyn RecvComm>>,
    fds: Vec<i32>,
    layout: Layout,
    peer: SocketAddr,
    msgs: VecDeque<SendMsg>,
    /// Sequence number of `msgs[0]`.
    base: u64,
    /// Per socket: the message it is sending (absolute sequence number).
    cur: [u64; MAX_FDS],
    failed: Option<String>,
    /// An encrypted connection's share ([`Crypt`]), and a sealer per socket (empty when
    /// the job does not encrypt).
    crypt: Option<Crypt>,
    seal: Vec<Sealer>,
}

impl TcpSendComm {
    pub(super) fn new(
        socks: Vec<Arc<Socket>>,
        back: Vec<Arc<Socket>>,
        layout: Layout,
        peer: SocketAddr,
        crypt: Option<Crypt>,
    ) -> Self {
        let fds = socks.iter().map(|s| s.as_raw_fd()).collect();
        let seal = crypt
            .as_ref()
            .map_or_else(Vec::new, |c| c.keys.sealers(&c.own));
        TcpSendComm {
            crypt,
            seal,
            socks,
            back,
            receive_back: None,
            fds,
            layout,
            peer,
            msgs: VecDeque::with_capacity(MAX_REQUESTS),
            base: 0,
            cur: [0; MAX_FDS],
            failed: None,
            stats: Arc::default(),
        }
    }

    fn fail(&mut self, e: Error) -> Error {
        self.failed = Some(e.to_string());
        e
    }

    fn progress(&mut self) -> Result<()> {
        crate::net::refuse_if_failed(&self.failed, "TCP send comm")?;
        let n = self.fds.len();
        let end = self.base + self.msgs.len() as u64;
        for j in 0..n {
            while self.cur[j] < end {
                let m = &mut self.msgs[(self.cur[j] - self.base) as usize];
                let (s, e) = self.layout.part(m.len, j, n);
                let hdr = if j == self.layout.head(m.len, n) {
                    HDR
                } else {
                    0
                };
                let total = hdr + (e - s);
                if m.off[j] < total {
                    let o = m.off[j];
                    let (a, b_ptr, b_len) = if o < hdr {
                        (&m.hdr[o..], m.addr + s, e - s)
                    } else {
                        (&[][..], m.addr + s + (o - hdr), total - o)
                    };
                    // SAFETY: `b_ptr..b_ptr+b_len` lies in a posted send buffer, which
                    // `isend`'s caller keeps valid until the request completes.
                    let r = unsafe {
                        match self.seal.get_mut(j) {
                            Some(sealer) => sealer.send2(self.fds[j], a, b_ptr, b_len),
                            None => send2(self.fds[j], a, b_ptr, b_len),
                        }
                    };
                    match r {
                        Ok(w) => {
                            if w < a.len() + b_len {
                                super::TcpStats::count(&self.stats.short_writes);
                            }
                            m.off[j] += w;
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            super::TcpStats::count(&self.stats.send_would_block);
                            break;
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) => {
                            let err = io_err("TCP send", Some(self.peer), e);
                            return Err(self.fail(err));
                        }
                    }
                }
                if m.off[j] == total {
                    m.parts_left -= 1;
                    self.cur[j] += 1;
                } else {
                    break;
                }
            }
        }
        Ok(())
    }
}

impl TcpSendComm {
    /// The send comm of a duplex connection's way back (see [`WayBack`]): to the peer
    /// that connected.
    pub(super) fn way_back(w: WayBack) -> Box<dyn SendComm> {
        let mut comm = TcpSendComm::new(w.socks, Vec::new(), w.layout, w.peer, w.crypt);
        comm.stats = w.stats;
        Box::new(comm)
    }
}

impl SendComm for TcpSendComm {
    fn rtt(&self) -> Option<std::time::Duration> {
        crate::os::process::tcp_rtt(*self.fds.first()?)
    }

    unsafe fn isend(
        &mut self,
        data: *const u8,
        len: usize,
        tag: u32,
        _mr: Option<&MemHandle>,
    ) -> Result<Option<ReqId>> {
        crate::net::refuse_if_failed(&self.failed, "TCP send comm")?;
        if self.msgs.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        if len as u64 > LEN_MASK {
            return Err(Error::arg(format!(
                "a TCP message of {len} bytes: at most {LEN_MASK} bytes per message"
            )));
        }
        let mut hdr = [0u8; HDR];
        // The message's number (mod 2^16) in the top bits of the length: on a duplex
        // connection messages arrive on two sockets and the receiver takes them in order.
        let seq = self.base + self.msgs.len() as u64;
        hdr[0..8].copy_from_slice(&(len as u64 & LEN_MASK | seq << 48).to_le_bytes());
        hdr[8..12].copy_from_slice(&tag.to_le_bytes());
        hdr[12..16].copy_from_slice(&MSG_MAGIC.to_le_bytes());
        self.msgs.push_back(SendMsg {
            addr: data as usize,
            len,
            hdr,
            off: [0; MAX_FDS],
            parts_left: self.fds.len() as u8,
            reaped: false,
        });
        self.progress()?;
        Ok(Some(ReqId(seq as u32)))
    }

    fn test(&mut self, req: ReqId) -> Result<Option<usize>> {
        self.progress()?;
        let m = crate::net::pending_request(&mut self.msgs, self.base, req, |r| r.reaped, "send")?;
        if m.parts_left > 0 {
            return Ok(None);
        }
        m.reaped = true;
        let len = m.len;
        while self.msgs.front().is_some_and(|m| m.reaped) {
            self.msgs.pop_front();
            self.base += 1;
        }
        Ok(Some(len))
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        let end = self.base + self.msgs.len() as u64;
        for (j, fd) in self.fds.iter().enumerate() {
            if self.cur[j] < end {
                out.push(PollFd {
                    fd: *fd,
                    events: libc::POLLOUT,
                });
            }
        }
    }

    /// The shared socket and the sockets of the way back read: the peer's messages back,
    /// laid out as this side lays out its own.
    fn reverse(&mut self) -> Option<Box<dyn RecvComm>> {
        let make = self.receive_back.filter(|_| !self.back.is_empty())?;
        let mut socks = vec![Arc::clone(&self.socks[0])];
        socks.append(&mut self.back);
        Some(make(WayBack {
            socks,
            layout: self.layout,
            crypt: self.crypt.as_ref().map(Crypt::reversed),
            stats: Arc::clone(&self.stats),
            peer: self.peer,
        }))
    }
}

impl Drop for TcpSendComm {
    fn drop(&mut self) {
        shut(&self.socks, std::net::Shutdown::Write);
        shut(&self.back, std::net::Shutdown::Both);
    }
}
