//! The fault injector of the userspace provider (`ROCCL_ROCEV2_FAULTS`): what it does to
//! outgoing datagrams, and the process-wide counts of what it did and how the engines
//! recovered.

use std::sync::atomic::Ordering;

use crate::error::{Error, Result};

/// Outgoing faults, for tests and demonstrations.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Faults {
    /// Probability of dropping a datagram.
    pub drop: f64,
    /// Probability of sending it twice.
    pub dup: f64,
    /// Probability of delaying it (by up to 500 µs) behind later ones.
    pub reorder: f64,
    /// Probability of flipping one bit, anywhere but in the BTH's opcode byte (Linux's rxe
    /// crashes on some opcodes before it checks the ICRC: docs/ROCE.md).
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

/// What the fault injector did and how the engines recovered, summed over every userspace
/// provider of this process (engine counters are added when a provider closes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultStats {
    /// Datagrams the injector dropped.
    pub dropped: u64,
    /// Datagrams it sent twice.
    pub duplicated: u64,
    /// Datagrams it delayed behind later ones.
    pub reordered: u64,
    /// Datagrams it corrupted (one bit flipped).
    pub corrupted: u64,
    /// Packets the engines retransmitted.
    pub retransmits: u64,
    /// Datagrams the engines dropped for a bad ICRC.
    pub icrc_errors: u64,
    /// Duplicate requests the engines recognised and dropped.
    pub duplicates: u64,
}

static FAULT_COUNTS: [std::sync::atomic::AtomicU64; 7] =
    [const { std::sync::atomic::AtomicU64::new(0) }; 7];

pub(super) fn count(i: usize, n: u64) {
    FAULT_COUNTS[i].fetch_add(n, Ordering::Relaxed);
}

/// The process-wide [`FaultStats`] (`ROCCL_ROCEV2_FAULTS`): a test that injects faults
/// checks with it that faults were injected and recovered from.
pub fn fault_stats() -> FaultStats {
    let c = |i: usize| FAULT_COUNTS[i].load(Ordering::Relaxed);
    FaultStats {
        dropped: c(0),
        duplicated: c(1),
        reordered: c(2),
        corrupted: c(3),
        retransmits: c(4),
        icrc_errors: c(5),
        duplicates: c(6),
    }
}

pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub(super) fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && (self.next() % 1_000_000) as f64 / 1e6 < p
    }

    /// Flips one bit of `packet` (a RoCE v2 packet from its BTH on), never one of its first
    /// byte, the opcode. Linux's rxe (seen on Debian's 6.1 kernel) looks the opcode up in its
    /// table of header lengths before it checks the ICRC: an RC packet whose opcode has no
    /// entry there (0x15, 0x18 to 0x1f) has it read its pseudo-header's CRC over a length of
    /// -12 bytes, a kernel oops in `rxe_icrc_hdr` that takes the peer's machine down. Every
    /// other bit is caught by the ICRC before anything reads it. The engine's own receive
    /// path meets corrupt opcodes in the simulated pair (`engine_pair`) and the fuzzers.
    pub(super) fn corrupt(&mut self, packet: &mut [u8]) {
        if packet.len() < 2 {
            return;
        }
        let at = 1 + (self.next() as usize) % (packet.len() - 1);
        packet[at] ^= 1 << (self.next() % 8);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The injector's corruption flips exactly one bit per packet, spread over the whole
    /// packet but for the opcode byte (a corrupt opcode crashes a Linux rxe peer).
    #[test]
    fn corruption_flips_one_bit_and_never_the_opcode() {
        let mut rng = Rng(7);
        let mut hit = [0u32; 64];
        for _ in 0..20_000 {
            let mut p = [0u8; 64];
            rng.corrupt(&mut p);
            let flipped: u32 = p.iter().map(|b| b.count_ones()).sum();
            assert_eq!(flipped, 1, "one bit flipped per packet");
            let at = p.iter().position(|&b| b != 0).unwrap();
            hit[at] += 1;
        }
        assert_eq!(hit[0], 0, "the opcode byte was corrupted");
        assert!(
            hit[1..].iter().all(|&n| n > 0),
            "some byte was never corrupted: {hit:?}"
        );
        let mut short = [0x11u8];
        rng.corrupt(&mut short);
        assert_eq!(short, [0x11], "a packet of its opcode alone is left alone");
    }
}
