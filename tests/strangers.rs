//! Strangers at every listener (issue 22): processes that reach a rank's ports without
//! belonging to the job — port scanners, idle and half-open connections, random bytes,
//! well-formed messages without the job secret — while a job runs. The job completes; the
//! impostor cannot register or abort.
//!
//! The ranks are threads of this process, so the ports attacked are found the way a
//! stranger on the host would: every TCP port this process listens on (`/proc`).

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::strangers::*;
use roccl::bootstrap::{rendezvous, UniqueId};

/// The job secret of the launcher-mode tests.
const SECRET: [u8; 16] = *b"0123456789abcdef";

/// Launcher mode with a job secret: rank 0 serves the root at `addr` (port 0: any).
fn launcher_root(addr: SocketAddr) -> UniqueId {
    roccl::bootstrap::serve_root_with(addr, Some(SECRET)).unwrap()
}

/// The id every other rank computes from the root's address and the job secret.
fn launcher_id(addr: SocketAddr) -> UniqueId {
    UniqueId::for_address_with(addr, Some(SECRET))
}

/// Register `rank` of `nranks` with `id` from a thread.
fn register(
    id: UniqueId,
    rank: usize,
    nranks: usize,
    timeout: Duration,
) -> std::thread::JoinHandle<roccl::Result<Vec<Vec<u8>>>> {
    std::thread::spawn(move || rendezvous(&id, rank, nranks, &[rank as u8; 5], timeout))
}

/// Before the fix the root read one connection at a time, blocking up to 10 s on each: idle
/// connections made the rendezvous time out ("ranks … never arrived" — they had).
#[test]
fn idle_slow_and_garbage_connections_do_not_stall_the_root() {
    let id = launcher_root("127.0.0.1:0".parse().unwrap());
    let (addr, _) = id.root().unwrap();
    let mut held = strangers_at(addr, 5);
    for _ in 0..4 {
        held.push(TcpStream::connect(addr).unwrap());
    }
    // A slow sender: one byte of a registration every 300 ms.
    let slow = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        for b in 0x3253_4252u32.to_le_bytes().iter().cycle().take(20) {
            if s.write_all(&[*b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    });
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    let others = launcher_id(addr);
    let hs: Vec<_> = (0..3)
        .map(|r| {
            register(
                if r == 0 { id } else { others },
                r,
                3,
                Duration::from_secs(8),
            )
        })
        .collect();
    for h in hs {
        let table = h.join().unwrap().expect("rendezvous");
        assert_eq!(table, vec![vec![0u8; 5], vec![1u8; 5], vec![2u8; 5]]);
    }
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "the rendezvous took {:?}",
        t.elapsed()
    );
    drop(held);
    slow.join().unwrap();
}

/// An impostor who knows the root's address and port (launcher mode) but not the job
/// secret: it cannot register as a rank (before the fix it was accepted as rank 2 and got
/// every rank's blob), nor abort the rendezvous with a 1 ms timeout (before the fix: every
/// rank failed).
#[test]
fn an_impostor_that_knows_the_port_cannot_register_or_abort() {
    let id = launcher_root("127.0.0.1:0".parse().unwrap());
    let (addr, _) = id.root().unwrap();
    // What anyone can compute from the port: the id without the secret.
    let forged = UniqueId::for_address(addr);
    let impostor = register(forged, 2, 3, Duration::from_millis(1));
    let e = impostor.join().unwrap();
    if let Ok(t) = &e {
        panic!("the impostor joined and got {} blobs", t.len());
    }
    let e = e.unwrap_err().to_string();
    assert!(e.contains("not authenticated"), "{e}");
    std::thread::sleep(Duration::from_millis(50));
    let others = launcher_id(addr);
    let hs: Vec<_> = (0..3)
        .map(|r| {
            register(
                if r == 0 { id } else { others },
                r,
                3,
                Duration::from_secs(8),
            )
        })
        .collect();
    for h in hs {
        let table = h.join().unwrap().expect("rendezvous");
        assert_eq!(table, vec![vec![0u8; 5], vec![1u8; 5], vec![2u8; 5]]);
    }
}

/// A rank that knows the secret but is late (the rendezvous is over) gets the usual error:
/// nobody serves the root any more.
#[test]
fn a_late_rank_with_the_secret_gets_the_usual_error() {
    let id = launcher_root("127.0.0.1:0".parse().unwrap());
    let (addr, _) = id.root().unwrap();
    let hs: Vec<_> = (0..2)
        .map(|r| {
            register(
                if r == 0 { id } else { launcher_id(addr) },
                r,
                2,
                Duration::from_secs(8),
            )
        })
        .collect();
    for h in hs {
        h.join().unwrap().expect("rendezvous");
    }
    let e = rendezvous(&launcher_id(addr), 1, 2, b"x", Duration::from_millis(600))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("could not reach the bootstrap root") || e.contains("root exited"),
        "{e}"
    );
}

/// Plain bytes of a reply from the root (to see that strangers get nothing).
#[test]
fn garbage_gets_no_answer_from_the_root() {
    let id = UniqueId::new().unwrap();
    let (addr, _) = id.root().unwrap();
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(&noise(9, 200)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut b = [0u8; 16];
    // Closed without a word (0 bytes) rather than answered.
    assert_eq!(s.read(&mut b).unwrap_or(0), 0);
    // The root still serves the job.
    let hs: Vec<_> = (0..2)
        .map(|r| register(id, r, 2, Duration::from_secs(8)))
        .collect();
    for h in hs {
        h.join().unwrap().expect("rendezvous");
    }
}
