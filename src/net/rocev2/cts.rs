//! The clear-to-send FIFO and the credit protocol, apart from any provider: the layout of
//! an entry, the seqlock read that never accepts an entry torn by a write in progress, the
//! sender's walk over the FIFO ([`CtsReader`]: which entry a message goes to, and the
//! credits every entry brings) and the receiver's stamping of the entries it writes
//! ([`CtsWriter`]: sequence numbers, credits, and when credits are worth an entry of their
//! own).
//!
//! The sender owns [`CTS_SLOTS`] entries registered for remote write; the receiver
//! RDMA-writes entry `seq` into slot `seq % CTS_SLOTS`. Sequence numbers count up from 1
//! and skip 0 when they wrap (0 marks a slot never written). Every entry carries the
//! receiver's credits: how many of its receive work requests it has posted again so far
//! (wrapping), so the sender never has more messages unconsumed than the receiver has
//! receive work requests.

use super::FIFO;
use crate::error::{Error, Result};
use crate::net::MAX_RECVS;

/// Clear-to-send slots in the sender's FIFO: twice the requests in flight, because the
/// receiver also writes credit-only entries (see [`super::eager::EagerCfg`]) and never
/// reuses the slot of a receive still waiting for data.
pub(super) const CTS_SLOTS: usize = 2 * FIFO;

/// One buffer of a clear-to-send slot.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub(super) struct CtsElem {
    pub(super) addr: u64,
    pub(super) size: u32,
    pub(super) rkey: u32,
    pub(super) tag: u32,
    pub(super) _pad: u32,
}

/// A clear-to-send slot; `seq` is written at both ends so a torn read is detected.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, bytemuck::Pod, bytemuck::Zeroable)]
pub(super) struct Cts {
    /// Sequence number, the start marker.
    pub(super) seq: u32,
    /// Buffers of the receive it describes (0: credits only).
    pub(super) n: u32,
    pub(super) elems: [CtsElem; MAX_RECVS],
    /// Receive work requests the receiver has posted again so far (wrapping): the sender's
    /// credit, see [`super::eager::EagerCfg`].
    pub(super) credits: u32,
    /// Number (wrapping) of the first message that belongs to this receive: the sender's
    /// messages fill the receives' buffers in order.
    pub(super) first: u32,
    /// [`CTS_EAGER_ONLY`] or 0.
    pub(super) flags: u32,
    /// Sequence number again, the end marker.
    pub(super) seq_end: u32,
}

pub(super) const CTS_BYTES: usize = std::mem::size_of::<Cts>();

/// Flag of a clear-to-send entry that describes a receive whose buffers take eager messages
/// only (no addresses, no keys): written when such a receive has waited
/// [`super::recv::ANNOUNCE_AFTER`] for its data, so that a sender holding a larger message for it (which
/// waits for a clear-to-send that never comes) learns the sizes and fails at once instead of
/// at `ROCCL_TIMEOUT`.
pub(super) const CTS_EAGER_ONLY: u32 = 1;

/// Offset of [`Cts::seq_end`], the last field.
const CTS_END: usize = CTS_BYTES - 4;

/// Pieces of registered memory to copy in order: (address, where the bytes go).
pub(super) type Pieces<'a, 'b> = &'a mut [(u64, &'b mut [u8])];

/// Copy the clear-to-send entry at address `at`, which the peer may be writing meanwhile (an RDMA
/// write, placed by the provider or the NIC from its first byte to its last), through `read`
/// (the provider's `read_registered_in_order`: one call, one lock of the userspace engine,
/// per entry). A seqlock read, as NCCL's net_ib reads its FIFO: the end marker, a fence, the
/// body, a fence, the start marker (`read` copies the pieces in the order given, with the
/// fences between them). The copy is whole when both markers match: the end marker says the
/// body before it was written; a start marker still equal to it after the body says no newer
/// write of the slot began meanwhile (front to back instead, a body read while the writer
/// passes through it looks whole once the writer has written the end marker too).
pub(super) fn read_cts(read: impl Fn(Pieces<'_, '_>), at: u64) -> Cts {
    let mut cts = Cts::default();
    let b = bytemuck::bytes_of_mut(&mut cts);
    let (start, rest) = b.split_at_mut(4);
    let (body, end) = rest.split_at_mut(CTS_END - 4);
    read(&mut [(at + CTS_END as u64, end), (at + 4, body), (at, start)]);
    cts
}

/// Tags remembered per send comm (a grouped receive spans at most MAX_RECVS messages).
pub(super) const TAG_RING: usize = 64;

/// `a - b` as a signed distance between wrapping counters.
pub(super) fn dist(a: u32, b: u32) -> i32 {
    a.wrapping_sub(b) as i32
}

/// The sender's side of the protocol: its walk over the FIFO (the entry of the receive each
/// message goes to), the receiver's credits as its entries bring them, and the tags of the
/// last messages sent (to match a message to a buffer of an entry as the receiver does).
///
/// The methods that take `read` and `fifo` copy entries of the FIFO at address `fifo`
/// through `read` (the provider's `read_registered_in_order`, see [`read_cts`]), and only
/// inside its [`CTS_SLOTS`] entries.
pub(super) struct CtsReader {
    /// Sequence number of the oldest clear-to-send slot that may still be needed.
    seq: u32,
    /// The receiver's receive work requests (credits when nothing is consumed).
    slots: u32,
    /// Messages posted so far (wrapping): the number of the next message.
    sent: u32,
    /// Tags of the last messages, by message number modulo the ring's size.
    tags: [u32; TAG_RING],
    /// Receive work requests the receiver reposted so far (wrapping), from its clear-to-send.
    credits: u32,
}

impl CtsReader {
    /// Before the first entry, for a receiver that posts `slots` receive work requests.
    pub(super) fn new(slots: u32) -> CtsReader {
        CtsReader {
            seq: 1,
            slots,
            sent: 0,
            tags: [0; TAG_RING],
            credits: 0,
        }
    }

    /// The receiver's receive work requests.
    pub(super) fn slots(&self) -> u32 {
        self.slots
    }

    /// Number (wrapping) of the next message.
    pub(super) fn next_message(&self) -> u32 {
        self.sent
    }

    /// Message [`CtsReader::next_message`], with `tag`, was posted.
    pub(super) fn posted(&mut self, tag: u32) {
        self.tags[self.sent as usize % TAG_RING] = tag;
        self.sent = self.sent.wrapping_add(1);
    }

    /// Address of the FIFO slot of sequence number `seq` (the peer writes it: no reference
    /// to it is made).
    fn slot_addr(fifo: u64, seq: u32) -> u64 {
        fifo + ((seq as usize % CTS_SLOTS) * CTS_BYTES) as u64
    }

    /// Whether the receiver has a receive work request for one more message.
    pub(super) fn has_credit(&self) -> bool {
        self.sent.wrapping_sub(self.credits) < self.slots
    }

    /// The clear-to-send entry of the receive that message `m` belongs to, once written,
    /// taking the credits of every entry read on the way. Entries of receives whose messages
    /// all went out already (eagerly) are passed over; the receiver may even have reused
    /// their slots (it cannot reuse the slot of a receive still waiting for data: it keeps
    /// at most FIFO receives unfinished).
    pub(super) fn cts_for(
        &mut self,
        read: impl Fn(Pieces<'_, '_>),
        fifo: u64,
        m: u32,
    ) -> Option<Cts> {
        loop {
            let slot = Self::slot_addr(fifo, self.seq);
            // The provider writes the slot (remote RDMA) possibly from another thread: copy
            // it through the provider, and trust it only when the sequence number at both
            // ends matches (a slot still being written is retried on the next poll).
            let cts = read_cts(&read, slot);
            if cts.seq != cts.seq_end {
                return None;
            }
            if cts.seq != self.seq {
                if dist(cts.seq, self.seq) > 0 {
                    self.seq = self.seq.wrapping_add(1).max(1); // reused: long done
                    continue;
                }
                return None; // not written yet
            }
            if dist(cts.credits, self.credits) > 0 {
                self.credits = cts.credits;
            }
            if cts.n == 0 || dist(m, cts.first) >= cts.n as i32 {
                // Credits only, or a receive whose messages all went out.
                self.seq = self.seq.wrapping_add(1).max(1);
                continue;
            }
            return Some(cts);
        }
    }

    /// Take the credits of every entry written so far, without consuming any: the freshest
    /// may sit behind the entry of a receive that later messages still need.
    pub(super) fn refresh_credits(&mut self, read: impl Fn(Pieces<'_, '_>), fifo: u64) {
        let mut seq = self.seq;
        for _ in 0..CTS_SLOTS {
            let slot = Self::slot_addr(fifo, seq);
            let cts = read_cts(&read, slot);
            if cts.seq != cts.seq_end || dist(cts.seq, seq) < 0 {
                return; // not written yet (or being written)
            }
            if dist(cts.credits, self.credits) > 0 {
                self.credits = cts.credits;
            }
            seq = cts.seq.wrapping_add(1).max(1);
        }
    }

    /// Index of the buffer of `cts` that message `m` (tag `tag`, `len` bytes) fills: as the
    /// receiver matches, the first buffer with that tag not taken by an earlier message of
    /// the same receive.
    pub(super) fn buffer_for(&self, cts: &Cts, m: u32, tag: u32, len: usize) -> Result<usize> {
        let n = (cts.n as usize).min(MAX_RECVS);
        let pick =
            |used: u32, t: u32| (0..n).find(|&e| used & (1 << e) == 0 && cts.elems[e].tag == t);
        let mut used = 0u32;
        let mut k = cts.first;
        while k != m {
            if let Some(e) = pick(used, self.tags[k as usize % TAG_RING]) {
                used |= 1 << e;
            }
            k = k.wrapping_add(1);
        }
        let Some(e) = pick(used, tag) else {
            // The receiver's call is what its first buffer not yet taken says.
            let theirs = (0..n)
                .find(|&e| used & (1 << e) == 0)
                .map_or(0, |e| cts.elems[e].tag);
            return Err(crate::net::unexpected_tag(theirs));
        };
        let size = cts.elems[e].size as usize;
        if len > size {
            return Err(Error::InvalidUsage(format!(
                "sent {len} bytes but the receiver's buffer holds only {size} bytes (mismatched counts between sender and receiver?)"
            )));
        }
        Ok(e)
    }
}

/// The receiver's side of the protocol: the sequence number of the next entry it writes
/// into the sender's FIFO, and its credits (receive work requests posted again), reported
/// in every entry.
pub(super) struct CtsWriter {
    /// Sequence number of the next entry.
    seq: u32,
    /// Receive work requests posted again so far (wrapping).
    credits: u32,
    /// Credits last sent to the sender.
    reported: u32,
    /// Receive work requests this side keeps posted.
    slots: u32,
}

impl CtsWriter {
    /// Before the first entry, for a receiver that keeps `slots` receive work requests
    /// posted.
    pub(super) fn new(slots: u32) -> CtsWriter {
        CtsWriter {
            seq: 1,
            credits: 0,
            reported: 0,
            slots,
        }
    }

    /// One more receive work request was posted again.
    pub(super) fn reposted(&mut self) {
        self.credits = self.credits.wrapping_add(1);
    }

    /// `cts` made the next entry (our sequence number at both ends, our credits, which count
    /// as reported from now on), and the FIFO slot it goes to; [`CtsWriter::written`] once
    /// it is posted.
    pub(super) fn stamp(&mut self, mut cts: Cts) -> (usize, Cts) {
        cts.seq = self.seq;
        cts.seq_end = self.seq;
        cts.credits = self.credits;
        self.reported = self.credits;
        ((self.seq as usize) % CTS_SLOTS, cts)
    }

    /// The entry stamped last was posted: the next one takes the next sequence number.
    pub(super) fn written(&mut self) {
        self.seq = self.seq.wrapping_add(1).max(1);
    }

    /// Whether the credits not yet reported are worth an entry of their own: once a quarter
    /// of the receive work requests piled up (receives with a clear-to-send carry credits
    /// anyway; eager-only ones do not).
    pub(super) fn credits_due(&self) -> bool {
        self.credits.wrapping_sub(self.reported) >= self.slots / 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    /// Where the test FIFOs pretend to live: reads are mapped onto a `Vec<Cts>`.
    const BASE: u64 = 0x7f00_0000_1000;

    /// A sender's FIFO in plain memory, written by a test as the receiver's RDMA writes
    /// would write it, and read through [`Fifo::read`], which fails the test on a read
    /// outside the FIFO.
    struct Fifo(Vec<Cts>);

    impl Fifo {
        fn new() -> Fifo {
            Fifo(vec![Cts::default(); CTS_SLOTS])
        }

        /// The receiver's next entry, as it lands (whole).
        fn land(&mut self, writer: &mut CtsWriter, cts: Cts) -> (usize, Cts) {
            let (slot, cts) = writer.stamp(cts);
            self.0[slot] = cts;
            writer.written();
            (slot, cts)
        }

        fn read(&self) -> impl Fn(Pieces<'_, '_>) + '_ {
            in_order(move |at: u64, out: &mut [u8]| {
                let bytes: &[u8] = bytemuck::cast_slice(&self.0);
                let off = at.checked_sub(BASE).expect("read below the FIFO") as usize;
                assert!(
                    off + out.len() <= bytes.len(),
                    "read of {} bytes at offset {off}, past the FIFO's {}",
                    out.len(),
                    bytes.len()
                );
                out.copy_from_slice(&bytes[off..off + out.len()]);
            })
        }
    }

    /// A reader of pieces, as the providers' `read_registered_in_order`, from a reader of
    /// one piece: each piece in order, a fence between.
    fn in_order(read: impl Fn(u64, &mut [u8])) -> impl Fn(Pieces<'_, '_>) {
        move |pieces: Pieces<'_, '_>| {
            for (i, (at, out)) in pieces.iter_mut().enumerate() {
                if i > 0 {
                    std::sync::atomic::fence(Ordering::Acquire);
                }
                read(*at, out);
            }
        }
    }

    /// An entry describing a receive of `n` buffers (tags 10, 11, …) for messages from
    /// `first` on.
    fn receive(n: u32, first: u32) -> Cts {
        let mut cts = Cts {
            n,
            first,
            ..Cts::default()
        };
        for (i, e) in cts.elems.iter_mut().take(n as usize).enumerate() {
            *e = CtsElem {
                addr: 0x1000 * (i as u64 + 1),
                size: 4096,
                rkey: 7,
                tag: 10 + i as u32,
                _pad: 0,
            };
        }
        cts
    }

    #[test]
    fn an_entry_written_is_read_back_whole_from_its_slot() {
        let mut fifo = Fifo::new();
        let (mut writer, mut reader) = (CtsWriter::new(64), CtsReader::new(64));
        // Not written yet: nothing to take.
        assert!(reader.cts_for(fifo.read(), BASE, 0).is_none());
        for _ in 0..3 {
            writer.reposted();
        }
        let (slot, sent) = fifo.land(&mut writer, receive(2, 0));
        assert_eq!((slot, sent.seq, sent.seq_end, sent.credits), (1, 1, 1, 3));
        let got = reader
            .cts_for(fifo.read(), BASE, 0)
            .expect("the entry was written");
        assert_eq!(bytemuck::bytes_of(&got), bytemuck::bytes_of(&sent));
        assert_eq!(reader.credits, 3, "the entry's credits are taken");
        // Message 1 belongs to the same receive: the same entry, not consumed by message 0.
        let again = reader.cts_for(fifo.read(), BASE, 1).expect("same receive");
        assert_eq!(again.seq, 1);
        // The next receive's entry goes to the next slot, with the next sequence number.
        let (slot, next) = fifo.land(&mut writer, receive(1, 2));
        assert_eq!((slot, next.seq), (2, 2));
        let got = reader
            .cts_for(fifo.read(), BASE, 2)
            .expect("the next entry");
        assert_eq!(bytemuck::bytes_of(&got), bytemuck::bytes_of(&next));
    }

    #[test]
    fn an_entry_whose_markers_differ_is_not_taken_nor_its_credits() {
        let mut fifo = Fifo::new();
        let mut reader = CtsReader::new(64);
        let mut cts = receive(1, 0);
        cts.seq = 1;
        cts.credits = 9;
        // Start marker written, end marker not yet: an RDMA write in progress.
        fifo.0[1] = cts;
        assert!(reader.cts_for(fifo.read(), BASE, 0).is_none());
        reader.refresh_credits(fifo.read(), BASE);
        assert_eq!((reader.seq, reader.credits), (1, 0));
        // The end marker lands: now it is whole.
        fifo.0[1].seq_end = 1;
        assert!(reader.cts_for(fifo.read(), BASE, 0).is_some());
        assert_eq!(reader.credits, 9);
    }

    /// The seqlock read against a writer that gets anywhere between the three reads it
    /// makes: an entry being rewritten front to back (start marker, body, end marker, as an
    /// RDMA write is placed), its writer having written any number of words before each
    /// read. Whatever the interleaving, an entry accepted (both markers equal) is exactly
    /// the old or exactly the new one.
    #[test]
    fn a_torn_read_is_never_accepted_wherever_the_writer_is() {
        let old = {
            let mut c = receive(MAX_RECVS as u32, 100);
            (c.seq, c.seq_end, c.credits) = (5, 5, 50);
            c
        };
        let new = {
            let mut c = receive(3, 200);
            (c.seq, c.seq_end, c.credits, c.flags) =
                (5 + CTS_SLOTS as u32, 5 + CTS_SLOTS as u32, 60, 1);
            for e in &mut c.elems {
                e.addr = !e.addr;
                e.rkey = 99;
            }
            c
        };
        let (old_b, new_b) = (bytemuck::bytes_of(&old), bytemuck::bytes_of(&new));
        let words = CTS_BYTES / 4;
        let mut accepted = [0u32; 2];
        for before1 in 0..=words {
            for before2 in before1..=words {
                for before3 in before2..=words {
                    let progress = [before1, before2, before3];
                    let calls = Cell::new(0usize);
                    // Slot memory as the writer left it before read number `calls`.
                    let read = |at: u64, out: &mut [u8]| {
                        let done = progress[calls.get().min(2)] * 4;
                        calls.set(calls.get() + 1);
                        let off = (at - BASE) as usize;
                        for (i, o) in out.iter_mut().enumerate() {
                            let k = off + i;
                            *o = if k < done { new_b[k] } else { old_b[k] };
                        }
                    };
                    let got = read_cts(in_order(read), BASE);
                    assert_eq!(calls.get(), 3);
                    if got.seq != got.seq_end {
                        continue; // refused: retried on the next poll
                    }
                    let got_b = bytemuck::bytes_of(&got);
                    if got_b == old_b {
                        accepted[0] += 1;
                    } else if got_b == new_b {
                        accepted[1] += 1;
                    } else {
                        panic!(
                            "a torn entry was accepted (writer at {progress:?} words of {words})"
                        );
                    }
                }
            }
        }
        assert!(accepted[0] > 0 && accepted[1] > 0, "{accepted:?}");
    }

    /// The clear-to-send FIFO read against a writer that rewrites one slot over and over,
    /// as an RDMA write lands: start marker first, the body's words in a random order, the
    /// end marker last (each phase ordered by a fence, as the NIC's in-order placement
    /// does; each aligned 4-byte word is written whole, as a NIC's DMA writes it, and read
    /// whole, as the providers' `read_registered` reads it). Every field of entry `k` is
    /// derived from `k`, so an entry that mixes two writes is seen; no such entry may ever
    /// be accepted (both markers equal). With markers written or read byte by byte, a reader
    /// that fell 255 entries behind could read a start marker half of entry k+255, half of
    /// k+256, equal to the k it read at the end: seen once in 5.3 million reads under load.
    #[test]
    fn a_clear_to_send_entry_being_written_is_never_accepted_torn() {
        use std::sync::atomic::{fence, AtomicBool, AtomicU32};
        const WORDS: usize = CTS_BYTES / 4;
        let mem: Arc<Vec<AtomicU32>> = Arc::new((0..WORDS).map(|_| AtomicU32::new(0)).collect());
        let base = mem.as_ptr() as u64;
        let entry = |k: u32| {
            let mut c = Cts {
                seq: k,
                n: k,
                credits: k.wrapping_mul(3),
                first: k.wrapping_mul(5),
                flags: k,
                seq_end: k,
                ..Cts::default()
            };
            for (i, e) in c.elems.iter_mut().enumerate() {
                *e = CtsElem {
                    addr: (k as u64) << 20 | i as u64,
                    size: k ^ i as u32,
                    rkey: !k,
                    tag: k.wrapping_add(i as u32),
                    _pad: k,
                };
            }
            c
        };
        let word = |b: &[u8], i: usize| u32::from_ne_bytes(b[i * 4..i * 4 + 4].try_into().unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (mem, stop) = (Arc::clone(&mem), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut rng = 0x2545_f491_4f6c_dd1du64;
                let mut order: Vec<usize> = (1..WORDS - 1).collect();
                for k in 1..=200_000u32 {
                    let c = entry(k);
                    let b = bytemuck::bytes_of(&c);
                    mem[0].store(word(b, 0), Ordering::Relaxed);
                    fence(Ordering::Release);
                    for i in (1..order.len()).rev() {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        order.swap(i, rng as usize % (i + 1));
                    }
                    for &i in &order {
                        mem[i].store(word(b, i), Ordering::Relaxed);
                    }
                    fence(Ordering::Release);
                    mem[WORDS - 1].store(word(b, WORDS - 1), Ordering::Relaxed);
                    // The entry stays a while (a real slot is rewritten only every 64
                    // entries), so that reads meet both written and half-written entries.
                    for _ in 0..rng % 256 {
                        std::hint::spin_loop();
                    }
                }
                stop.store(true, Ordering::Relaxed);
            })
        };
        let read = |at: u64, out: &mut [u8]| {
            let off = (at - base) as usize;
            assert!(off % 4 == 0 && out.len() % 4 == 0, "pieces are whole words");
            for (i, o) in out.chunks_exact_mut(4).enumerate() {
                o.copy_from_slice(&mem[off / 4 + i].load(Ordering::Relaxed).to_ne_bytes());
            }
        };
        let (mut accepted, mut torn) = (0u64, 0u64);
        while mem[WORDS - 1].load(Ordering::Relaxed) == 0 {
            std::thread::yield_now(); // the writer's first entry
        }
        let mut reads = 0u64;
        while !stop.load(Ordering::Relaxed) {
            reads += 1;
            let c = read_cts(in_order(&read), base);
            if c.seq == c.seq_end && c.seq != 0 {
                accepted += 1;
                if bytemuck::bytes_of(&c) != bytemuck::bytes_of(&entry(c.seq)) {
                    torn += 1;
                }
            }
        }
        writer.join().unwrap();
        assert!(accepted > 0, "no entry was accepted in {reads} reads");
        assert_eq!(
            torn, 0,
            "{torn} torn entries of {accepted} accepted in {reads} reads"
        );
    }

    #[test]
    fn credits_are_reported_once_a_quarter_of_the_receive_requests_piled_up() {
        let mut fifo = Fifo::new();
        let (mut writer, mut reader) = (CtsWriter::new(64), CtsReader::new(64));
        assert!(!writer.credits_due());
        for _ in 0..15 {
            writer.reposted();
        }
        assert!(!writer.credits_due(), "15 of 64 is less than a quarter");
        writer.reposted();
        assert!(writer.credits_due(), "16 of 64 is a quarter");
        // A credit-only entry reports them; a receive's entry would as well.
        fifo.land(&mut writer, Cts::default());
        assert!(!writer.credits_due(), "reported");
        reader.refresh_credits(fifo.read(), BASE);
        assert_eq!(reader.credits, 16);
        for _ in 0..20 {
            writer.reposted();
        }
        fifo.land(&mut writer, receive(1, 0));
        assert!(
            !writer.credits_due(),
            "a receive's entry reports credits too"
        );
        // Taking the receive's entry passes over the credit-only one, taking both credits.
        let got = reader
            .cts_for(fifo.read(), BASE, 0)
            .expect("the receive's entry");
        assert_eq!((got.seq, reader.credits), (2, 36));
        // Fewer receive work requests: a quarter of 8.
        let mut small = CtsWriter::new(8);
        small.reposted();
        assert!(!small.credits_due());
        small.reposted();
        assert!(small.credits_due());
    }

    #[test]
    fn the_sender_has_a_credit_per_receive_request_not_yet_consumed() {
        let mut fifo = Fifo::new();
        let (mut writer, mut reader) = (CtsWriter::new(64), CtsReader::new(64));
        for k in 0..64 {
            assert!(reader.has_credit(), "message {k} of 64");
            reader.posted(1);
        }
        assert!(!reader.has_credit(), "all 64 receive requests may be taken");
        // The receiver consumed and posted again 2 of them: 2 more messages.
        writer.reposted();
        writer.reposted();
        fifo.land(&mut writer, Cts::default());
        assert!(!reader.has_credit(), "not yet read");
        reader.refresh_credits(fifo.read(), BASE);
        assert!(reader.has_credit());
        reader.posted(1);
        assert!(reader.has_credit());
        reader.posted(1);
        assert!(!reader.has_credit());
        // Credits never go back: an older entry read later brings none.
        let mut stale = fifo.0[1];
        stale.credits = 1;
        fifo.0[2] = Cts {
            seq: 2,
            seq_end: 2,
            ..stale
        };
        reader.refresh_credits(fifo.read(), BASE);
        assert_eq!(reader.credits, 2);
    }

    #[test]
    fn sequence_numbers_and_credits_wrap_around() {
        let mut fifo = Fifo::new();
        let (mut writer, mut reader) = (CtsWriter::new(64), CtsReader::new(64));
        // Both sides near the end of the sequence numbers and of the counters.
        writer.seq = u32::MAX;
        reader.seq = u32::MAX;
        writer.credits = u32::MAX - 1;
        writer.reported = u32::MAX - 1;
        reader.credits = u32::MAX - 1;
        reader.sent = (u32::MAX - 1).wrapping_add(64);
        assert!(!reader.has_credit());
        for _ in 0..3 {
            writer.reposted(); // wraps to 1
        }
        let (slot, first) = fifo.land(&mut writer, Cts::default());
        assert_eq!(
            (slot, first.seq, first.credits),
            (u32::MAX as usize % CTS_SLOTS, u32::MAX, 1)
        );
        assert_eq!(writer.seq, 1, "0 is skipped: it marks a slot never written");
        let m = reader.next_message();
        let (slot, second) = fifo.land(&mut writer, receive(1, m));
        assert_eq!((slot, second.seq), (1, 1));
        let got = reader
            .cts_for(fifo.read(), BASE, m)
            .expect("the entry after the wrap");
        assert_eq!(got.seq, 1);
        assert_eq!(reader.seq, 1, "passed over the credit-only entry and 0");
        assert_eq!(reader.credits, 1, "credits wrapped past 0 are newer");
        assert!(
            reader.has_credit(),
            "3 more receive requests across the wrap"
        );
        // The same credits taken without consuming an entry.
        let mut other = CtsReader::new(64);
        (other.seq, other.credits) = (u32::MAX, u32::MAX - 1);
        other.refresh_credits(fifo.read(), BASE);
        assert_eq!(other.credits, 1, "credits wrapped past 0 are newer");
        for _ in 0..3 {
            assert!(reader.has_credit());
            reader.posted(10);
        }
        assert!(!reader.has_credit());
        // A grouped receive whose messages straddle the wrap of the message numbers.
        let mut group = receive(2, u32::MAX);
        group.elems[1].tag = 10;
        let mut sender = CtsReader::new(64);
        sender.sent = u32::MAX;
        sender.posted(10); // message u32::MAX
        assert_eq!(sender.buffer_for(&group, u32::MAX, 10, 1).unwrap(), 0);
        assert_eq!(
            sender.buffer_for(&group, 0, 10, 1).unwrap(),
            1,
            "message 0 after the wrap takes the second buffer"
        );
    }

    #[test]
    fn entries_of_receives_already_served_and_slots_reused_are_passed_over() {
        let mut fifo = Fifo::new();
        let (mut writer, mut reader) = (CtsWriter::new(64), CtsReader::new(64));
        // Receive 1 takes messages 0 and 1 (both sent eagerly already), receive 2 message 2.
        fifo.land(&mut writer, receive(2, 0));
        fifo.land(&mut writer, receive(1, 2));
        reader.posted(10);
        reader.posted(11);
        let got = reader.cts_for(fifo.read(), BASE, 2).expect("receive 2");
        assert_eq!((got.seq, got.first), (2, 2));
        // The receiver went on, lapping slot 3 before the sender looked: the sender at
        // sequence number 3 finds entry 3 + CTS_SLOTS there and moves on to the next slot.
        let mut reader = CtsReader::new(64);
        reader.seq = 3;
        let mut lapped = receive(1, 0);
        (lapped.seq, lapped.seq_end) = (3 + CTS_SLOTS as u32, 3 + CTS_SLOTS as u32);
        fifo.0[3] = lapped;
        let mut next = receive(1, 5);
        (next.seq, next.seq_end) = (4, 4);
        fifo.0[4] = next;
        let got = reader.cts_for(fifo.read(), BASE, 5).expect("entry 4");
        assert_eq!(got.seq, 4);
    }

    #[test]
    fn a_message_fills_the_first_buffer_with_its_tag_not_taken_before() {
        let mut reader = CtsReader::new(64);
        let mut cts = receive(3, 0);
        cts.elems[2].tag = 10; // tags 10, 11, 10
        cts.elems[1].size = 100;
        assert_eq!(reader.buffer_for(&cts, 0, 10, 4096).unwrap(), 0);
        reader.posted(10);
        assert_eq!(
            reader.buffer_for(&cts, 1, 10, 4096).unwrap(),
            2,
            "buffer 0 is taken"
        );
        reader.posted(10);
        let e = reader.buffer_for(&cts, 2, 11, 101).unwrap_err().to_string();
        assert!(
            e.contains("sent 101 bytes") && e.contains("holds only 100"),
            "{e}"
        );
        let e = reader.buffer_for(&cts, 2, 12, 1).unwrap_err();
        assert!(
            matches!(e, crate::Error::TagMismatch { theirs: 11 }),
            "the receiver's call is its first buffer not taken: {e}"
        );
    }
}
