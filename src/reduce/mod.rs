//! Vectorized reduction kernels over byte buffers.
//!
//! Every kernel takes raw bytes plus a [`DataType`] and a [`RedOp`], checks the lengths, and
//! dispatches to a typed loop that the compiler auto-vectorizes. Aligned buffers are cast in
//! place; misaligned ones are staged through aligned stack buffers in small chunks, so the
//! result is the same either way (only slower).
//!
//! `f16` and `bf16` are computed in `f32` and rounded back to nearest-even. bf16 conversions
//! are branch-free bit manipulation, so its kernels are single fused loops that
//! auto-vectorize; f16 goes through blocks of `f32` in stack arrays using `half`'s slice
//! conversions, which use F16C where the CPU has it.

use bytemuck::Pod;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::types::{DataType, RedOp};
use crate::types::{F8E4M3, F8E5M2};

/// Elements per block when computing f16 through `f32` arrays.
const F16_BLOCK: usize = 256;

/// Bytes per chunk when staging misaligned buffers through aligned stack buffers.
const STAGE_BYTES: usize = 4096;

/// Call `$f::<T>($args)` with `T` the Rust element type of `$dtype`.
macro_rules! dispatch {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DataType::I8 => $f::<i8>($($arg),*),
            DataType::U8 => $f::<u8>($($arg),*),
            DataType::I32 => $f::<i32>($($arg),*),
            DataType::U32 => $f::<u32>($($arg),*),
            DataType::I64 => $f::<i64>($($arg),*),
            DataType::U64 => $f::<u64>($($arg),*),
            DataType::F16 => $f::<f16>($($arg),*),
            DataType::F32 => $f::<f32>($($arg),*),
            DataType::F64 => $f::<f64>($($arg),*),
            DataType::Bf16 => $f::<bf16>($($arg),*),
            DataType::F8E4M3 => $f::<F8E4M3>($($arg),*),
            DataType::F8E5M2 => $f::<F8E5M2>($($arg),*),
        }
    };
}

/// `dst[i]` = `dst[i]` op `src[i]`. Avg behaves as Sum here (division happens in [`finish_avg`]).
///
/// `dst` and `src` must have the same length, a multiple of `dtype.size()`; otherwise an
/// [`Error::Internal`] naming the lengths is returned. Buffers need not be aligned.
pub fn reduce_into(dst: &mut [u8], src: &[u8], dtype: DataType, op: RedOp) -> Result<()> {
    check("reduce_into", dtype, &[dst.len(), src.len()])?;
    dispatch!(dtype, drive(dst, None, src, op));
    Ok(())
}

/// `dst[i]` = `a[i]` op `b[i]` (fused copy + reduce; used when the output buffer differs from the
/// input). Avg behaves as Sum here (division happens in [`finish_avg`]).
///
/// All three buffers must have the same length, a multiple of `dtype.size()`; otherwise an
/// [`Error::Internal`] naming the lengths is returned. Buffers need not be aligned.
pub fn reduce_to(dst: &mut [u8], a: &[u8], b: &[u8], dtype: DataType, op: RedOp) -> Result<()> {
    check("reduce_to", dtype, &[dst.len(), a.len(), b.len()])?;
    dispatch!(dtype, drive(dst, Some(a), b, op));
    Ok(())
}

/// `buf[i]` = `buf[i]` × `scalar` (NCCL's pre-multiplied sum): `scalar` is one element of
/// `dtype`, its bytes as in memory. Multiplies as [`RedOp::Prod`] does (integers wrap, narrow
/// floats compute in `f32` and round to nearest-even), against a stack block of copies of the
/// scalar, so no allocation.
pub fn premultiply(buf: &mut [u8], dtype: DataType, scalar: &[u8]) -> Result<()> {
    check("premultiply", dtype, &[buf.len()])?;
    let size = dtype.size();
    if scalar.len() != size {
        return Err(Error::Internal(format!(
            "premultiply: a {dtype} scalar is {size} bytes, got {}",
            scalar.len()
        )));
    }
    let mut s = Stage::new();
    for c in s.0.chunks_exact_mut(size) {
        c.copy_from_slice(scalar);
    }
    for c in buf.chunks_mut(STAGE_BYTES) {
        let k = c.len();
        dispatch!(dtype, drive(c, None, &s.0[..k], RedOp::Prod));
    }
    Ok(())
}

/// `buf[i]` = `buf[i]` / nranks.
///
/// Integers divide truncating toward zero; `f16`/`bf16` and `f32` divide in `f32`, `f64` in
/// `f64`. `nranks` must be at least 1 and `buf.len()` a multiple of `dtype.size()`; otherwise
/// an [`Error::Internal`] is returned.
pub fn finish_avg(buf: &mut [u8], dtype: DataType, nranks: usize) -> Result<()> {
    check("finish_avg", dtype, &[buf.len()])?;
    if nranks == 0 {
        return Err(Error::Internal("finish_avg: nranks is 0".into()));
    }
    if nranks == 1 {
        return Ok(());
    }
    dispatch!(dtype, drive_avg(buf, nranks));
    Ok(())
}

/// Check that every length equals the first and is a multiple of the element size.
fn check(what: &str, dtype: DataType, lens: &[usize]) -> Result<()> {
    let first = lens[0];
    if lens.iter().any(|&l| l != first) || first % dtype.size() != 0 {
        return Err(Error::Internal(format!(
            "{what}: buffer lengths {lens:?} bytes must be equal and a multiple of {} ({dtype})",
            dtype.size()
        )));
    }
    Ok(())
}

/// Arithmetic on the type a kernel computes in (the element type, or `f32` for f16).
trait Num: Copy {
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn max(self, o: Self) -> Self;
    fn min(self, o: Self) -> Self;
}

macro_rules! num_int {
    ($($t:ty),*) => {$(
        impl Num for $t {
            #[inline(always)] fn add(self, o: Self) -> Self { self.wrapping_add(o) }
            #[inline(always)] fn mul(self, o: Self) -> Self { self.wrapping_mul(o) }
            #[inline(always)] fn max(self, o: Self) -> Self { Ord::max(self, o) }
            #[inline(always)] fn min(self, o: Self) -> Self { Ord::min(self, o) }
        }
    )*};
}
num_int!(i8, u8, i32, u32, i64, u64);

macro_rules! num_float {
    ($($t:ty),*) => {$(
        impl Num for $t {
            #[inline(always)] fn add(self, o: Self) -> Self { self + o }
            #[inline(always)] fn mul(self, o: Self) -> Self { self * o }
            // IEEE maxNum/minNum: a NaN operand loses to a number.
            #[inline(always)] fn max(self, o: Self) -> Self { <$t>::max(self, o) }
            #[inline(always)] fn min(self, o: Self) -> Self { <$t>::min(self, o) }
        }
    )*};
}
num_float!(f32, f64);

/// Call `$f($args, op_fn)` with the `Num` method for `$op`. Each method is its own zero-sized
/// function type, so each op gets its own monomorphized, vectorized loop.
macro_rules! with_op {
    ($op:expr, $t:ty, $f:ident($($arg:expr),*)) => {
        match $op {
            RedOp::Sum | RedOp::Avg => $f($($arg,)* <$t as Num>::add),
            RedOp::Prod => $f($($arg,)* <$t as Num>::mul),
            RedOp::Max => $f($($arg,)* <$t as Num>::max),
            RedOp::Min => $f($($arg,)* <$t as Num>::min),
        }
    };
}

/// An element type with typed kernels over aligned slices.
trait Elem: Pod {
    /// `d[i] = a[i] op b[i]`, or `d[i] = d[i] op b[i]` when `a` is `None`. Equal lengths.
    fn reduce(d: &mut [Self], a: Option<&[Self]>, b: &[Self], op: RedOp);
    /// `d[i] /= n` with `n >= 2`.
    fn avg(d: &mut [Self], n: usize);
}

#[inline(always)]
fn zip_into<T: Copy>(d: &mut [T], s: &[T], f: impl Fn(T, T) -> T) {
    for (x, &y) in d.iter_mut().zip(s) {
        *x = f(*x, y);
    }
}

#[inline(always)]
fn zip_to<T: Copy>(d: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T) {
    for ((x, &y), &z) in d.iter_mut().zip(a).zip(b) {
        *x = f(y, z);
    }
}

/// `d[i] = f(a[i], b[i])`, or `d[i] = f(d[i], b[i])` when `a` is `None`.
#[inline(always)]
fn native<T: Copy>(d: &mut [T], a: Option<&[T]>, b: &[T], f: impl Fn(T, T) -> T) {
    match a {
        None => zip_into(d, b, f),
        Some(a) => zip_to(d, a, b, f),
    }
}

macro_rules! elem_int {
    ($($t:ty => $w:ty),*) => {$(
        impl Elem for $t {
            #[inline(always)]
            fn reduce(d: &mut [Self], a: Option<&[Self]>, b: &[Self], op: RedOp) {
                with_op!(op, $t, native(d, a, b))
            }
            #[inline(always)]
            fn avg(d: &mut [Self], n: usize) {
                match <$t>::try_from(n) {
                    // `/` on integers truncates toward zero. `n >= 2`, so no overflow.
                    Ok(n) => d.iter_mut().for_each(|x| *x /= n),
                    // n exceeds the type's range: divide in a wider type (the quotient fits).
                    Err(_) => {
                        let n = n as $w;
                        d.iter_mut().for_each(|x| *x = (*x as $w / n) as $t);
                    }
                }
            }
        }
    )*};
}
elem_int!(i8 => i128, u8 => u128, i32 => i128, u32 => u128, i64 => i128, u64 => u128);

macro_rules! elem_float {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            #[inline(always)]
            fn reduce(d: &mut [Self], a: Option<&[Self]>, b: &[Self], op: RedOp) {
                with_op!(op, $t, native(d, a, b))
            }
            #[inline(always)]
            fn avg(d: &mut [Self], n: usize) {
                let n = n as $t;
                d.iter_mut().for_each(|x| *x /= n);
            }
        }
    )*};
}
elem_float!(f32, f64);

/// Where an `f32` about to be rounded to bf16 came from. Always a constant at the call
/// site, so the unused case compiles away; it lets the rounding skip work that cannot
/// change the result. (Rounding an arbitrary `f32` would need a NaN check for `Arith` too:
/// an arbitrary NaN payload can carry out of the mantissa.)
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Origin {
    /// Sum, product or quotient of values widened from bf16. A NaN result is then quiet and
    /// its payload is either the canonical one or an input's (Rust's float semantics allow
    /// nothing else), so its low 16 bits are zero.
    Arith,
    /// Max or min of values widened from bf16: one of the inputs, exactly, but possibly a
    /// signalling NaN if both inputs were NaN.
    Pick,
}

/// bf16 to f32, exactly: bf16 is the upper half of a binary32.
#[inline(always)]
fn bf16_widen(h: bf16) -> f32 {
    f32::from_bits((h.to_bits() as u32) << 16)
}

/// `x` rounded to bf16 precision, nearest-even, as f32 bits: the bf16 is the upper half.
/// NaN becomes a quiet NaN with the same sign. Branch-free, so loops over it vectorize.
#[inline(always)]
fn bf16_round(x: f32, origin: Origin) -> u32 {
    let b = x.to_bits();
    match origin {
        // Add just under half an ulp, plus one if the kept part is odd. Overflow past the
        // largest finite value carries into the exponent and yields inf. A NaN is quiet with
        // a zero low half, so this leaves it as it is.
        Origin::Arith => b.wrapping_add(0x7fff + ((b >> 16) & 1)),
        // Exact already: only make a NaN quiet.
        Origin::Pick => {
            if x.is_nan() {
                b | 0x0040_0000
            } else {
                b
            }
        }
    }
}

/// f32 to bf16, rounding to nearest-even.
#[inline(always)]
fn bf16_narrow(x: f32, origin: Origin) -> bf16 {
    bf16::from_bits((bf16_round(x, origin) >> 16) as u16)
}

/// bf16 kernel: widen, combine in `f32`, round back, in one fused loop.
///
/// Where all buffers allow it, works on 32-bit words holding two elements: the upper one
/// is widened by a mask and the lower one by a shift, so no lane shuffles are needed to go
/// between 16- and 32-bit lanes. Element-wise otherwise.
#[inline(always)]
fn bf16_kernel(
    d: &mut [bf16],
    a: Option<&[bf16]>,
    b: &[bf16],
    origin: Origin,
    f: impl Fn(f32, f32) -> f32,
) {
    fn words(s: &[bf16]) -> Option<&[u32]> {
        bytemuck::try_cast_slice(&s[..s.len() & !1]).ok()
    }
    let f = &f;
    let one = |x, y| bf16_narrow(f(bf16_widen(x), bf16_widen(y)), origin);
    let even = d.len() & !1;
    let (d0, d1) = d.split_at_mut(even);
    if let (Ok(dw), Some(aw), Some(bw)) = (
        bytemuck::try_cast_slice_mut::<bf16, u32>(d0),
        a.map_or(Some(None), |a| words(a).map(Some)),
        words(b),
    ) {
        native(dw, aw, bw, |x: u32, y: u32| {
            let hi = f(
                f32::from_bits(x & 0xffff_0000),
                f32::from_bits(y & 0xffff_0000),
            );
            let lo = f(f32::from_bits(x << 16), f32::from_bits(y << 16));
            (bf16_round(hi, origin) & 0xffff_0000) | (bf16_round(lo, origin) >> 16)
        });
        native(d1, a.map(|a| &a[even..]), &b[even..], one);
    } else {
        native(d, a, b, one);
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn reduce(d: &mut [Self], a: Option<&[Self]>, b: &[Self], op: RedOp) {
        match op {
            RedOp::Sum | RedOp::Avg => bf16_kernel(d, a, b, Origin::Arith, |x, y| x + y),
            RedOp::Prod => bf16_kernel(d, a, b, Origin::Arith, |x, y| x * y),
            RedOp::Max => bf16_kernel(d, a, b, Origin::Pick, f32::max),
            RedOp::Min => bf16_kernel(d, a, b, Origin::Pick, f32::min),
        }
    }
    #[inline(always)]
    fn avg(d: &mut [Self], n: usize) {
        let n = n as f32;
        d.iter_mut()
            .for_each(|x| *x = bf16_narrow(bf16_widen(*x) / n, Origin::Arith));
    }
}

/// f16 kernel: blocks of [`F16_BLOCK`] elements are widened into stack arrays of `f32` with
/// `half`'s slice conversions (F16C when the CPU has it, detected at run time), combined,
/// and rounded back to nearest-even.
#[inline(always)]
fn f16_kernel(d: &mut [f16], a: Option<&[f16]>, b: &[f16], f: impl Fn(f32, f32) -> f32) {
    let (mut fa, mut fb) = ([0f32; F16_BLOCK], [0f32; F16_BLOCK]);
    for (i, dc) in d.chunks_mut(F16_BLOCK).enumerate() {
        let r = i * F16_BLOCK..i * F16_BLOCK + dc.len();
        let (fa, fb) = (&mut fa[..dc.len()], &mut fb[..dc.len()]);
        match a {
            Some(a) => a[r.clone()].convert_to_f32_slice(fa),
            None => dc.convert_to_f32_slice(fa),
        }
        b[r].convert_to_f32_slice(fb);
        zip_into(fa, fb, &f);
        dc.convert_from_f32_slice(fa);
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn reduce(d: &mut [Self], a: Option<&[Self]>, b: &[Self], op: RedOp) {
        with_op!(op, f32, f16_kernel(d, a, b))
    }
    #[inline(always)]
    fn avg(d: &mut [Self], n: usize) {
        let n = n as f32;
        let mut f = [0f32; F16_BLOCK];
        for c in d.chunks_mut(F16_BLOCK) {
            let f = &mut f[..c.len()];
            c.convert_to_f32_slice(f);
            f.iter_mut().for_each(|x| *x /= n);
            c.convert_from_f32_slice(f);
        }
    }
}

/// fp8 kernels: widen through the format's table, combine in `f32`, round back to
/// nearest-even with saturation (see `types::fp8`).
macro_rules! elem_fp8 {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            #[inline(always)]
            fn reduce(d: &mut [Self], a: Option<&[Self]>, b: &[Self], op: RedOp) {
                // Closures, not function pointers: each op gets its own vectorized loop.
                match op {
                    RedOp::Sum | RedOp::Avg => native(d, a, b, |x: $t, y: $t| {
                        <$t>::from_f32(x.to_f32() + y.to_f32())
                    }),
                    RedOp::Prod => native(d, a, b, |x: $t, y: $t| {
                        <$t>::from_f32(x.to_f32() * y.to_f32())
                    }),
                    RedOp::Max => native(d, a, b, |x: $t, y: $t| {
                        <$t>::from_f32(f32::max(x.to_f32(), y.to_f32()))
                    }),
                    RedOp::Min => native(d, a, b, |x: $t, y: $t| {
                        <$t>::from_f32(f32::min(x.to_f32(), y.to_f32()))
                    }),
                }
            }
            #[inline(always)]
            fn avg(d: &mut [Self], n: usize) {
                let n = n as f32;
                d.iter_mut().for_each(|x| *x = <$t>::from_f32(x.to_f32() / n));
            }
        }
    )*};
}
elem_fp8!(F8E4M3, F8E5M2);

/// Stack buffer aligned for every element type.
#[repr(C, align(64))]
struct Stage([u8; STAGE_BYTES]);

impl Stage {
    fn new() -> Self {
        Stage([0; STAGE_BYTES])
    }
}

/// Byte-level driver: cast in place when aligned, else stage chunks through aligned buffers.
/// Lengths are already checked. Compiled also for AVX-512 and AVX2 (with F16C), chosen at
/// run time: the kernels are element-wise, so every version gives the same bits.
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c"
))]
fn drive<T: Elem>(dst: &mut [u8], a: Option<&[u8]>, b: &[u8], op: RedOp) {
    let aligned = |s: &[u8]| bytemuck::try_cast_slice::<u8, T>(s).is_ok();
    if aligned(dst) && a.map_or(true, aligned) && aligned(b) {
        let d: &mut [T] = bytemuck::cast_slice_mut(dst);
        T::reduce(d, a.map(bytemuck::cast_slice), bytemuck::cast_slice(b), op);
        return;
    }
    let (mut sd, mut sa, mut sb) = (Stage::new(), Stage::new(), Stage::new());
    let mut off = 0;
    while off < dst.len() {
        // STAGE_BYTES is a multiple of every element size, and so is the total length.
        let n = STAGE_BYTES.min(dst.len() - off);
        let range = off..off + n;
        sb.0[..n].copy_from_slice(&b[range.clone()]);
        let sa = match a {
            Some(a) => {
                sa.0[..n].copy_from_slice(&a[range.clone()]);
                Some(bytemuck::cast_slice::<u8, T>(&sa.0[..n]))
            }
            None => {
                sd.0[..n].copy_from_slice(&dst[range.clone()]);
                None
            }
        };
        T::reduce(
            bytemuck::cast_slice_mut(&mut sd.0[..n]),
            sa,
            bytemuck::cast_slice(&sb.0[..n]),
            op,
        );
        dst[range].copy_from_slice(&sd.0[..n]);
        off += n;
    }
}

/// Byte-level driver for [`finish_avg`].
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512bw+avx512vl+avx2+fma+f16c",
    "x86_64+avx2+fma+f16c"
))]
fn drive_avg<T: Elem>(buf: &mut [u8], n: usize) {
    if let Ok(d) = bytemuck::try_cast_slice_mut::<u8, T>(buf) {
        T::avg(d, n);
        return;
    }
    let mut s = Stage::new();
    for c in buf.chunks_mut(STAGE_BYTES) {
        let k = c.len();
        s.0[..k].copy_from_slice(c);
        T::avg(bytemuck::cast_slice_mut(&mut s.0[..k]), n);
        c.copy_from_slice(&s.0[..k]);
    }
}

/// Copy `src` into `dst` in pieces of [`COPY_PIECE`] bytes. glibc's memcpy uses `rep movsb`
/// only below its `rep_movsb_stop_threshold` (the L2 size, 1 MiB, on AMD) and a loop of
/// vector moves above it, backwards when source and destination sit at the same page offset;
/// on this machine the pieces copy a 32 MiB block 12 % faster inside a 2-rank all-gather
/// (docs/PERFORMANCE-LOG.md, "Aligned buffers").
pub(crate) fn copy_large(dst: &mut [u8], src: &[u8]) {
    for (d, s) in dst.chunks_mut(COPY_PIECE).zip(src.chunks(COPY_PIECE)) {
        d.copy_from_slice(s);
    }
}

/// Piece of [`copy_large`].
pub(crate) const COPY_PIECE: usize = 512 << 10;

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels called directly, compiled for the baseline target, give the same bits as
    /// the dispatched driver (the AVX-512 or AVX2 version where the CPU has them), so ranks
    /// on different CPUs compute identical results. NaN inputs are left out: which NaN a
    /// max of two NaNs returns is not specified.
    #[test]
    fn every_cpu_path_gives_the_same_bits() {
        fn baseline<T: Elem>(d: &mut [u8], b: &[u8], op: RedOp) {
            T::reduce(
                bytemuck::cast_slice_mut(d),
                None,
                bytemuck::cast_slice(b),
                op,
            )
        }
        fn nan(dt: DataType, e: &[u8]) -> bool {
            let u = |n: usize| e[..n].iter().rev().fold(0u64, |a, &x| a << 8 | x as u64);
            match dt {
                DataType::F16 => u(2) & 0x7c00 == 0x7c00 && u(2) & 0x3ff != 0,
                DataType::Bf16 => u(2) & 0x7f80 == 0x7f80 && u(2) & 0x7f != 0,
                DataType::F32 => f32::from_bits(u(4) as u32).is_nan(),
                DataType::F64 => f64::from_bits(u(8)).is_nan(),
                DataType::F8E4M3 => e[0] & 0x7f == 0x7f,
                DataType::F8E5M2 => e[0] & 0x7c == 0x7c && e[0] & 3 != 0,
                _ => false,
            }
        }
        let n = 4099;
        for dt in DataType::ALL {
            let es = dt.size();
            let clean = |seed: u64| -> Vec<u64> {
                let mut v = bytes(n * es, seed);
                for e in v.chunks_mut(es) {
                    if nan(dt, e) {
                        e.fill(0);
                    }
                }
                let mut w = vec![0u64; (n * es).div_ceil(8)];
                bytemuck::cast_slice_mut::<u64, u8>(&mut w)[..n * es].copy_from_slice(&v);
                w
            };
            let (a, b) = (clean(7), clean(8));
            let bytes_of = |w: &[u64]| bytemuck::cast_slice::<u64, u8>(w)[..n * es].to_vec();
            for op in RedOp::ALL {
                let (mut d1, mut d2) = (a.clone(), a.clone());
                let d1b = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut d1)[..n * es];
                reduce_into(d1b, &bytes_of(&b), dt, op).unwrap();
                let d2b = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut d2)[..n * es];
                let bb = bytes_of(&b);
                dispatch!(dt, baseline(d2b, &bb, op));
                assert!(
                    bytes_of(&d1) == bytes_of(&d2),
                    "{dt} {op}: dispatched and baseline differ"
                );
            }
        }
    }

    /// Deterministic pseudo-random bytes (xorshift).
    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect()
    }

    /// Random finite values of moderate magnitude for float types, raw bytes for ints.
    fn values(dtype: DataType, count: usize, seed: u64) -> Vec<u8> {
        let raw = bytes(count * 8, seed);
        let ints = |i: usize| i64::from_le_bytes(raw[i * 8..i * 8 + 8].try_into().unwrap());
        let fl = |i: usize| (ints(i) % 20_000) as f64 / 64.0;
        let mut out = Vec::with_capacity(count * dtype.size());
        for i in 0..count {
            match dtype {
                DataType::F16 => out.extend(f16::from_f64(fl(i)).to_le_bytes()),
                DataType::Bf16 => out.extend(bf16::from_f64(fl(i)).to_le_bytes()),
                DataType::F32 => out.extend((fl(i) as f32).to_le_bytes()),
                DataType::F64 => out.extend(fl(i).to_le_bytes()),
                _ => out.extend_from_slice(&raw[i * 8..i * 8 + dtype.size()]),
            }
        }
        out
    }

    /// Naive reference: element by element through unaligned reads, f16/bf16 via half's own
    /// conversions.
    fn reference(a: &[u8], b: &[u8], dtype: DataType, op: RedOp) -> Vec<u8> {
        fn go<T: Pod>(a: &[u8], b: &[u8], f: impl Fn(T, T) -> T) -> Vec<u8> {
            let sz = std::mem::size_of::<T>();
            let mut out = Vec::new();
            for (x, y) in a.chunks(sz).zip(b.chunks(sz)) {
                let r = f(
                    bytemuck::pod_read_unaligned(x),
                    bytemuck::pod_read_unaligned(y),
                );
                out.extend_from_slice(bytemuck::bytes_of(&r));
            }
            out
        }
        macro_rules! int {
            ($t:ty) => {
                go::<$t>(a, b, |x, y| match op {
                    RedOp::Sum | RedOp::Avg => x.wrapping_add(y),
                    RedOp::Prod => x.wrapping_mul(y),
                    RedOp::Max => Ord::max(x, y),
                    RedOp::Min => Ord::min(x, y),
                })
            };
        }
        macro_rules! float {
            ($t:ty, $to:expr, $from:expr) => {
                go::<$t>(a, b, |x, y| {
                    let (x, y): (f64, f64) = ($to(x), $to(y));
                    let r = match op {
                        RedOp::Sum | RedOp::Avg => x + y,
                        RedOp::Prod => x * y,
                        RedOp::Max => x.max(y),
                        RedOp::Min => x.min(y),
                    };
                    $from(r)
                })
            };
        }
        match dtype {
            DataType::I8 => int!(i8),
            DataType::U8 => int!(u8),
            DataType::I32 => int!(i32),
            DataType::U32 => int!(u32),
            DataType::I64 => int!(i64),
            DataType::U64 => int!(u64),
            // Sum/product of two f32 is exact in f64 apart from products that overflow
            // 53 bits; the test values keep them small enough to be exact.
            DataType::F32 => float!(f32, |x: f32| x as f64, |r: f64| r as f32),
            // f64 needs its own precision.
            DataType::F64 => go::<f64>(a, b, |x, y| match op {
                RedOp::Sum | RedOp::Avg => x + y,
                RedOp::Prod => x * y,
                RedOp::Max => x.max(y),
                RedOp::Min => x.min(y),
            }),
            // Through f32, as the kernels do, rounded with half's own conversion.
            DataType::F16 => float!(f16, |x: f16| x.to_f32() as f64, |r: f64| f16::from_f32(
                r as f32
            )),
            DataType::Bf16 => float!(bf16, |x: bf16| x.to_f32() as f64, |r: f64| bf16::from_f32(
                r as f32
            )),
            // Sums and products of two fp8 values are exact in f32.
            DataType::F8E4M3 => float!(F8E4M3, |x: F8E4M3| x.to_f32() as f64, |r: f64| {
                F8E4M3::from_f32(r as f32)
            }),
            DataType::F8E5M2 => float!(F8E5M2, |x: F8E5M2| x.to_f32() as f64, |r: f64| {
                F8E5M2::from_f32(r as f32)
            }),
        }
    }

    const LENS: [usize; 5] = [0, 1, 7, 1000, 4099];

    /// Compare two result buffers bitwise, except that any NaN matches any NaN.
    fn same(got: &[u8], want: &[u8], dtype: DataType) -> bool {
        if got.len() != want.len() {
            return false;
        }
        let sz = dtype.size();
        got.chunks(sz).zip(want.chunks(sz)).all(|(g, w)| {
            g == w
                || match dtype {
                    DataType::F16 => {
                        f16::from_le_bytes([g[0], g[1]]).is_nan()
                            && f16::from_le_bytes([w[0], w[1]]).is_nan()
                    }
                    DataType::Bf16 => {
                        bf16::from_le_bytes([g[0], g[1]]).is_nan()
                            && bf16::from_le_bytes([w[0], w[1]]).is_nan()
                    }
                    DataType::F8E4M3 => {
                        F8E4M3(g[0]).to_f32().is_nan() && F8E4M3(w[0]).to_f32().is_nan()
                    }
                    DataType::F8E5M2 => {
                        F8E5M2(g[0]).to_f32().is_nan() && F8E5M2(w[0]).to_f32().is_nan()
                    }
                    _ => false,
                }
        })
    }

    /// A buffer holding `data` at byte offset `shift` from an 8-aligned start.
    fn placed(data: &[u8], shift: usize) -> (Vec<u64>, usize) {
        let mut v = vec![0u64; (data.len() + shift).div_ceil(8) + 1];
        bytemuck::cast_slice_mut::<u64, u8>(&mut v)[shift..shift + data.len()]
            .copy_from_slice(data);
        (v, shift)
    }

    #[test]
    fn all_dtypes_ops_lengths_alignments() {
        for dtype in DataType::ALL {
            for op in RedOp::ALL {
                for (k, &len) in LENS.iter().enumerate() {
                    let a = values(dtype, len, 1 + k as u64);
                    let b = values(dtype, len, 100 + k as u64);
                    let want = reference(&a, &b, dtype, op);
                    // Shifts: aligned, and misaligned by 1 and 3 bytes in different buffers.
                    for (sd, sa, sb) in [
                        (0, 0, 0),
                        (1, 0, 0),
                        (0, 3, 1),
                        (3, 1, 0),
                        (2, 0, 0),
                        (0, 2, 0),
                        (4, 4, 2),
                    ] {
                        let ctx = format!("{dtype} {op} len {len} shifts {sd},{sa},{sb}");
                        // reduce_into
                        let (mut dv, d0) = placed(&a, sd);
                        let (bv, b0) = placed(&b, sb);
                        let bb = &bytemuck::cast_slice::<u64, u8>(&bv)[b0..b0 + b.len()];
                        let d = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut dv)[d0..d0 + a.len()];
                        reduce_into(d, bb, dtype, op).unwrap();
                        assert!(same(d, &want, dtype), "reduce_into {ctx}");
                        // reduce_to
                        let (av, a0) = placed(&a, sa);
                        let ab = &bytemuck::cast_slice::<u64, u8>(&av)[a0..a0 + a.len()];
                        let (mut dv, d0) = placed(&vec![0xAB; a.len()], sd);
                        let d = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut dv)[d0..d0 + a.len()];
                        reduce_to(d, ab, bb, dtype, op).unwrap();
                        assert!(same(d, &want, dtype), "reduce_to {ctx}");
                    }
                }
            }
        }
    }

    fn typed<T: Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    fn untyped<T: Pod>(v: &[u8]) -> Vec<T> {
        let sz = std::mem::size_of::<T>();
        v.chunks(sz).map(bytemuck::pod_read_unaligned).collect()
    }

    #[test]
    fn integers_wrap() {
        let mut d = typed(&[i8::MAX, i8::MIN, 100i8]);
        reduce_into(&mut d, &typed(&[1i8, -1, 3]), DataType::I8, RedOp::Sum).unwrap();
        assert_eq!(d, typed(&[i8::MIN, i8::MAX, 103i8]));
        let mut d = typed(&[100i8, -128]);
        reduce_into(&mut d, &typed(&[3i8, -1]), DataType::I8, RedOp::Prod).unwrap();
        assert_eq!(d, typed(&[44i8, -128]));
        let mut d = typed(&[u32::MAX, 0x8000_0000u32]);
        reduce_into(&mut d, &typed(&[2u32, 2]), DataType::U32, RedOp::Sum).unwrap();
        assert_eq!(d, typed(&[1u32, 0x8000_0002]));
        let mut d = typed(&[u64::MAX, 1u64 << 63]);
        reduce_into(&mut d, &typed(&[u64::MAX, 2]), DataType::U64, RedOp::Prod).unwrap();
        assert_eq!(d, typed(&[1u64, 0]));
        let mut d = typed(&[i64::MIN, 5i64]);
        let (a, b) = (typed(&[i64::MIN, -7i64]), typed(&[-1i64, 3]));
        reduce_to(&mut d, &a, &b, DataType::I64, RedOp::Sum).unwrap();
        assert_eq!(d, typed(&[i64::MAX, -4i64]));
        let mut d = typed(&[-5i32, 7, i32::MIN]);
        reduce_into(&mut d, &typed(&[3i32, -9, 0]), DataType::I32, RedOp::Max).unwrap();
        assert_eq!(d, typed(&[3i32, 7, 0]));
        let mut d = typed(&[200u8, 7]);
        reduce_into(&mut d, &typed(&[100u8, 9]), DataType::U8, RedOp::Min).unwrap();
        assert_eq!(d, typed(&[100u8, 7]));
    }

    fn bf(v: &[f32]) -> Vec<u8> {
        v.iter()
            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
            .collect()
    }
    fn un_bf(v: &[u8]) -> Vec<bf16> {
        v.chunks(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]))
            .collect()
    }
    fn hf(v: &[f32]) -> Vec<u8> {
        v.iter()
            .flat_map(|&x| f16::from_f32(x).to_le_bytes())
            .collect()
    }
    fn un_hf(v: &[u8]) -> Vec<f16> {
        v.chunks(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]))
            .collect()
    }

    /// bf16 conversions against `half`'s own: every bf16 widens exactly, and many non-NaN
    /// f32 patterns (random, ties, just off ties, specials) round the same way.
    #[test]
    fn bf16_conversions_match_half() {
        for h in 0..=u16::MAX {
            let h = bf16::from_bits(h);
            let (got, want) = (bf16_widen(h), h.to_f32());
            if want.is_nan() {
                assert!(got.is_nan() && got.is_sign_negative() == want.is_sign_negative());
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "widen {h:?}");
            }
        }
        let specials = [
            0.0f32,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::from_bits(0x7f7f_8000),
            f32::from_bits(0xff7f_ffff),
            1.0e-40,
            -1.0e-40,
        ];
        let raw = bytes(4 * 200_000, 7);
        let pats = raw.chunks(4).flat_map(|c| {
            let b = u32::from_le_bytes(c.try_into().unwrap());
            // Random; low bits set to ties, just below and just above.
            [
                b,
                (b & !0xffff) | 0x8000,
                (b & !0xffff) | 0x7fff,
                (b & !0xffff) | 0x8001,
            ]
        });
        for b in pats.chain(specials.iter().map(|x| x.to_bits())) {
            let x = f32::from_bits(b);
            if !x.is_nan() {
                let (got, want) = (bf16_narrow(x, Origin::Arith), bf16::from_f32(x));
                assert_eq!(got.to_bits(), want.to_bits(), "{b:#x} ({x:e})");
            }
        }
    }

    /// The shortcuts taken for [`Origin::Arith`] and [`Origin::Pick`] round as `half` does
    /// on results of those operations on any bf16 inputs; NaNs stay NaNs, made quiet.
    #[test]
    fn bf16_rounding_shortcuts() {
        let raw = bytes(4 * 300_000, 11);
        let mut pairs: Vec<(u16, u16)> = raw
            .chunks(4)
            .map(|c| {
                (
                    u16::from_le_bytes([c[0], c[1]]),
                    u16::from_le_bytes([c[2], c[3]]),
                )
            })
            .collect();
        // Signalling, quiet and all-ones NaNs, infinities, zeros, extremes.
        let special = [
            0x7f81u16, 0xff81, 0x7fc0, 0xffff, 0x7fff, 0x7f80, 0xff80, 0, 0x8000, 0x7f7f, 0x0001,
        ];
        for &x in &special {
            for &y in &special {
                pairs.push((x, y));
            }
            pairs.push((x, 0x3f80));
        }
        let same = |x: f32, o: Origin| {
            let (got, want) = (bf16_narrow(x, o), bf16::from_f32(x));
            if x.is_nan() {
                assert!(got.is_nan() && got.to_bits() & 0x40 != 0, "{o:?} {x:e}");
                assert_eq!(got.is_sign_negative(), x.is_sign_negative(), "{o:?} {x:e}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{o:?} {x:e}");
            }
            // The word kernels take the upper half of the same rounding.
            assert_eq!(bf16_round(x, o) >> 16, got.to_bits() as u32);
        };
        for (x, y) in pairs {
            let (x, y) = (
                bf16_widen(bf16::from_bits(x)),
                bf16_widen(bf16::from_bits(y)),
            );
            same(x + y, Origin::Arith);
            same(x * y, Origin::Arith);
            same(x / 3.0, Origin::Arith);
            same(x.max(y), Origin::Pick);
            same(x.min(y), Origin::Pick);
        }
    }

    #[test]
    fn bf16_rounding() {
        // bf16 has 8 significand bits: spacing in [1, 2) is 2^-7 = 0.0078125.
        let ulp = 1.0 / 128.0;
        let a = bf(&[
            1.0,
            1.0 + ulp,
            1.0,
            1.0,
            256.0,
            f32::INFINITY,
            1.0,
            3.0e38,
            -3.0e38,
        ]);
        // 1 + ulp/2 (tie, to even: 1), 1 + ulp + ulp/2 (tie, to even: 1 + 2ulp),
        // 1 + 0.75 ulp (up), 1 + 0.25 ulp (down), 256+1 (tie to even 256), inf stays, NaN,
        // overflow to +-inf.
        let b: Vec<u8> = [
            bf16::from_f32(ulp / 2.0),
            bf16::from_f32(ulp / 2.0),
            bf16::from_f32(ulp * 0.75),
            bf16::from_f32(ulp * 0.25),
            bf16::from_f32(1.0),
            bf16::from_f32(1.0),
            bf16::NAN,
            bf16::from_f32(3.0e38),
            bf16::from_f32(-3.0e38),
        ]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
        let mut d = a.clone();
        reduce_into(&mut d, &b, DataType::Bf16, RedOp::Sum).unwrap();
        let r = un_bf(&d);
        assert_eq!(r[0].to_f32(), 1.0);
        assert_eq!(r[1].to_f32(), 1.0 + 2.0 * ulp);
        assert_eq!(r[2].to_f32(), 1.0 + ulp);
        assert_eq!(r[3].to_f32(), 1.0);
        assert_eq!(r[4].to_f32(), 256.0);
        assert_eq!(r[5].to_f32(), f32::INFINITY);
        assert!(r[6].is_nan());
        assert_eq!(r[7].to_f32(), f32::INFINITY);
        assert_eq!(r[8].to_f32(), f32::NEG_INFINITY);
        // reduce_to gives the same.
        let mut d2 = vec![0; a.len()];
        reduce_to(&mut d2, &a, &b, DataType::Bf16, RedOp::Sum).unwrap();
        assert!(same(&d2, &d, DataType::Bf16));
        // inf - inf is NaN; NaN in Max loses to a number; Max/Min otherwise exact.
        let mut d = bf(&[f32::INFINITY, f32::NAN, -2.5, 7.0]);
        reduce_into(
            &mut d,
            &bf(&[f32::NEG_INFINITY, 3.0, -2.0, 7.5]),
            DataType::Bf16,
            RedOp::Sum,
        )
        .unwrap();
        assert!(un_bf(&d)[0].is_nan());
        assert!(un_bf(&d)[1].is_nan());
        let mut d = bf(&[f32::NAN, -2.5, 7.0]);
        reduce_into(&mut d, &bf(&[3.0, -2.0, 7.5]), DataType::Bf16, RedOp::Max).unwrap();
        assert_eq!(
            un_bf(&d).iter().map(|x| x.to_f32()).collect::<Vec<_>>(),
            [3.0, -2.0, 7.5]
        );
    }

    #[test]
    fn f16_rounding() {
        // f16 has 11 significand bits: spacing in [1, 2) is 2^-10.
        let ulp = 1.0f32 / 1024.0;
        let a = hf(&[1.0, 1.0 + ulp, 1.0, 60000.0, f32::INFINITY, 1.0]);
        let b = hf(&[ulp / 2.0, ulp / 2.0, ulp * 0.75, 60000.0, 1.0, f32::NAN]);
        let mut d = vec![0; a.len()];
        reduce_to(&mut d, &a, &b, DataType::F16, RedOp::Sum).unwrap();
        let r = un_hf(&d);
        assert_eq!(r[0].to_f32(), 1.0, "tie to even, down");
        assert_eq!(r[1].to_f32(), 1.0 + 2.0 * ulp, "tie to even, up");
        assert_eq!(r[2].to_f32(), 1.0 + ulp, "round up");
        assert_eq!(r[3].to_f32(), f32::INFINITY, "overflow");
        assert_eq!(r[4].to_f32(), f32::INFINITY);
        assert!(r[5].is_nan());
        let mut d = hf(&[f32::NAN, 2.0]);
        reduce_into(&mut d, &hf(&[1.5, -3.0]), DataType::F16, RedOp::Min).unwrap();
        assert_eq!(
            un_hf(&d).iter().map(|x| x.to_f32()).collect::<Vec<_>>(),
            [1.5, -3.0]
        );
    }

    #[test]
    fn float_nan_inf() {
        let mut d = typed(&[f32::NAN, 1.0, f32::INFINITY, f32::INFINITY]);
        let s = typed(&[1.0f32, f32::NAN, 1.0, f32::NEG_INFINITY]);
        reduce_into(&mut d, &s, DataType::F32, RedOp::Sum).unwrap();
        let r: Vec<f32> = untyped(&d);
        assert!(r[0].is_nan() && r[1].is_nan() && r[3].is_nan());
        assert_eq!(r[2], f32::INFINITY);
        let mut d = typed(&[f64::NAN, 1.0, -0.0]);
        reduce_into(
            &mut d,
            &typed(&[2.0f64, f64::NAN, 5.0]),
            DataType::F64,
            RedOp::Max,
        )
        .unwrap();
        assert_eq!(untyped::<f64>(&d), [2.0, 1.0, 5.0]);
    }

    #[test]
    fn avg() {
        let mut d = typed(&[7i32, -7, 9, i32::MIN]);
        finish_avg(&mut d, DataType::I32, 2).unwrap();
        assert_eq!(d, typed(&[3i32, -3, 4, i32::MIN / 2]));
        // nranks beyond the type's range: i8 -128 / 128 = -1, others truncate to 0.
        let mut d = typed(&[-128i8, 127, -127, 5]);
        finish_avg(&mut d, DataType::I8, 128).unwrap();
        assert_eq!(d, typed(&[-1i8, 0, 0, 0]));
        let mut d = typed(&[255u8, 10]);
        finish_avg(&mut d, DataType::U8, 300).unwrap();
        assert_eq!(d, typed(&[0u8, 0]));
        let mut d = typed(&[u64::MAX, 9]);
        finish_avg(&mut d, DataType::U64, 3).unwrap();
        assert_eq!(d, typed(&[u64::MAX / 3, 3]));
        let mut d = typed(&[1.0f32, -3.0, 0.1]);
        finish_avg(&mut d, DataType::F32, 3).unwrap();
        assert_eq!(untyped::<f32>(&d), [1.0 / 3.0, -1.0, 0.1 / 3.0]);
        let mut d = typed(&[1.0f64, 0.1]);
        finish_avg(&mut d, DataType::F64, 3).unwrap();
        assert_eq!(untyped::<f64>(&d), [1.0 / 3.0, 0.1 / 3.0]);
        let mut d = bf(&[1.0, 6.0, f32::NAN]);
        finish_avg(&mut d, DataType::Bf16, 3).unwrap();
        let r = un_bf(&d);
        assert_eq!(r[0], bf16::from_f32(1.0 / 3.0));
        assert_eq!(r[1].to_f32(), 2.0);
        assert!(r[2].is_nan());
        let mut d = hf(&[1.0, 6.0]);
        finish_avg(&mut d, DataType::F16, 3).unwrap();
        assert_eq!(un_hf(&d), [f16::from_f32(1.0 / 3.0), f16::from_f32(2.0)]);
        // Misaligned and long (crosses stage chunks), against element-by-element division.
        let vals: Vec<i64> = (0..3001).map(|i| i * 7919 - 11_000_000).collect();
        let want: Vec<u8> = typed(&vals.iter().map(|v| v / 5).collect::<Vec<_>>());
        let (mut v, s) = placed(&typed(&vals), 3);
        let buf = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut v)[s..s + vals.len() * 8];
        finish_avg(buf, DataType::I64, 5).unwrap();
        assert_eq!(buf, &want[..]);
        let vals: Vec<f32> = (0..3001).map(|i| i as f32 * 0.37 - 100.0).collect();
        let want: Vec<u8> = bf(&vals
            .iter()
            .map(|&v| bf16::from_f32(v).to_f32() / 7.0)
            .collect::<Vec<_>>());
        let (mut v, s) = placed(&bf(&vals), 1);
        let buf = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut v)[s..s + vals.len() * 2];
        finish_avg(buf, DataType::Bf16, 7).unwrap();
        assert_eq!(buf, &want[..]);
        // nranks 1 is a no-op, 0 and bad lengths are errors; empty is fine.
        let mut d = typed(&[5i32]);
        finish_avg(&mut d, DataType::I32, 1).unwrap();
        assert_eq!(d, typed(&[5i32]));
        assert!(finish_avg(&mut d, DataType::I32, 0).is_err());
        assert!(finish_avg(&mut [0u8; 3], DataType::I32, 2).is_err());
        finish_avg(&mut [], DataType::F64, 4).unwrap();
    }

    #[test]
    fn bad_lengths_are_errors() {
        let mut d = [0u8; 8];
        let e = reduce_into(&mut d, &[0u8; 4], DataType::F32, RedOp::Sum).unwrap_err();
        assert!(matches!(e, Error::Internal(_)));
        let msg = e.to_string();
        assert!(msg.contains('8') && msg.contains('4'), "{msg}");
        assert!(reduce_into(&mut d[..6], &[0u8; 6], DataType::F32, RedOp::Sum).is_err());
        assert!(reduce_into(&mut d[..3], &[0u8; 3], DataType::Bf16, RedOp::Max).is_err());
        assert!(reduce_to(&mut d, &[0u8; 8], &[0u8; 7], DataType::U8, RedOp::Sum).is_err());
        assert!(reduce_to(&mut d, &[0u8; 4], &[0u8; 8], DataType::U8, RedOp::Sum).is_err());
        assert!(reduce_to(&mut d[..4], &[0u8; 8], &[0u8; 8], DataType::I64, RedOp::Sum).is_err());
        // Unchanged after an error.
        assert_eq!(d, [0u8; 8]);
        reduce_into(&mut [], &[], DataType::F64, RedOp::Prod).unwrap();
        reduce_to(&mut [], &[], &[], DataType::Bf16, RedOp::Min).unwrap();
    }
}
