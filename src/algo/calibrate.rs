//! Speeds of this host, measured once per process, for the cost model: local reduction (γ,
//! f32 sum) and memory copy, each over 4 MiB buffers, best of three after a warm-up. Every
//! rank sends its figures in its rendezvous blob and every rank takes the slowest rank's, so
//! all ranks feed the model the same numbers and choose the same algorithms.
//!
//! The model's speeds are effective ones (caches shared with the peer, synchronisation,
//! pieces), fitted on the development machine ([`DEFAULT`]), where the same measurement
//! gives [`REFERENCE`]. A host whose measured speed differs from the reference by more than
//! [`BAND`]× in either direction gets the fitted speed scaled by that ratio; within the band
//! the fitted speed stands, so run-to-run noise of the measurement (±30 % here) never flips
//! the model's choices. `ROCCL_CALIBRATE=0` skips the measurement.

use std::sync::OnceLock;
use std::time::Instant;

use crate::reduce::reduce_into;
use crate::types::{DataType, RedOp};

/// Reduction and copy speed of this host in GB/s.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostSpeeds {
    /// f32 sum into a buffer, bytes of the buffer per second.
    pub reduce_gbs: f64,
    /// Memory copy, bytes per second.
    pub copy_gbs: f64,
}

/// The figures the model uses when nothing was measured (fitted on the 2-core development
/// machine; docs/PERFORMANCE-LOG.md).
pub const DEFAULT: HostSpeeds = HostSpeeds {
    reduce_gbs: 10.0,
    copy_gbs: 8.0,
};

/// What the measurement gives on the development machine (2 cores, fast phase, 2026-11-30):
/// reduce 32–47 GB/s, copy 41–48 GB/s.
pub const REFERENCE: HostSpeeds = HostSpeeds {
    reduce_gbs: 42.0,
    copy_gbs: 45.0,
};

/// Measured speeds within this factor of [`REFERENCE`] leave [`DEFAULT`] as it is.
pub const BAND: f64 = 2.5;

/// The speeds the model uses for hosts that measured `m` (the slowest rank's figures).
pub fn for_model(m: HostSpeeds) -> HostSpeeds {
    let scale = |measured: f64, reference: f64, fitted: f64| {
        let r = measured / reference;
        if !(1.0 / BAND..=BAND).contains(&r) {
            fitted * r
        } else {
            fitted
        }
    };
    HostSpeeds {
        reduce_gbs: scale(m.reduce_gbs, REFERENCE.reduce_gbs, DEFAULT.reduce_gbs),
        copy_gbs: scale(m.copy_gbs, REFERENCE.copy_gbs, DEFAULT.copy_gbs),
    }
}

/// Bytes per measured buffer.
const BYTES: usize = 4 << 20;

/// This host's speeds: measured at the first call (or [`REFERENCE`] when that call says
/// not to measure, `Config::calibrate`), then remembered for the process.
pub fn host_speeds(measure_them: bool) -> HostSpeeds {
    static SPEEDS: OnceLock<HostSpeeds> = OnceLock::new();
    *SPEEDS.get_or_init(|| {
        if !measure_them {
            return REFERENCE;
        }
        let s = measure();
        crate::info!(
            "host speeds: reduce (f32 sum) {:.1} GB/s, copy {:.1} GB/s over {} MiB",
            s.reduce_gbs,
            s.copy_gbs,
            BYTES >> 20
        );
        s
    })
}

fn measure() -> HostSpeeds {
    let src: Vec<u8> = (0..BYTES).map(|i| (i % 251) as u8 & 0x3f).collect();
    let mut dst = vec![0u8; BYTES];
    let best = |f: &mut dyn FnMut()| {
        f(); // warm: pages faulted in, code in cache
        (0..3)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min)
            .max(1e-9)
    };
    let copy = best(&mut || {
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
    });
    let reduce = best(&mut || {
        // Lengths match and are a multiple of 4: cannot fail.
        let _ = reduce_into(&mut dst, &src, DataType::F32, RedOp::Sum);
        std::hint::black_box(&mut dst);
    });
    let gbs = |t: f64| (BYTES as f64 / t / 1e9).clamp(0.1, 1000.0);
    HostSpeeds {
        reduce_gbs: gbs(reduce),
        copy_gbs: gbs(copy),
    }
}

/// The speeds as they travel in a rendezvous blob.
pub fn encode(s: HostSpeeds) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&(s.reduce_gbs as f32).to_le_bytes());
    b[4..].copy_from_slice(&(s.copy_gbs as f32).to_le_bytes());
    b
}

/// A rank's speeds from its blob bytes (the reference for anything unusable).
pub fn decode(b: &[u8]) -> HostSpeeds {
    let f = |i: usize, d: f64| {
        b.get(i..i + 4)
            .map(|x| f32::from_le_bytes(x.try_into().unwrap()) as f64)
            .filter(|v| v.is_finite() && *v > 0.0)
            .unwrap_or(d)
    };
    HostSpeeds {
        reduce_gbs: f(0, REFERENCE.reduce_gbs),
        copy_gbs: f(4, REFERENCE.copy_gbs),
    }
}

/// The slowest of all ranks' speeds (what every rank feeds the model).
pub fn slowest(all: impl IntoIterator<Item = HostSpeeds>) -> HostSpeeds {
    all.into_iter().fold(
        HostSpeeds {
            reduce_gbs: f64::MAX,
            copy_gbs: f64::MAX,
        },
        |a, b| HostSpeeds {
            reduce_gbs: a.reduce_gbs.min(b.reduce_gbs),
            copy_gbs: a.copy_gbs.min(b.copy_gbs),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_speeds_are_plausible_and_travel_in_blobs() {
        let s = measure();
        eprintln!("measured: {s:?}");
        assert!(
            s.reduce_gbs > 0.1 && s.reduce_gbs < 1000.0 && s.copy_gbs > 0.1,
            "{s:?}"
        );
        let back = decode(&encode(s));
        assert!((back.reduce_gbs - s.reduce_gbs).abs() < 1e-3 * s.reduce_gbs);
        assert_eq!(
            decode(&[0xff; 8]),
            REFERENCE,
            "NaN falls back to the reference"
        );
        assert_eq!(decode(&[]), REFERENCE);
        let fast = HostSpeeds {
            reduce_gbs: 300.0,
            copy_gbs: 5.0,
        };
        assert_eq!(
            slowest([fast, REFERENCE]),
            HostSpeeds {
                reduce_gbs: 42.0,
                copy_gbs: 5.0
            }
        );
        // Within the band: the fitted speeds; outside: scaled by the measured ratio.
        assert_eq!(for_model(REFERENCE), DEFAULT);
        let m = for_model(HostSpeeds {
            reduce_gbs: 30.0,
            copy_gbs: 90.0,
        });
        assert_eq!(m, DEFAULT, "noise within the band changes nothing");
        let m = for_model(HostSpeeds {
            reduce_gbs: 4.2,
            copy_gbs: 450.0,
        });
        assert!(
            (m.reduce_gbs - 1.0).abs() < 1e-9 && (m.copy_gbs - 80.0).abs() < 1e-9,
            "{m:?}"
        );
    }
}
