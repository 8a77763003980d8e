//! The shared-memory network's settings (`ROCCL_SHM_RING`, `ROCCL_SHM_CMA`), parsed once.

use crate::envvar::{self, Lookup};
use crate::error::{Error, Result};

/// Settings of the shared-memory network ([`ShmNet`](super::ShmNet)).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ShmSettings {
    /// Bytes of each connection's ring (`ROCCL_SHM_RING`, default 1 MiB; a power of two
    /// from 64 KiB to 1 GiB).
    pub ring: usize,
    /// Messages from this many bytes on are copied once, by the receiver straight from the
    /// sender's memory (`process_vm_readv`), instead of twice through the ring
    /// (`ROCCL_SHM_CMA`; 0, the default: never). Off by default: such a send completes only
    /// once the receiver copied it, which stalls the pipelined steps of ring algorithms
    /// (measured: 2-rank all-reduce of 1 MiB 517 µs with it from 256 KiB, 77 µs without),
    /// while a lone large message gains (broadcast of 64 MiB: 12.4 ms vs 18.1 ms); see
    /// docs/PERFORMANCE-LOG.md.
    pub cma: usize,
}

impl Default for ShmSettings {
    /// A 1 MiB ring, no single-copy messages.
    fn default() -> Self {
        ShmSettings {
            ring: 1 << 20,
            cma: 0,
        }
    }
}

impl ShmSettings {
    /// The settings `get` gives (unset: the default); a value that does not parse is an
    /// error naming the variable.
    pub fn from_lookup(get: Lookup<'_>) -> Result<ShmSettings> {
        let d = ShmSettings::default();
        Ok(ShmSettings {
            ring: match get("ROCCL_SHM_RING") {
                Some(v) if !v.trim().is_empty() => parse_ring(&v)?,
                _ => d.ring,
            },
            cma: envvar::value_in(get, "ROCCL_SHM_CMA", d.cma)?,
        })
    }

    /// Size from which messages are copied once ([`ShmSettings::cma`]; `usize::MAX`: never).
    pub fn cma_threshold(&self) -> usize {
        Some(self.cma).filter(|&v| v > 0).unwrap_or(usize::MAX)
    }
}

/// A ring size: a power of two from 64 KiB to 1 GiB bytes.
pub(super) fn parse_ring(v: &str) -> Result<usize> {
    match v.trim().parse::<usize>() {
        Ok(n) if n.is_power_of_two() && (1 << 16..=1 << 30).contains(&n) => Ok(n),
        _ => Err(Error::arg(format!(
            "ROCCL_SHM_RING={v}: expected a power of two from 65536 to 1073741824 bytes"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::envvar::one;

    #[test]
    fn defaults_and_good_values_are_taken() {
        let d = ShmSettings::from_lookup(&envvar::unset).unwrap();
        assert_eq!((d.ring, d.cma, d.cma_threshold()), (1 << 20, 0, usize::MAX));
        let s = ShmSettings::from_lookup(&one("ROCCL_SHM_RING", "65536")).unwrap();
        assert_eq!(s.ring, 65536);
        let s = ShmSettings::from_lookup(&one("ROCCL_SHM_CMA", "262144")).unwrap();
        assert_eq!((s.cma, s.cma_threshold()), (262144, 262144));
    }

    #[test]
    fn bad_values_are_errors_naming_the_variable() {
        let e = ShmSettings::from_lookup(&one("ROCCL_SHM_RING", "3"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ROCCL_SHM_RING=3: expected a power of two from 65536"),
            "{e}"
        );
        for v in ["abc", "32768", "2147483648"] {
            let get = |k: &str| (k == "ROCCL_SHM_RING").then(|| v.to_string());
            assert!(ShmSettings::from_lookup(&get).is_err(), "{v:?}");
        }
        let e = ShmSettings::from_lookup(&one("ROCCL_SHM_CMA", "lots"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("ROCCL_SHM_CMA=\"lots\""), "{e}");
    }
}
