//! The floor under any all-reduce over TCP on this host: a bare ring exchange of the bytes a
//! ring all-reduce puts on the wire, with nothing else (no reduction, no protocol, no
//! library). Each of N threads (at most one per CPU, pinned like `roccl-perf` pins its
//! ranks) sends 2(N−1)/N·B bytes to the next and receives as many from the previous over
//! loopback TCP, with non-blocking sockets in a busy loop.
//!
//! ```text
//! cargo run --release --example tcp_floor -- [--ranks N] [-b MIN] [-e MAX] [-f F] [-i ITERS]
//! ```
//!
//! Prints `tcp-floor BYTES TIME_US BUSBW` per all-reduce size B (the median over iterations
//! of the slowest thread, best of an autotuned and a 256 KiB send buffer), the rows
//! `scripts/compare.sh` reads. It is what merely moving the bytes costs: a TCP all-reduce
//! here can beat it only by how it cuts its sends (roccl's pipelined two-shot does, by a few
//! per cent, at 1–2 MiB), not by a factor; at 16 MiB and up roccl runs at this row.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Instant;

use clap::Parser;
use socket2::SockRef;

#[derive(Parser)]
struct Args {
    /// Threads in the ring (all-reduce ranks).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Smallest all-reduce size in bytes (K/M suffixes).
    #[arg(short = 'b', default_value = "1M")]
    min: String,
    /// Largest all-reduce size in bytes.
    #[arg(short = 'e', default_value = "64M")]
    max: String,
    /// Size multiplication factor.
    #[arg(short = 'f', default_value_t = 4)]
    factor: usize,
    /// Timed iterations per size.
    #[arg(short = 'i', long, default_value_t = 20)]
    iters: usize,
    /// Untimed iterations per size.
    #[arg(short = 'w', long, default_value_t = 3)]
    warmup: usize,
}

/// Send `out` on `tx` while receiving `inp.len()` bytes on `rx`, busy-polling both.
fn exchange(tx: &mut TcpStream, rx: &mut TcpStream, out: &[u8], inp: &mut [u8]) {
    let (mut s, mut r) = (0, 0);
    while s < out.len() || r < inp.len() {
        if s < out.len() {
            match tx.write(&out[s..]) {
                Ok(w) => s += w,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => panic!("send: {e}"),
            }
        }
        if r < inp.len() {
            match rx.read(&mut inp[r..]) {
                Ok(0) => panic!("peer closed"),
                Ok(n) => r += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => panic!("recv: {e}"),
            }
        }
    }
}

/// Median over iterations of the slowest thread, in seconds.
fn run(n: usize, wire: usize, iters: usize, warmup: usize, sndbuf: Option<usize>) -> f64 {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind a loopback port"))
        .collect();
    let addrs: Vec<_> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let times = Arc::new(Mutex::new(vec![0f64; iters]));
    let barrier = Arc::new(Barrier::new(n));
    let cpus = roccl::os::allowed_cpus().expect("sched_getaffinity");
    let threads: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(i, listener)| {
            let next = addrs[(i + 1) % n];
            let (times, barrier) = (times.clone(), barrier.clone());
            let cpu = cpus[i];
            std::thread::spawn(move || {
                roccl::os::bind_to_cpu(cpu).expect("pin the thread");
                let mut tx = TcpStream::connect(next).expect("connect to the next thread");
                let (mut rx, _) = listener.accept().expect("accept the previous thread");
                for s in [&tx, &rx] {
                    s.set_nodelay(true).unwrap();
                    s.set_nonblocking(true).unwrap();
                }
                if let Some(b) = sndbuf {
                    SockRef::from(&tx).set_send_buffer_size(b).unwrap();
                }
                let out = vec![i as u8 + 1; wire];
                let mut inp = vec![0u8; wire];
                for it in 0..warmup + iters {
                    barrier.wait();
                    let t = Instant::now();
                    exchange(&mut tx, &mut rx, &out, &mut inp);
                    let dt = t.elapsed().as_secs_f64();
                    assert!(inp.iter().all(|&b| b as usize == (i + n - 1) % n + 1));
                    if it >= warmup {
                        let mut tm = times.lock().unwrap();
                        tm[it - warmup] = tm[it - warmup].max(dt);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("exchange thread");
    }
    let mut t = times.lock().unwrap().clone();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() {
    let a = Args::parse();
    let parse = |s: &str| roccl::envvar::parse_bytes(s).expect("a size such as 4096, 64K or 16M");
    let (mut b, max) = (parse(&a.min), parse(&a.max));
    let n = a.ranks.max(2);
    let cpus = roccl::os::allowed_cpus().expect("sched_getaffinity").len();
    if n > cpus {
        eprintln!(
            "tcp_floor: {n} threads on {cpus} CPUs: busy loops that share CPUs measure the scheduler, not the floor; use at most {cpus}"
        );
        std::process::exit(2);
    }
    while b <= max {
        // Per rank and direction, a ring all-reduce puts 2(n-1)/n of the buffer on the wire.
        let wire = (2 * (n - 1) * b / n).max(1);
        let t = [None, Some(256 << 10)]
            .into_iter()
            .map(|sb| run(n, wire, a.iters.max(1), a.warmup, sb))
            .fold(f64::INFINITY, f64::min);
        let busbw = b as f64 / t * 2.0 * (n - 1) as f64 / n as f64 / 1e9;
        println!("tcp-floor {b} {:.2} {busbw:.3}", t * 1e6);
        b *= a.factor.max(2);
    }
}
