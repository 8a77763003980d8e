//! Throughput of the reduction kernels on 1 MiB cache-resident buffers.
//!
//! Throughput is counted in bytes of the source buffer per second.

use std::time::Duration;

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use roccl::reduce::{reduce_into, reduce_to};
use roccl::{DataType, RedOp};

const LEN: usize = 1 << 20;

/// A 1 MiB buffer of small, finite values of `dtype` (so float sums never overflow to inf).
fn buffer(dtype: DataType, seed: u32) -> Vec<u8> {
    let n = LEN / dtype.size();
    let v =
        |i: usize| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 20) as f32 / 64.0;
    let mut out = Vec::with_capacity(LEN);
    for i in 0..n {
        match dtype {
            DataType::F16 => out.extend(half::f16::from_f32(v(i)).to_le_bytes()),
            DataType::Bf16 => out.extend(half::bf16::from_f32(v(i)).to_le_bytes()),
            DataType::F32 => out.extend(v(i).to_le_bytes()),
            DataType::F64 => out.extend((v(i) as f64).to_le_bytes()),
            _ => out.extend_from_slice(&(v(i) as u64).to_le_bytes()[..dtype.size()]),
        }
    }
    out
}

/// A buffer aligned to 64 bytes holding `bytes`.
fn aligned(bytes: &[u8]) -> Vec<u64> {
    let mut v = vec![0u64; bytes.len().div_ceil(8)];
    bytemuck::cast_slice_mut::<u64, u8>(&mut v)[..bytes.len()].copy_from_slice(bytes);
    v
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("reduce");
    g.warm_up_time(Duration::from_millis(500));
    g.measurement_time(Duration::from_secs(1));
    g.sample_size(20);
    g.throughput(Throughput::Bytes(LEN as u64));

    let mut into = DataType::ALL
        .iter()
        .map(|&d| (d, RedOp::Sum))
        .collect::<Vec<_>>();
    into.push((DataType::F32, RedOp::Max));
    into.push((DataType::Bf16, RedOp::Max));
    for (dtype, op) in into {
        let mut dst = aligned(&buffer(dtype, 1));
        let src = aligned(&buffer(dtype, 2));
        g.bench_function(BenchmarkId::new("into", format!("{dtype}/{op}")), |b| {
            b.iter(|| {
                let d = bytemuck::cast_slice_mut::<u64, u8>(&mut dst);
                reduce_into(
                    black_box(d),
                    black_box(bytemuck::cast_slice(&src)),
                    dtype,
                    op,
                )
                .unwrap()
            })
        });
    }

    for dtype in [DataType::F32, DataType::Bf16] {
        let a = aligned(&buffer(dtype, 1));
        let b2 = aligned(&buffer(dtype, 2));
        let mut dst = vec![0u64; LEN / 8];
        g.bench_function(BenchmarkId::new("to", format!("{dtype}/sum")), |b| {
            b.iter(|| {
                let d = bytemuck::cast_slice_mut::<u64, u8>(&mut dst);
                let (a, b2) = (bytemuck::cast_slice(&a), bytemuck::cast_slice(&b2));
                reduce_to(black_box(d), black_box(a), black_box(b2), dtype, RedOp::Sum).unwrap()
            })
        });
    }
    g.finish();

    // The machine's copy speed, the yardstick for the kernels above and for TCP.
    let mut g = c.benchmark_group("memcpy");
    g.warm_up_time(Duration::from_millis(500));
    g.measurement_time(Duration::from_secs(1));
    g.sample_size(20);
    for len in [LEN, 64 << 20] {
        let src = vec![1u64; len / 8];
        let mut dst = vec![0u64; len / 8];
        g.throughput(Throughput::Bytes(len as u64));
        g.bench_function(BenchmarkId::new("copy", len), |b| {
            b.iter(|| dst.copy_from_slice(black_box(&src)))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
