//! Another local user at the shared-memory setup port: it cannot make a rank
//! open or map a segment, even with a setup message that carries the right tag. Acting as
//! another user needs root (the test then runs as `nobody`); otherwise it is skipped.

use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

use super::*;

const NOBODY: u32 = 65534;

/// Run `script` with bash as user `nobody`.
fn as_nobody(script: &str) -> std::process::Child {
    std::process::Command::new("/bin/bash")
        .arg("-c")
        .arg(script)
        .uid(NOBODY)
        .gid(NOBODY)
        .spawn()
        .unwrap()
}

/// The name message for segment `name` of a `ring`-byte ring, and its tag under `key`.
fn message(name: &str, ring: u64, key: &crate::bootstrap::auth::JobKey) -> Vec<u8> {
    let mut msg = vec![0u8; NAME_MSG];
    msg[0] = name.len() as u8;
    msg[1..1 + name.len()].copy_from_slice(name.as_bytes());
    msg[NAME_MSG - 8..].copy_from_slice(&ring.to_le_bytes());
    let tag = key.tag(&[&msg]);
    msg.extend_from_slice(&tag);
    msg
}

/// `l` accepts nothing for `d`.
fn accepts_nothing(l: &mut Box<dyn ListenComm>, d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        assert!(l.accept().unwrap().is_none(), "a connection was accepted");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Before the checks, both were accepted: the listener mapped a segment of another user,
/// and took a connection from another user's process.
#[test]
fn another_user_cannot_make_a_rank_open_or_map_a_segment() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: acting as another user needs root");
        return;
    }
    let ring = 1u64 << 16;
    let net = ShmNet::new(&ShmSettings::default()).unwrap();
    net.set_job_key(&crate::bootstrap::auth::JobKey::from_secret(
        &[5; 16], b"test",
    ));
    let (h, mut l) = net.listen(0).unwrap();
    let b = *h.as_bytes();
    let port = u16::from_le_bytes([b[4], b[5]]);
    let key = net.key.for_token(
        "shm",
        &b[HANDLE_TOKEN..HANDLE_TOKEN + crate::net::TOKEN_BYTES],
    );
    // 1. A segment of another user (world-writable, the right size), named by a message
    //    with the right tag from this user: Segment::open refuses it.
    let theirs = format!("/roccl-{}-7777-abc", std::process::id());
    let made = as_nobody(&format!(
        "head -c {} /dev/zero > /dev/shm{theirs} && chmod 666 /dev/shm{theirs}",
        SEG_HDR as u64 + ring
    ))
    .wait_with_output()
    .unwrap();
    assert!(made.status.success());
    let mut s = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).unwrap();
    s.write_all(&message(&theirs, ring, &key)).unwrap();
    accepts_nothing(&mut l, Duration::from_millis(800));
    let _ = std::fs::remove_file(format!("/dev/shm{theirs}"));
    // 2. Another user's process sends a message with the right tag for a segment of ours:
    //    refused by the owner of its socket before anything is read.
    let ours = format!("/roccl-{}-7778-abc", std::process::id());
    let cours = CString::new(ours.clone()).unwrap();
    let _seg = Segment::create(&cours, SEG_HDR + ring as usize).unwrap();
    let bytes: String = message(&ours, ring, &key)
        .iter()
        .map(|b| format!("\\x{b:02x}"))
        .collect();
    let mut child = as_nobody(&format!(
        "exec 3<>/dev/tcp/127.0.0.1/{port}; printf '{bytes}' >&3; sleep 2"
    ));
    accepts_nothing(&mut l, Duration::from_millis(1500));
    let _ = child.kill();
    let _ = child.wait();
    // SAFETY: unlinking the name this test created.
    unsafe { libc::shm_unlink(cours.as_ptr()) };
}
