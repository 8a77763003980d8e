//! The two 8-bit float formats of NCCL (`ncclFloat8e4m3` = 10, `ncclFloat8e5m2` = 11), as
//! defined by the OCP 8-bit floating point specification:
//!
//! - **E4M3** (`e4m3fn`): 4 exponent bits (bias 7), 3 mantissa bits, no infinities; the
//!   only NaN codes are S.1111.111; largest finite ±448.
//! - **E5M2**: 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like: S.11111.00 is ±inf,
//!   S.11111.xx (xx ≠ 0) NaN; largest finite ±57344.
//!
//! Reductions widen to `f32` (exactly, through a 256-entry table), combine, and round back to
//! nearest-even with saturation to the largest finite value (as NCCL's `__NV_SATFINITE`
//! conversions do); NaN stays NaN.

use bytemuck::{Pod, Zeroable};

/// An OCP E4M3 (`e4m3fn`) 8-bit float, stored as its bit pattern.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
#[repr(transparent)]
pub struct F8E4M3(pub u8);

/// An OCP E5M2 8-bit float, stored as its bit pattern.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
#[repr(transparent)]
pub struct F8E5M2(pub u8);

/// Shape of an 8-bit format (the reference conversions below are what the fast ones are
/// tested against).
#[cfg(test)]
struct Format {
    mbits: u32,
    bias: i32,
    /// Largest finite value.
    max: f32,
    /// Code of the largest finite magnitude.
    max_code: u8,
    /// Code of a (positive) NaN.
    nan_code: u8,
    /// True when exponent field all ones means inf/NaN (E5M2); false for E4M3 (only
    /// S.1111.111 is NaN).
    ieee: bool,
}

#[cfg(test)]
const E4M3: Format = Format {
    mbits: 3,
    bias: 7,
    max: 448.0,
    max_code: 0x7e,
    nan_code: 0x7f,
    ieee: false,
};

#[cfg(test)]
const E5M2: Format = Format {
    mbits: 2,
    bias: 15,
    max: 57344.0,
    max_code: 0x7b,
    nan_code: 0x7e,
    ieee: true,
};

#[cfg(test)]
const fn pow2(e: i32) -> f32 {
    // 2^e for -126 ≤ e ≤ 127 as f32 bits (every exponent used here is in range).
    f32::from_bits(((e + 127) as u32) << 23)
}

#[cfg(test)]
const fn decode(f: &Format, c: u8) -> f32 {
    let sign = if c & 0x80 != 0 { -1.0 } else { 1.0 };
    let ebits = 7 - f.mbits;
    let e = ((c as u32 >> f.mbits) & ((1 << ebits) - 1)) as i32;
    let m = (c as u32 & ((1 << f.mbits) - 1)) as f32;
    let emax_field = (1 << ebits) - 1;
    if f.ieee && e == emax_field {
        return if m == 0.0 {
            sign * f32::INFINITY
        } else {
            f32::NAN
        };
    }
    if !f.ieee && e == emax_field && m as u32 == (1 << f.mbits) - 1 {
        return f32::NAN;
    }
    let scale = (1 << f.mbits) as f32;
    if e == 0 {
        sign * m / scale * pow2(1 - f.bias)
    } else {
        sign * (1.0 + m / scale) * pow2(e - f.bias)
    }
}

/// Fast, branch-free widening (vectorizes): normal codes by moving the exponent and mantissa
/// fields into place and rebiasing, subnormal codes by converting the mantissa to f32 and
/// scaling; inf/NaN codes by select.
#[inline(always)]
fn decode_fast<const MBITS: u32, const BIAS: u32, const IEEE: bool>(c: u8) -> f32 {
    let c = c as u32;
    let sign = (c & 0x80) << 24;
    let mag = c & 0x7f;
    let normal = (mag << (23 - MBITS)) + ((127 - BIAS) << 23);
    // mag · 2^(1 − BIAS − MBITS): the subnormal value.
    let scale = f32::from_bits((127 + 1 - BIAS - MBITS) << 23);
    let sub = (mag as i32 as f32 * scale).to_bits();
    let v = if mag < (1 << MBITS) { sub } else { normal };
    let v = if IEEE {
        // Exponent field all ones: mantissa 0 is inf, anything else NaN.
        let inf = (0x7f >> MBITS) << MBITS;
        if mag == inf {
            0x7f80_0000
        } else if mag > inf {
            0x7fc0_0000
        } else {
            v
        }
    } else if mag == 0x7f {
        0x7fc0_0000
    } else {
        v
    };
    f32::from_bits(sign | v)
}

/// Fast, branch-free conversion (selects instead of branches, so loops over it vectorize):
/// normal results by rounding the f32 mantissa in place (nearest-even: add just under half an
/// ulp plus the kept part's lowest bit) and rebiasing the exponent; subnormal results by
/// adding 2^(emin − mbits + 23), which makes the FPU round at the subnormal quantum; then
/// saturation and NaN. `encode` is the reference it is tested against.
#[inline(always)]
fn encode_fast<const MBITS: u32, const BIAS: u32, const MAX_CODE: u32, const NAN_CODE: u32>(
    x: f32,
) -> u8 {
    let b = x.to_bits();
    let sign = (b >> 24) & 0x80;
    let a = b & 0x7fff_ffff;
    let shift = 23 - MBITS;
    let r = a + ((1 << (shift - 1)) - 1) + ((a >> shift) & 1);
    let normal = (r >> shift).wrapping_sub((127 - BIAS) << MBITS);
    // 2^(1 - BIAS - MBITS + 23): its mantissa's last bit is one subnormal quantum.
    let magic = (127 + 1 + 23 - BIAS - MBITS) << 23;
    let sub = (f32::from_bits(a) + f32::from_bits(magic)).to_bits() - magic;
    let min_normal = (127 + 1 - BIAS) << 23;
    let code = if a < min_normal {
        sub
    } else {
        normal.min(MAX_CODE)
    };
    let code = if a > 0x7f80_0000 { NAN_CODE } else { code };
    (sign | code) as u8
}

#[cfg(test)]
fn encode(f: &Format, x: f32) -> u8 {
    if x.is_nan() {
        return f.nan_code;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= f.max {
        // Saturate (inf included).
        return sign | f.max_code;
    }
    let emin = 1 - f.bias;
    // Exponent of `a` (for normal f32; 8-bit subnormals start far above f32's).
    let e = if a == 0.0 {
        emin
    } else {
        ((a.to_bits() >> 23) as i32 - 127).max(emin)
    };
    let quantum = pow2(e - f.mbits as i32);
    // Exact division by a power of two, then nearest-even to an integer number of quanta.
    let q = (a / quantum).round_ties_even() * quantum;
    if q >= f.max {
        return sign | f.max_code;
    }
    if q == 0.0 {
        return sign;
    }
    let qe = (q.to_bits() >> 23) as i32 - 127;
    if qe < emin {
        // Subnormal: mantissa counts quanta of 2^(emin - mbits).
        return sign | (q / pow2(emin - f.mbits as i32)) as u8;
    }
    let mant = ((q / pow2(qe) - 1.0) * (1 << f.mbits) as f32) as u8;
    sign | (((qe + f.bias) as u8) << f.mbits) | mant
}

impl F8E4M3 {
    /// The value as `f32` (exact).
    #[inline(always)]
    pub fn to_f32(self) -> f32 {
        decode_fast::<3, 7, false>(self.0)
    }
    /// `x` rounded to nearest-even, saturated to ±448; NaN → NaN.
    #[inline(always)]
    pub fn from_f32(x: f32) -> F8E4M3 {
        F8E4M3(encode_fast::<3, 7, 0x7e, 0x7f>(x))
    }
}

impl F8E5M2 {
    /// The value as `f32` (exact).
    #[inline(always)]
    pub fn to_f32(self) -> f32 {
        decode_fast::<2, 15, true>(self.0)
    }
    /// `x` rounded to nearest-even, saturated to ±57344; NaN → NaN.
    #[inline(always)]
    pub fn from_f32(x: f32) -> F8E5M2 {
        F8E5M2(encode_fast::<2, 15, 0x7b, 0x7e>(x))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_widening_matches_the_reference() {
        for c in 0..=255u8 {
            for (fast, slow) in [
                (F8E4M3(c).to_f32(), decode(&E4M3, c)),
                (F8E5M2(c).to_f32(), decode(&E5M2, c)),
            ] {
                assert!(
                    fast.to_bits() == slow.to_bits() || (fast.is_nan() && slow.is_nan()),
                    "{c:#x}: {fast} vs {slow}"
                );
            }
        }
    }

    #[test]
    fn every_code_round_trips() {
        for c in 0..=255u8 {
            let v = F8E4M3(c).to_f32();
            if v.is_nan() {
                assert_eq!(c & 0x7f, 0x7f, "e4m3 {c:#x}");
                continue;
            }
            // -0 and +0 keep their codes.
            assert_eq!(F8E4M3::from_f32(v).0, c, "e4m3 {c:#x} = {v}");
            let v = F8E5M2(c).to_f32();
            if v.is_nan() {
                assert!(c & 0x7c == 0x7c && c & 3 != 0, "e5m2 {c:#x}");
                continue;
            }
            if v.is_infinite() {
                // Saturating conversion: inf maps to the largest finite value.
                assert_eq!(F8E5M2::from_f32(v).0, (c & 0x80) | 0x7b);
                continue;
            }
            assert_eq!(F8E5M2::from_f32(v).0, c, "e5m2 {c:#x} = {v}");
        }
    }

    #[test]
    fn fast_conversion_matches_the_reference() {
        // Every 97th f32 bit pattern (both signs, all exponents, NaN, inf) and every exact
        // 8-bit value with its neighbours and midpoints.
        let mut xs: Vec<f32> = (0..u32::MAX / 97).map(|i| f32::from_bits(i * 97)).collect();
        for c in 0..=255u8 {
            for v in [F8E4M3(c).to_f32(), F8E5M2(c).to_f32()] {
                let b = v.to_bits();
                xs.extend([v, f32::from_bits(b + 1), f32::from_bits(b.wrapping_sub(1))]);
            }
            let (a, b) = (F8E4M3(c).to_f32(), F8E4M3(c.wrapping_add(1)).to_f32());
            xs.push((a + b) / 2.0);
            let (a, b) = (F8E5M2(c).to_f32(), F8E5M2(c.wrapping_add(1)).to_f32());
            xs.push((a + b) / 2.0);
        }
        for x in xs {
            let (fast, slow) = (F8E4M3::from_f32(x).0, encode(&E4M3, x));
            assert!(
                fast == slow || (x.is_nan() && fast & 0x7f == 0x7f),
                "e4m3 {x:e}: {fast:#x} vs {slow:#x}"
            );
            let (fast, slow) = (F8E5M2::from_f32(x).0, encode(&E5M2, x));
            assert!(
                fast == slow || (x.is_nan() && fast & 0x7f == 0x7e),
                "e5m2 {x:e}: {fast:#x} vs {slow:#x}"
            );
        }
    }

    #[test]
    fn known_values_rounding_and_saturation() {
        assert_eq!(F8E4M3(0x7e).to_f32(), 448.0);
        assert_eq!(F8E4M3(0x01).to_f32(), 2f32.powi(-9));
        assert_eq!(F8E4M3(0x38).to_f32(), 1.0);
        assert_eq!(F8E5M2(0x7b).to_f32(), 57344.0);
        assert_eq!(F8E5M2(0x3c).to_f32(), 1.0);
        assert_eq!(F8E5M2(0x01).to_f32(), 2f32.powi(-16));
        // 1 + 1/16 is halfway between 1 and 1.125 (e4m3): ties to even → 1.
        assert_eq!(F8E4M3::from_f32(1.0625).to_f32(), 1.0);
        // 1 + 3/16 is halfway between 1.125 and 1.25: ties to even → 1.25.
        assert_eq!(F8E4M3::from_f32(1.1875).to_f32(), 1.25);
        assert_eq!(F8E4M3::from_f32(1000.0).to_f32(), 448.0);
        assert_eq!(F8E4M3::from_f32(-1e9).to_f32(), -448.0);
        assert_eq!(F8E5M2::from_f32(f32::INFINITY).to_f32(), 57344.0);
        assert!(F8E4M3::from_f32(f32::NAN).to_f32().is_nan());
        assert!(F8E5M2::from_f32(f32::NAN).to_f32().is_nan());
        // Below half the smallest subnormal: zero, sign kept.
        assert_eq!(F8E4M3::from_f32(-1e-6).0, 0x80);
        // Subnormal rounding: 1.5 quanta → 2 quanta (even).
        assert_eq!(F8E4M3::from_f32(1.5 * 2f32.powi(-9)).0, 0x02);
        // Rounding up across a binade: 1.9375 → 2.0 in e4m3.
        assert_eq!(F8E4M3::from_f32(1.9375).to_f32(), 2.0);
    }
}
