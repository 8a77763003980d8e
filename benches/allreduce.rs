//! In-process all-reduce: 2 ranks as threads over TCP loopback, per algorithm and size.
//! (The cross-process figures come from roccl-perf; see docs/PERFORMANCE.md.)

use std::sync::mpsc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use roccl::{Algo, CallOpts, Collective, Communicator, Config, DataType, RedOp, UniqueId};

fn bench(c: &mut Criterion) {
    let id = UniqueId::new().unwrap();
    let cfg = Config::from_env().unwrap();
    let cfg1 = cfg.clone();
    let peer = std::thread::spawn(move || Communicator::init_with(&id, 2, 1, cfg1).unwrap());
    let c0 = Communicator::init_with(&id, 2, 0, cfg).unwrap();
    let c1 = peer.join().unwrap();
    // Rank 1 runs whatever rank 0 is about to time.
    let (tx, rx) = mpsc::channel::<(usize, Algo, u64)>();
    let worker = std::thread::spawn(move || {
        while let Ok((bytes, algo, iters)) = rx.recv() {
            let mut buf = vec![0u8; bytes];
            for _ in 0..iters {
                c1.run_raw(
                    Collective::AllReduce(RedOp::Sum),
                    DataType::F32,
                    None,
                    &mut buf,
                    &CallOpts {
                        algo: Some(algo),
                        ..Default::default()
                    },
                )
                .unwrap();
            }
        }
    });
    let mut g = c.benchmark_group("all_reduce_2ranks_f32");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(20);
    for bytes in [8usize, 64 << 10, 1 << 20] {
        g.throughput(Throughput::Bytes(bytes as u64));
        for algo in [Algo::Direct, Algo::Ring, Algo::Tree] {
            if algo == Algo::Direct && bytes > (1 << 20) {
                continue;
            }
            let mut buf = vec![0u8; bytes];
            g.bench_with_input(BenchmarkId::new(algo.name(), bytes), &bytes, |b, &bytes| {
                b.iter_custom(|iters| {
                    tx.send((bytes, algo, iters)).unwrap();
                    let t = Instant::now();
                    for _ in 0..iters {
                        c0.run_raw(
                            Collective::AllReduce(RedOp::Sum),
                            DataType::F32,
                            None,
                            &mut buf,
                            &CallOpts {
                                algo: Some(algo),
                                ..Default::default()
                            },
                        )
                        .unwrap();
                    }
                    t.elapsed()
                })
            });
        }
    }
    g.finish();
    drop(tx);
    worker.join().unwrap();
}

criterion_group!(benches, bench);
criterion_main!(benches);
