//! Encrypted sockets (`ROCCL_ENCRYPT`, docs/SECURITY.md): the bytes a socket carries one
//! way become a stream of records, each `len: u32 LE`, `len` bytes of AES-256-GCM
//! ciphertext, a 16-byte tag, with the length as associated data and the record's number
//! as the nonce. Each direction of each socket has its own key, derived from the listener's
//! key, the connection id and the socket's index, so no (key, nonce) pair repeats.
//!
//! The comms keep their framing (headers, parts over sockets) and call [`Sealer::send2`]
//! and [`Opener::recv`] where they would call `send2` and `recv`: a sealer takes at most
//! one record of plaintext per call and reports it taken only once the whole record is in
//! the kernel (until then it answers `WouldBlock`, and the comm, which offers the same bytes
//! again, waits for the socket as before); an opener reads greedily into its buffer, opens
//! whole records in place and copies plaintext out. Buffers are allocated once per socket.

use std::io;

use super::io::{recv_raw, send_raw};
use crate::bootstrap::auth::JobKey;
use crate::bootstrap::seal::{counter_nonce, SealKey, SEAL_TAG};

/// Most plaintext bytes per record.
pub(super) const RECORD: usize = 64 * 1024;
/// Bytes of a record's length field.
const LEN: usize = 4;
/// Bytes of the largest record on the wire.
const WIRE_MAX: usize = LEN + RECORD + SEAL_TAG;

/// The keys of one connection's sockets (see the module's doc).
#[derive(Clone, Copy)]
pub(super) struct ConnKeys {
    key: JobKey,
    /// This side opened the connection.
    dialer: bool,
}

impl ConnKeys {
    /// The keys of connection `id` to the listener whose key is `listener`.
    pub(super) fn new(listener: &JobKey, id: u64, dialer: bool) -> ConnKeys {
        let label = [b"roccl tcp records v1 ".as_slice(), &id.to_le_bytes()].concat();
        ConnKeys {
            key: listener.derive(&label),
            dialer,
        }
    }

    fn key(&self, socket: u16, from_dialer: bool) -> SealKey {
        let label = [
            b"socket ".as_slice(),
            &socket.to_le_bytes(),
            if from_dialer {
                b" from dialer"
            } else {
                b" to dialer"
            },
        ]
        .concat();
        SealKey::new(&self.key.derive(&label))
    }

    /// Sealers for this side's sends on the sockets numbered `sockets`.
    pub(super) fn sealers(&self, sockets: &[u16]) -> Vec<Sealer> {
        sockets
            .iter()
            .map(|&s| Sealer::new(self.key(s, self.dialer)))
            .collect()
    }

    /// Openers for this side's receives on the sockets numbered `sockets`.
    pub(super) fn openers(&self, sockets: &[u16]) -> Vec<Opener> {
        sockets
            .iter()
            .map(|&s| Opener::new(self.key(s, !self.dialer)))
            .collect()
    }
}

/// A comm's share of an encrypted connection: the keys, and the numbers (in the hellos) of
/// the comm's sockets and of those of the way back.
#[derive(Clone)]
pub(super) struct Crypt {
    pub(super) keys: ConnKeys,
    pub(super) own: Vec<u16>,
    pub(super) back: Vec<u16>,
}

impl Crypt {
    /// A comm made of a connection's first `own` sockets, with `back` more for the way back.
    pub(super) fn new(keys: ConnKeys, own: usize, back: usize) -> Crypt {
        Crypt {
            keys,
            own: (0..own as u16).collect(),
            back: (own as u16..(own + back) as u16).collect(),
        }
    }

    /// The reverse comm's share: the shared socket, then the sockets of the way back.
    pub(super) fn reversed(&self) -> Crypt {
        let mut own = vec![self.own[0]];
        own.extend_from_slice(&self.back);
        Crypt {
            keys: self.keys,
            own,
            back: Vec::new(),
        }
    }
}

/// One socket's sending direction: seals and writes records.
pub(super) struct Sealer {
    key: SealKey,
    /// Records sealed so far (the next one's nonce).
    count: u64,
    /// The record being written (empty: none).
    rec: Vec<u8>,
    /// Bytes of `rec` in the kernel.
    sent: usize,
    /// Plaintext bytes `rec` holds.
    plain: usize,
}

impl Sealer {
    fn new(key: SealKey) -> Sealer {
        Sealer {
            key,
            count: 0,
            rec: Vec::with_capacity(WIRE_MAX),
            sent: 0,
            plain: 0,
        }
    }

    /// Send the start of `a` then `b_len` bytes at `b_ptr` as (at most) one record: the
    /// number of plaintext bytes taken, all of whose record is in the kernel; `WouldBlock`
    /// while a record is part-written, after which the caller offers the same bytes again.
    ///
    /// # Safety
    /// `b_ptr..b_ptr+b_len` must be readable memory for the duration of the call (a posted
    /// send buffer).
    pub(super) unsafe fn send2(
        &mut self,
        fd: i32,
        a: &[u8],
        b_ptr: usize,
        b_len: usize,
    ) -> io::Result<usize> {
        if self.rec.is_empty() {
            let from_a = a.len().min(RECORD);
            let from_b = b_len.min(RECORD - from_a);
            if from_a + from_b == 0 {
                return Ok(0);
            }
            self.rec
                .extend_from_slice(&((from_a + from_b) as u32).to_le_bytes());
            self.rec.extend_from_slice(&a[..from_a]);
            if from_b > 0 {
                // SAFETY: the caller guarantees `b_ptr..b_ptr+b_len` is readable for the
                // call (a send buffer that the `isend` contract keeps valid until the request
                // completes, which it cannot before these bytes are reported taken), and
                // `from_b <= b_len`.
                let b = unsafe { std::slice::from_raw_parts(b_ptr as *const u8, from_b) };
                self.rec.extend_from_slice(b);
            }
            let (len, body) = self.rec.split_at_mut(LEN);
            let tag = self.key.seal(counter_nonce(self.count), len, body);
            self.rec.extend_from_slice(&tag);
            self.count += 1;
            self.sent = 0;
            self.plain = from_a + from_b;
        }
        while self.sent < self.rec.len() {
            match send_raw(fd, &self.rec[self.sent..]) {
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.rec.clear();
        Ok(self.plain)
    }
}

/// One socket's receiving direction: reads records, opens them, hands out plaintext.
pub(super) struct Opener {
    key: SealKey,
    /// Records opened so far (the next one's nonce).
    count: u64,
    buf: Box<[u8]>,
    /// Bytes received and not yet used: `buf[lo..hi]`.
    lo: usize,
    hi: usize,
    /// Plaintext of the opened record not yet handed out: `buf[plain..plain_end]`.
    plain: usize,
    plain_end: usize,
    /// Where the opened record ends in `buf`.
    rec_end: usize,
}

impl Opener {
    fn new(key: SealKey) -> Opener {
        Opener {
            key,
            count: 0,
            buf: vec![0u8; 2 * WIRE_MAX].into_boxed_slice(),
            lo: 0,
            hi: 0,
            plain: 0,
            plain_end: 0,
            rec_end: 0,
        }
    }

    /// Like `recv(2)` into `ptr..ptr+len`: up to `len` bytes of plaintext, 0 at the end of
    /// the peer's stream, `WouldBlock` when no whole record has arrived, and `InvalidData`
    /// for a record that does not authenticate.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be writable memory that nothing else uses during the call.
    pub(super) unsafe fn recv(&mut self, fd: i32, ptr: *mut u8, len: usize) -> io::Result<usize> {
        if len == 0 {
            return Ok(0);
        }
        loop {
            if self.plain < self.plain_end {
                let n = len.min(self.plain_end - self.plain);
                // SAFETY: the caller guarantees `ptr..ptr+len` is writable (a local buffer
                // or a posted receive buffer), `n <= len`, and the source is our own buffer.
                unsafe {
                    std::ptr::copy_nonoverlapping(self.buf[self.plain..].as_ptr(), ptr, n);
                }
                self.plain += n;
                if self.plain == self.plain_end {
                    self.lo = self.rec_end;
                }
                return Ok(n);
            }
            if let Some(need) = self.whole_record()? {
                self.open(need)?;
                continue;
            }
            // Read on: room for at least one whole record after `lo`.
            if self.buf.len() - self.lo < WIRE_MAX {
                self.buf.copy_within(self.lo..self.hi, 0);
                self.hi -= self.lo;
                self.lo = 0;
            }
            let room = self.buf.len() - self.hi;
            // SAFETY: the free end of this opener's own record buffer.
            match unsafe { recv_raw(fd, self.buf[self.hi..].as_mut_ptr(), room) } {
                Ok(0) => return Ok(0),
                Ok(n) => self.hi += n,
                Err(e) => return Err(e),
            }
        }
    }

    /// The wire length of the record at `lo` when all of it has arrived.
    fn whole_record(&self) -> io::Result<Option<usize>> {
        let have = self.hi - self.lo;
        if have < LEN {
            return Ok(None);
        }
        let n = u32::from_le_bytes(self.buf[self.lo..self.lo + LEN].try_into().unwrap()) as usize;
        if n == 0 || n > RECORD {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("an encrypted TCP record of {n} bytes (1 to {RECORD} expected): the peer does not encrypt, or the stream is corrupt"),
            ));
        }
        let need = LEN + n + SEAL_TAG;
        Ok((have >= need).then_some(need))
    }

    /// Open the record of `need` bytes at `lo` in place.
    fn open(&mut self, need: usize) -> io::Result<()> {
        let rec = &mut self.buf[self.lo..self.lo + need];
        let (len, rest) = rec.split_at_mut(LEN);
        let (body, tag) = rest.split_at_mut(need - LEN - SEAL_TAG);
        if !self.key.open(counter_nonce(self.count), len, body, tag) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "an encrypted TCP record failed authentication (AES-256-GCM): data corrupted or forged on the way, or a peer with another key",
            ));
        }
        self.count += 1;
        self.plain = self.lo + LEN;
        self.plain_end = self.plain + body.len();
        self.rec_end = self.lo + need;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn pair() -> (
        std::os::unix::net::UnixStream,
        std::os::unix::net::UnixStream,
    ) {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        b.set_nonblocking(true).unwrap();
        (a, b)
    }

    /// [`Sealer::send2`] of `a` then `b`.
    fn send(s: &mut Sealer, fd: i32, a: &[u8], b: &[u8]) -> io::Result<usize> {
        // SAFETY: `b` is a live slice for the whole call.
        unsafe { s.send2(fd, a, b.as_ptr() as usize, b.len()) }
    }

    /// [`Opener::recv`] into the first `len` bytes of `out`.
    fn recv(o: &mut Opener, fd: i32, out: &mut [u8], len: usize) -> io::Result<usize> {
        let len = len.min(out.len());
        // SAFETY: `out[..len]` is a live, exclusively borrowed slice.
        unsafe { o.recv(fd, out.as_mut_ptr(), len) }
    }

    fn keys() -> (ConnKeys, ConnKeys) {
        let l = JobKey::from_secret(&[3; 16], b"listener");
        (ConnKeys::new(&l, 42, true), ConnKeys::new(&l, 42, false))
    }

    /// Send `msg` in pieces of `piece` bytes and receive it in pieces of `take`.
    fn round_trip(msg: &[u8], piece: usize, take: usize) -> Vec<u8> {
        let (a, b) = pair();
        let (dial, listen) = keys();
        let mut s = dial.sealers(&[1]).pop().unwrap();
        let mut o = listen.openers(&[1]).pop().unwrap();
        let mut out = vec![0u8; msg.len()];
        let (mut sent, mut got) = (0, 0);
        while got < msg.len() {
            if sent < msg.len() {
                let end = (sent + piece).min(msg.len());
                let hdr = &msg[sent..(sent + 3).min(end)];
                let rest = &msg[sent + hdr.len()..end];
                match send(&mut s, a.as_raw_fd(), hdr, rest) {
                    Ok(n) => sent += n,
                    Err(e) => assert_eq!(e.kind(), io::ErrorKind::WouldBlock),
                }
            }
            let want = take.min(msg.len() - got);
            match recv(&mut o, b.as_raw_fd(), &mut out[got..], want) {
                Ok(n) => {
                    assert!(n > 0);
                    got += n;
                }
                Err(e) => assert_eq!(e.kind(), io::ErrorKind::WouldBlock),
            }
        }
        out
    }

    #[test]
    fn records_carry_any_split_of_a_stream() {
        let msg: Vec<u8> = (0..600_000u32).map(|i| (i * 31 + i / 7) as u8).collect();
        for (piece, take) in [(1, 1), (100, 7), (RECORD + 5, 4096), (3 * RECORD, 1 << 20)] {
            let n = if piece == 1 { 3000 } else { msg.len() };
            assert_eq!(
                round_trip(&msg[..n], piece, take),
                &msg[..n],
                "{piece} {take}"
            );
        }
    }

    #[test]
    fn the_wire_holds_no_plaintext_and_a_flipped_bit_is_an_error() {
        let (a, b) = pair();
        let (dial, listen) = keys();
        let mut s = dial.sealers(&[0]).pop().unwrap();
        let secret = b"the weights of layer 7 are secret";
        assert_eq!(
            send(&mut s, a.as_raw_fd(), secret, &[]).unwrap(),
            secret.len()
        );
        let mut wire = vec![0u8; 256];
        // SAFETY: `wire` is a live, exclusively borrowed buffer of this length.
        let n = unsafe { recv_raw(b.as_raw_fd(), wire.as_mut_ptr(), wire.len()) }.unwrap();
        assert_eq!(n, LEN + secret.len() + SEAL_TAG);
        assert!(!wire[..n].windows(6).any(|w| w == b"layer "));
        for flip in [0, LEN + 3, n - 1] {
            let (c, d) = pair();
            let mut w = wire[..n].to_vec();
            w[flip] ^= 0x10;
            send_raw(c.as_raw_fd(), &w).unwrap();
            let mut o = listen.openers(&[0]).pop().unwrap();
            let mut out = [0u8; 64];
            let e = recv(&mut o, d.as_raw_fd(), &mut out, 64).unwrap_err();
            assert!(
                matches!(
                    e.kind(),
                    io::ErrorKind::InvalidData | io::ErrorKind::WouldBlock
                ),
                "{flip}: {e}"
            );
        }
        // The record opens only for its own socket and direction.
        for (keys, socket) in [(&listen, 1u16), (&dial, 0)] {
            let (c, d) = pair();
            send_raw(c.as_raw_fd(), &wire[..n]).unwrap();
            let mut o = keys.openers(&[socket]).pop().unwrap();
            let mut out = [0u8; 64];
            let e = recv(&mut o, d.as_raw_fd(), &mut out, 64).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        }
        // A replayed record (the same bytes again) does not open: the nonce moved on.
        let (c, d) = pair();
        send_raw(c.as_raw_fd(), &wire[..n]).unwrap();
        send_raw(c.as_raw_fd(), &wire[..n]).unwrap();
        let mut o = listen.openers(&[0]).pop().unwrap();
        let mut out = [0u8; 64];
        assert_eq!(
            recv(&mut o, d.as_raw_fd(), &mut out, 64).unwrap(),
            secret.len()
        );
        assert_eq!(&out[..secret.len()], secret);
        let e = recv(&mut o, d.as_raw_fd(), &mut out, 64).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    }
}
