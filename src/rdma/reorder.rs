//! The responder's store of out-of-order request packets (a userspace-engine extension).
//!
//! An IB responder drops every packet after a gap and NAKs the gap, so the requester must
//! resend everything from there (go-back-N). The userspace engine's responder instead keeps
//! the packets that arrive within [`SLOTS`] PSNs past the one it expects; when the missing
//! packet comes, it processes the kept ones in order as if they had just arrived. The wire
//! does not change: the NAK is the IBTA sequence-error NAK for the expected PSN, and a
//! requester doing go-back-N still works (its resends are duplicates the responder
//! acknowledges). A requester that knows its peer keeps packets (`QpAttr::selective`)
//! resends only the NAKed packet.

use super::wire::{Bth, Packet, Reth};

/// PSNs past the expected one whose packets are kept (the requester's window).
pub const SLOTS: u32 = 256;

#[derive(Default)]
struct Slot {
    used: bool,
    psn: u32,
    bth: Option<Bth>,
    reth: Option<Reth>,
    imm: Option<u32>,
    len: usize,
    data: Vec<u8>,
}

/// A kept packet's headers; its payload is in the buffer [`Reorder::take`] returns.
#[derive(Clone, Copy)]
pub struct Kept {
    /// Base transport header.
    pub bth: Bth,
    /// RDMA extended transport header.
    pub reth: Option<Reth>,
    /// Immediate data.
    pub imm: Option<u32>,
    /// Payload length.
    pub len: usize,
}

impl Kept {
    /// The packet, with its payload in `data`.
    pub fn packet<'a>(&self, data: &'a [u8]) -> Packet<'a> {
        Packet {
            bth: self.bth,
            reth: self.reth,
            imm: self.imm,
            aeth: None,
            payload: &data[..self.len],
        }
    }
}

/// Out-of-order packets of one QP, by PSN modulo [`SLOTS`]. Slots and their buffers are
/// allocated at first use and reused, so the data path does not allocate once warm.
#[derive(Default)]
pub struct Reorder {
    slots: Vec<Slot>,
    /// Highest PSN kept (valid while `any`).
    hi: u32,
    any: bool,
}

fn diff(a: u32, b: u32) -> i32 {
    (((a.wrapping_sub(b)) & 0x00ff_ffff) << 8) as i32 >> 8
}

impl Reorder {
    /// Keep `pkt` (PSN past `epsn` by 1..SLOTS); false if it was kept already or is too far.
    /// Whether packet `psn` is kept already (a resend of it is a duplicate).
    pub fn holds(&self, psn: u32) -> bool {
        self.slots
            .get((psn % SLOTS) as usize)
            .is_some_and(|s| s.used && s.psn == psn)
    }

    pub fn store(&mut self, epsn: u32, pkt: &Packet) -> bool {
        let psn = pkt.bth.psn;
        let d = diff(psn, epsn);
        if d <= 0 || d >= SLOTS as i32 {
            return false;
        }
        if self.slots.is_empty() {
            self.slots.resize_with(SLOTS as usize, Slot::default);
        }
        let s = &mut self.slots[(psn % SLOTS) as usize];
        if s.used && s.psn == psn {
            return false; // a duplicate of a kept packet
        }
        s.used = true;
        s.psn = psn;
        s.bth = Some(pkt.bth);
        s.reth = pkt.reth;
        s.imm = pkt.imm;
        s.len = pkt.payload.len();
        s.data.clear();
        s.data.extend_from_slice(pkt.payload);
        if !self.any || diff(psn, self.hi) > 0 {
            self.hi = psn;
        }
        self.any = true;
        true
    }

    /// Take the kept packet with PSN `psn`, if any: its headers and its payload buffer
    /// (hand the buffer back with [`Reorder::give_back`]).
    pub fn take(&mut self, psn: u32) -> Option<(Kept, Vec<u8>)> {
        let s = self.slots.get_mut((psn % SLOTS) as usize)?;
        if !s.used || s.psn != psn {
            return None;
        }
        s.used = false;
        let k = Kept {
            bth: s.bth?,
            reth: s.reth,
            imm: s.imm,
            len: s.len,
        };
        Some((k, std::mem::take(&mut s.data)))
    }

    /// Return the buffer of the packet taken for `psn` (for reuse).
    pub fn give_back(&mut self, psn: u32, data: Vec<u8>) {
        if let Some(s) = self.slots.get_mut((psn % SLOTS) as usize) {
            if !s.used {
                s.data = data;
            }
        }
    }

    /// The highest PSN kept past `epsn`, if any.
    pub fn highest(&self, epsn: u32) -> Option<u32> {
        (self.any && diff(self.hi, epsn) > 0).then_some(self.hi)
    }

    /// The lowest PSN kept past `epsn`, if any (the end of the gap at `epsn`).
    pub fn lowest(&self, epsn: u32) -> Option<u32> {
        if !self.any || self.slots.is_empty() {
            return None;
        }
        (1..SLOTS)
            .map(|d| (epsn.wrapping_add(d)) & 0x00ff_ffff)
            .take_while(|&p| diff(p, self.hi) <= 0)
            .find(|&p| {
                let s = &self.slots[(p % SLOTS) as usize];
                s.used && s.psn == p
            })
    }

    /// Whether packets past `epsn` are kept (then `epsn` is a hole to NAK).
    pub fn beyond(&mut self, epsn: u32) -> bool {
        if self.any && diff(self.hi, epsn) < 0 {
            self.any = false; // everything kept is behind us now
        }
        self.any
    }
}
