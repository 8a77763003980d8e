//! The receive comm: headers read from socket 0 through a buffer, payloads matched to the
//! posted buffers by tag and read from their sockets, large parts straight into the
//! destination.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use socket2::Socket;

use super::io::{io_err, recv_raw, shut, Layout};
use super::records::{Crypt, Opener};
use super::{is_local, WayBack, HDR, LEN_MASK, MAX_FDS, MSG_MAGIC, RXBUF, RX_DIRECT};
use crate::error::{Error, Result};
use crate::net::{PollFd, RecvBuf, RecvComm, ReqId, SendComm, MAX_RECVS, MAX_REQUESTS};

#[derive(Clone, Copy)]
pub(super) struct PostedBuf {
    addr: usize,
    len: usize,
    tag: u32,
}

pub(super) struct RecvReq {
    bufs: [PostedBuf; MAX_RECVS],
    n: u8,
    assigned: u8,
    sizes: [usize; MAX_RECVS],
    left: u8,
    reaped: bool,
}

pub(super) struct Slot {
    /// Index into `reqs` (by sequence).
    req: u64,
    /// Payload length and destination once the header has been read.
    len: usize,
    dst: usize,
    known: bool,
    /// The socket that carried the header (see [`Layout::head`]).
    head: u8,
    off: [usize; MAX_FDS],
    parts_left: u8,
}

pub(super) struct TcpRecvComm {
    /// The network's counters (handed to the way back, [`RecvComm::reverse`]).
    pub(super) stats: Arc<super::TcpStats>,
    socks: Vec<Arc<Socket>>,
    /// A duplex connection's sockets of the way back, until [`RecvComm::reverse`].
    back: Vec<Arc<Socket>>,
    /// What makes the send comm of the way back (`TcpSendComm::way_back`, given by the
    /// setup of a duplex connection).
    pub(super) send_back: Option<fn(WayBack) -> Box<dyn SendComm>>,
    fds: Vec<i32>,
    layout: Layout,
    rx: Box<[u8]>,
    rx_start: usize,
    rx_end: usize,
    reqs: VecDeque<RecvReq>,
    req_base: u64,
    slots: VecDeque<Slot>,
    slot_base: u64,
    cur: [u64; MAX_FDS],
    failed: Option<String>,
    peer: Option<SocketAddr>,
    /// `SO_SNDBUF` for the sending side back to a peer on this host.
    pub(super) local_sndbuf: Option<usize>,
    /// Duplex connection: the header read so far from socket 1 (`hdr1_got` bytes).
    hdr1: [u8; HDR],
    hdr1_got: usize,
    /// Socket 1 reached the end of the peer's stream.
    hdr1_end: bool,
    /// Socket 0 reached the end of the peer's stream (duplex: socket 1 may still hold
    /// messages).
    rx_end_seen: bool,
    /// Number (mod 2^16) of the next message to take.
    seq: u16,
    /// The socket that carried the last header.
    last_head: u8,
    /// An encrypted connection's share ([`Crypt`]), and an opener per socket (empty when
    /// the job does not encrypt).
    crypt: Option<Crypt>,
    open: Vec<Opener>,
}

/// `recv` on socket `j`, through its opener on an encrypted connection.
///
/// # Safety
/// `ptr..ptr+len` must be writable memory that nothing else uses during the call.
unsafe fn read(
    open: &mut [Opener],
    fds: &[i32],
    j: usize,
    ptr: *mut u8,
    len: usize,
) -> io::Result<usize> {
    // SAFETY: the caller vouches for `ptr..ptr+len` (this function's contract).
    unsafe {
        match open.get_mut(j) {
            Some(o) => o.recv(fds[j], ptr, len),
            None => recv_raw(fds[j], ptr, len),
        }
    }
}

impl TcpRecvComm {
    pub(super) fn new(
        socks: Vec<Arc<Socket>>,
        back: Vec<Arc<Socket>>,
        layout: Layout,
        crypt: Option<Crypt>,
    ) -> Self {
        let fds = socks.iter().map(|s| s.as_raw_fd()).collect();
        let open = crypt
            .as_ref()
            .map_or_else(Vec::new, |c| c.keys.openers(&c.own));
        let peer = socks
            .first()
            .and_then(|s| s.peer_addr().ok())
            .and_then(|a| a.as_socket());
        TcpRecvComm {
            socks,
            back,
            send_back: None,
            fds,
            layout,
            rx: vec![0u8; RXBUF].into_boxed_slice(),
            rx_start: 0,
            rx_end: 0,
            reqs: VecDeque::with_capacity(MAX_REQUESTS),
            req_base: 0,
            slots: VecDeque::with_capacity(MAX_REQUESTS * 2),
            slot_base: 0,
            cur: [0; MAX_FDS],
            failed: None,
            peer,
            local_sndbuf: None,
            stats: Arc::default(),
            hdr1: [0; HDR],
            hdr1_got: 0,
            hdr1_end: false,
            rx_end_seen: false,
            last_head: 0,
            seq: 0,
            crypt,
            open,
        }
    }

    fn fail(&mut self, e: Error) -> Error {
        self.failed = Some(e.to_string());
        e
    }

    fn eof(&self) -> Error {
        let p = self.peer.map(|p| format!(" from {p}")).unwrap_or_default();
        Error::sys(
            format!("TCP receive{p}: connection closed by the peer (its process exited or closed the communicator)"),
            io::Error::from(io::ErrorKind::UnexpectedEof),
        )
    }

    /// Fill the socket-0 buffer; returns bytes read (0 = would block).
    fn fill_rx(&mut self) -> Result<usize> {
        self.fill_rx_or_end()?.ok_or_else(|| self.eof())
    }

    /// [`TcpRecvComm::fill_rx`], with the end of the peer's stream as `None`.
    fn fill_rx_or_end(&mut self) -> Result<Option<usize>> {
        if self.rx_start == self.rx_end {
            self.rx_start = 0;
            self.rx_end = 0;
        } else if self.rx_end == RXBUF {
            self.rx.copy_within(self.rx_start..self.rx_end, 0);
            self.rx_end -= self.rx_start;
            self.rx_start = 0;
        }
        let free = RXBUF - self.rx_end;
        let ptr = self.rx[self.rx_end..].as_mut_ptr();
        // SAFETY: `ptr..ptr+free` is the free end of this comm's own receive buffer.
        match unsafe { read(&mut self.open, &self.fds, 0, ptr, free) } {
            Ok(0) => Ok(None),
            Ok(n) => {
                self.rx_end += n;
                Ok(Some(n))
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(Some(0)),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(Some(0)),
            Err(e) => Err(io_err("TCP receive", self.peer, e)),
        }
    }

    /// Find the header of the next message: in the buffer of socket 0, or (duplex) read
    /// from socket 1, whichever carries the message numbered `seq`. `Some(socket)` with
    /// the header taken into slot `index`; `None` when it has not arrived.
    fn next_header(&mut self, index: usize) -> Result<Option<usize>> {
        let number = |h: &[u8]| (u64::from_le_bytes(h[0..8].try_into().unwrap()) >> 48) as u16;
        loop {
            let buffered = self.rx_end - self.rx_start >= HDR;
            if self.layout.inline.is_none() || self.fds.len() < 2 {
                if !buffered {
                    if self.fill_rx()? == 0 {
                        return Ok(None);
                    }
                    continue;
                }
                return self.take_buffered(index);
            }
            if buffered && number(&self.rx[self.rx_start..self.rx_start + HDR]) == self.seq {
                return self.take_buffered(index);
            }
            if self.hdr1_got == HDR {
                if number(&self.hdr1) != self.seq && buffered {
                    return Err(Error::Internal(format!(
                        "TCP stream out of sync: message {} due, sockets 0 and 1 hold {} and {}",
                        self.seq,
                        number(&self.rx[self.rx_start..self.rx_start + HDR]),
                        number(&self.hdr1)
                    )));
                }
                if number(&self.hdr1) == self.seq {
                    let h = self.hdr1;
                    self.hdr1_got = 0;
                    self.take_header(index, &h)?;
                    return Ok(Some(1));
                }
            }
            // Read on, the socket of the last message first (a run of large or of small
            // messages then costs no system call on the other): socket 0 into its buffer,
            // socket 1 only up to the end of a header. The end of the peer's stream on one
            // socket is an error only mid-header or once the other has ended too: messages
            // it sent on the other before it left may still be coming.
            let mut moved = false;
            for sock in if self.last_head == 1 { [1, 0] } else { [0, 1] } {
                if sock == 0 && !buffered && !self.rx_end_seen {
                    match self.fill_rx_or_end()? {
                        Some(k) => moved |= k > 0,
                        None if self.rx_end > self.rx_start => return Err(self.eof()),
                        None => self.rx_end_seen = true,
                    }
                }
                if sock == 1 && self.hdr1_got < HDR && !self.hdr1_end {
                    let at = self.hdr1[self.hdr1_got..].as_mut_ptr();
                    // SAFETY: `at..` is the unread rest of this comm's own header buffer.
                    match unsafe { read(&mut self.open, &self.fds, 1, at, HDR - self.hdr1_got) } {
                        Ok(0) if self.hdr1_got == 0 => self.hdr1_end = true,
                        Ok(0) => return Err(self.eof()),
                        Ok(k) => {
                            self.hdr1_got += k;
                            moved = true;
                            if self.hdr1_got == HDR && number(&self.hdr1) == self.seq {
                                break;
                            }
                        }
                        Err(e)
                            if matches!(
                                e.kind(),
                                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                            ) => {}
                        Err(e) => return Err(io_err("TCP receive", self.peer, e)),
                    }
                }
                if moved && sock == 0 && self.rx_end - self.rx_start >= HDR {
                    break;
                }
            }
            if self.rx_end_seen && self.hdr1_end {
                return Err(self.eof());
            }
            if !moved {
                return Ok(None);
            }
        }
    }

    /// Take the header at the start of socket 0's buffer into slot `index`.
    fn take_buffered(&mut self, index: usize) -> Result<Option<usize>> {
        let h: [u8; HDR] = self.rx[self.rx_start..self.rx_start + HDR]
            .try_into()
            .unwrap();
        self.rx_start += HDR;
        self.take_header(index, &h)?;
        Ok(Some(0))
    }

    /// Take header `h` into slot `index` (on a duplex connection the caller has matched its
    /// number with `seq`).
    fn take_header(&mut self, index: usize, h: &[u8; HDR]) -> Result<()> {
        let word = u64::from_le_bytes(h[0..8].try_into().unwrap());
        let len = (word & LEN_MASK) as usize;
        let tag = u32::from_le_bytes(h[8..12].try_into().unwrap());
        let magic = u32::from_le_bytes(h[12..16].try_into().unwrap());
        if magic != MSG_MAGIC {
            return Err(Error::Internal(
                "TCP stream out of sync (bad message magic): the peer speaks another protocol version".into(),
            ));
        }
        self.seq = self.seq.wrapping_add(1);
        let n = self.fds.len();
        let slot = &mut self.slots[index];
        let r = &mut self.reqs[(slot.req - self.req_base) as usize];
        let Some(b) =
            (0..r.n as usize).find(|&b| r.assigned & (1 << b) == 0 && r.bufs[b].tag == tag)
        else {
            return Err(crate::net::unexpected_tag(tag));
        };
        if len > r.bufs[b].len {
            return Err(Error::InvalidUsage(format!(
                "received a {len}-byte message but the posted receive holds only {} bytes (mismatched counts between sender and receiver?)",
                r.bufs[b].len
            )));
        }
        r.assigned |= 1 << b;
        r.sizes[b] = len;
        slot.len = len;
        slot.dst = r.bufs[b].addr;
        slot.known = true;
        slot.parts_left = (0..n)
            .filter(|&j| {
                let (s, e) = self.layout.part(len, j, n);
                e > s || j == 0
            })
            .count() as u8;
        Ok(())
    }

    fn finish_part(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        slot.parts_left -= 1;
        if slot.parts_left == 0 {
            let r = &mut self.reqs[(slot.req - self.req_base) as usize];
            r.left -= 1;
        }
    }

    fn progress(&mut self) -> Result<()> {
        crate::net::refuse_if_failed(&self.failed, "TCP receive comm")?;
        let r = self.progress_inner();
        r.map_err(|e| self.fail(e))
    }

    fn progress_inner(&mut self) -> Result<()> {
        let n = self.fds.len();
        let end = self.slot_base + self.slots.len() as u64;
        // Messages in order: each one's header, then its part on socket 0 (through the buffer
        // for small pieces) or, on a duplex connection, the part that came with the header
        // on socket 1; further parts are read below.
        'sock0: while self.cur[0] < end {
            let index = (self.cur[0] - self.slot_base) as usize;
            if !self.slots[index].known {
                let Some(head) = self.next_header(index)? else {
                    break 'sock0;
                };
                self.slots[index].head = head as u8;
                self.last_head = head as u8;
            }
            if self.slots[index].head == 1 {
                // Socket 0 carries nothing of this message: its empty part is done once
                // (`off[0]` = 1 marks it).
                if self.slots[index].off[0] == 0 {
                    self.slots[index].off[0] = 1;
                    self.finish_part(index);
                }
                let (s, e) = self.layout.part(self.slots[index].len, 1, n);
                while self.slots[index].off[1] < e - s {
                    let slot = &mut self.slots[index];
                    let want = (e - s) - slot.off[1];
                    let dst = slot.dst + s + slot.off[1];
                    // SAFETY: `dst..dst+want` lies in a posted receive buffer, which `irecv`'s
                    // caller keeps valid and unused until the request completes.
                    match unsafe { read(&mut self.open, &self.fds, 1, dst as *mut u8, want) } {
                        Ok(0) => return Err(self.eof()),
                        Ok(k) => slot.off[1] += k,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break 'sock0,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(io_err("TCP receive", self.peer, e)),
                    }
                }
                self.finish_part(index);
                self.cur[0] += 1;
                continue;
            }
            let (s, e) = self.layout.part(self.slots[index].len, 0, n);
            loop {
                let slot = &mut self.slots[index];
                let want = (e - s) - slot.off[0];
                if want == 0 {
                    break;
                }
                let have = self.rx_end - self.rx_start;
                let dst = slot.dst + s + slot.off[0];
                if have > 0 {
                    let k = have.min(want);
                    // SAFETY: `dst..dst+k` lies inside a posted receive buffer (checked
                    // against its capacity in take_header); the irecv contract keeps it valid
                    // and unaliased; the source is our own buffer, which cannot overlap it.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.rx[self.rx_start..].as_ptr(),
                            dst as *mut u8,
                            k,
                        );
                    }
                    self.rx_start += k;
                    slot.off[0] += k;
                } else if want >= RX_DIRECT {
                    // SAFETY: `dst..dst+want` lies in a posted receive buffer, which `irecv`'s
                    // caller keeps valid and unused until the request completes.
                    match unsafe { read(&mut self.open, &self.fds, 0, dst as *mut u8, want) } {
                        Ok(0) => return Err(self.eof()),
                        Ok(k) => slot.off[0] += k,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break 'sock0,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(io_err("TCP receive", self.peer, e)),
                    }
                } else if self.fill_rx()? == 0 {
                    break 'sock0;
                }
            }
            self.finish_part(index);
            self.cur[0] += 1;
        }
        // Sockets 1..n: large parts straight into the destination (on a duplex connection,
        // socket 1's parts come with their headers, above).
        let first = if self.layout.inline.is_some() { 2 } else { 1 };
        for j in first..n {
            while self.cur[j] < end {
                let index = (self.cur[j] - self.slot_base) as usize;
                let slot = &mut self.slots[index];
                if !slot.known {
                    break;
                }
                let (s, e) = self.layout.part(slot.len, j, n);
                if e == s {
                    self.cur[j] += 1;
                    continue;
                }
                let want = (e - s) - slot.off[j];
                if want > 0 {
                    let dst = slot.dst + s + slot.off[j];
                    // SAFETY: `dst..dst+want` lies in a posted receive buffer, which `irecv`'s
                    // caller keeps valid and unused until the request completes.
                    match unsafe { read(&mut self.open, &self.fds, j, dst as *mut u8, want) } {
                        Ok(0) => return Err(self.eof()),
                        Ok(k) => slot.off[j] += k,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) => return Err(io_err("TCP receive", self.peer, e)),
                    }
                }
                if self.slots[index].off[j] == e - s {
                    self.finish_part(index);
                    self.cur[j] += 1;
                } else {
                    break;
                }
            }
        }
        Ok(())
    }
}

impl TcpRecvComm {
    /// The receive comm of a duplex connection's way back (see [`WayBack`]).
    pub(super) fn way_back(w: WayBack) -> Box<dyn RecvComm> {
        let mut comm = TcpRecvComm::new(w.socks, Vec::new(), w.layout, w.crypt);
        comm.stats = w.stats;
        Box::new(comm)
    }
}

impl RecvComm for TcpRecvComm {
    unsafe fn irecv(&mut self, bufs: &[RecvBuf]) -> Result<Option<ReqId>> {
        crate::net::refuse_if_failed(&self.failed, "TCP receive comm")?;
        if bufs.is_empty() || bufs.len() > MAX_RECVS {
            return Err(Error::arg(format!(
                "a grouped receive takes 1 to {MAX_RECVS} buffers, got {}",
                bufs.len()
            )));
        }
        if self.reqs.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        let seq = self.req_base + self.reqs.len() as u64;
        let mut arr = [PostedBuf {
            addr: 0,
            len: 0,
            tag: 0,
        }; MAX_RECVS];
        for (a, b) in arr.iter_mut().zip(bufs) {
            *a = PostedBuf {
                addr: b.ptr as usize,
                len: b.len,
                tag: b.tag,
            };
        }
        self.reqs.push_back(RecvReq {
            bufs: arr,
            n: bufs.len() as u8,
            assigned: 0,
            sizes: [0; MAX_RECVS],
            left: bufs.len() as u8,
            reaped: false,
        });
        for _ in bufs {
            self.slots.push_back(Slot {
                req: seq,
                len: 0,
                dst: 0,
                known: false,
                head: 0,
                off: [0; MAX_FDS],
                parts_left: 0,
            });
        }
        // No progress here: the caller tests right away, and skipping the would-block
        // `recv` saves a system call per message.
        Ok(Some(ReqId(seq as u32)))
    }

    fn test(&mut self, req: ReqId, sizes: &mut [usize]) -> Result<bool> {
        self.progress()?;
        let r = crate::net::pending_request(
            &mut self.reqs,
            self.req_base,
            req,
            |r| r.reaped,
            "receive",
        )?;
        if r.left > 0 {
            return Ok(false);
        }
        for (d, s) in sizes.iter_mut().zip(&r.sizes[..r.n as usize]) {
            *d = *s;
        }
        r.reaped = true;
        while self.reqs.front().is_some_and(|r| r.reaped) {
            let r = self.reqs.pop_front().unwrap();
            self.req_base += 1;
            for _ in 0..r.n {
                self.slots.pop_front();
                self.slot_base += 1;
            }
        }
        for c in &mut self.cur[..self.fds.len()] {
            *c = (*c).max(self.slot_base);
        }
        Ok(true)
    }

    fn poll_fds(&self, out: &mut Vec<PollFd>) {
        let end = self.slot_base + self.slots.len() as u64;
        for (j, fd) in self.fds.iter().enumerate() {
            if self.cur[j] < end {
                out.push(PollFd {
                    fd: *fd,
                    events: libc::POLLIN,
                });
            }
        }
    }

    /// The shared socket and the sockets of the way back written: messages back to the
    /// peer that connected, laid out as it lays out its own.
    fn reverse(&mut self) -> Option<Box<dyn SendComm>> {
        let peer = self.peer?;
        let make = self.send_back.filter(|_| !self.back.is_empty())?;
        let mut socks = vec![Arc::clone(&self.socks[0])];
        socks.append(&mut self.back);
        if let Some(b) = self.local_sndbuf.filter(|_| is_local(peer.ip())) {
            for s in &socks {
                // Best effort: the kernel's autotuned buffer also works, a bit slower.
                let _ = s.set_send_buffer_size(b);
            }
        }
        Some(make(WayBack {
            socks,
            layout: self.layout,
            crypt: self.crypt.as_ref().map(Crypt::reversed),
            stats: Arc::clone(&self.stats),
            peer,
        }))
    }
}

impl Drop for TcpRecvComm {
    fn drop(&mut self) {
        shut(&self.socks, std::net::Shutdown::Read);
        shut(&self.back, std::net::Shutdown::Both);
    }
}
