//! Secrets stay off the wire: what a job hands its ranks through the data path or a store is
//! public, and the secret of a new communicator is derived on every rank (docs/SECURITY.md).
//! Checked by capturing loopback while the job runs (root only; SKIPPED otherwise, saying
//! so). Alone in its file: other tests' traffic on loopback would be captured too.

mod common;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::*;
use roccl::algo::model::Tuning;
use roccl::bootstrap::UniqueId;
use roccl::net::NetKind;
use roccl::RedOp;

/// Every frame seen on the loopback interface until `stop`, concatenated.
struct Capture {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<u8>>,
}

impl Capture {
    /// Start capturing `lo`; `None` when this process may not (not root).
    fn start() -> Option<Capture> {
        let proto = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: socket(2) with constant arguments; the result is checked.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, proto as i32) };
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a NUL-terminated name.
        let lo = unsafe { libc::if_nametoindex(c"lo".as_ptr()) };
        // SAFETY: a zeroed sockaddr_ll is valid; the fields used are set below.
        let mut sa: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sa.sll_family = libc::AF_PACKET as u16;
        sa.sll_protocol = proto;
        sa.sll_ifindex = lo as i32;
        // SAFETY: `sa` is a valid sockaddr_ll of the size given.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &sa as *const libc::sockaddr_ll as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(r, 0, "bind the capture socket to lo");
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 50_000,
        };
        // SAFETY: SO_RCVTIMEO takes a timeval of this size.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const libc::timeval as *const libc::c_void,
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        let stop = Arc::new(AtomicBool::new(false));
        let s = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut all = Vec::new();
            let mut buf = vec![0u8; 1 << 16];
            while !s.load(Ordering::Relaxed) {
                // SAFETY: `buf` is writable for its length.
                let n =
                    unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
                if n > 0 {
                    all.extend_from_slice(&buf[..n as usize]);
                }
            }
            all
        });
        Some(Capture { stop, thread })
    }

    fn finish(self) -> Vec<u8> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

fn count(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).filter(|w| *w == needle).count()
}

#[test]
fn a_split_sends_no_unique_id_over_the_data_path() {
    let Some(cap) = Capture::start() else {
        eprintln!("SKIPPED (capture): opening an AF_PACKET socket needs root");
        return;
    };
    // Unencrypted TCP on loopback: whatever the all-gathers carry is in the clear.
    let mut cfg = config(Tuning::default());
    cfg.net = NetKind::Tcp;
    let id = UniqueId::new_with(false).unwrap();
    let marker = *b"roccl-split-test-marker!";
    run_ranks_of(id, 4, cfg, |c| {
        // A marker through the data path shows that the capture sees it.
        let mut m = marker.to_vec();
        c.broadcast(&mut m, 0).unwrap();
        let child = c
            .split(Some((c.rank() % 2) as u32), 0)
            .unwrap()
            .expect("every rank has a color");
        let mut v = [1.0f32; 2];
        child.all_reduce_in_place(&mut v, RedOp::Sum).unwrap();
        assert_eq!(v, [2.0; 2]);
    });
    let seen = cap.finish();
    assert!(
        count(&seen, &marker) > 0,
        "the capture did not see the data path"
    );
    // A unique id starts with "RCID" and carries the secret at bytes 32..48.
    assert_eq!(
        count(&seen, b"RCID"),
        0,
        "a unique id (with its secret) crossed loopback in the clear during split"
    );
}
